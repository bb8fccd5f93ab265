"""report.html shows each GRPO step's trainer-vs-engine mismatch and rollout-correction statistics (the rows of
train_metrics.jsonl), with whether the step trained; a run whose rows lack them shows no such panel."""

from __future__ import annotations

from polar_gym.report.files import build_report
from polar_gym.report.model import Fidelity, RunData

ROWS = [{"step": 1, "trained": True, "not_trained_reasons": [], "audit/logprob_abs_diff_mean": 2.5e-7,
         "rollout_corr/k3_kl": 1.2e-13, "rollout_corr/correction_is_mean": 0.98,
         "rollout_corr/correction_is_eff_sample_size": 0.97, "masked_tokens/rollout_correction": 3.0,
         "guard/tokens_unknown_version": 2.0, "guard/tokens_version_not_kept": 5.0},
        {"step": 2, "trained": False, "not_trained_reasons": ["mismatch"], "audit/logprob_abs_diff_mean": 9.8e-4}]


def test_the_report_has_a_mismatch_and_correction_panel_per_step() -> None:
    page = build_report(RunData("training run", [], Fidelity(), train_rows=ROWS))
    panel = page[page.index('<section id="correction">'):]
    panel = panel[:panel.index("</section>")]
    assert "Trainer vs engine: mismatch and correction" in panel
    assert "<td>no: mismatch</td>" in panel and "<td class=num>0.00098</td>" in panel
    assert "<td class=num>0.97</td>" in panel and "<td class=num>3</td>" in panel
    assert "<td class=num>7</td>" in panel  # unknown (2) and no-longer-kept (5) versions together


def test_no_panel_without_the_keys() -> None:
    page = build_report(RunData("training run", [], Fidelity(), train_rows=[{"step": 1, "loss": 0.3}]))
    assert 'id="correction"' not in page
