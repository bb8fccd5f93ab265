"""``python -m polar_gym.audit`` on a run folder sampled from a tiny random Qwen3 saved to disk: exact logprobs
pass, a perturbed token fails with its position reported, traces without logprobs or a model are counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from polar_gym.audit.__main__ import main
from polar_gym.audit.inputs import read_traces
from polar_gym.merge.exports import slime_samples
from polar_gym.schema import SessionResult, SessionStatus, Trace, Trajectory
from tests.audit._tiny import build_model, sampled_trace, write_run

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "model"
    build_model().save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    model = build_model()
    return [sampled_trace(model, f"s{i}", seed=i) for i in range(3)]


def summary(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / "audit_summary.json").read_text()))


def test_exact_logprobs_pass(tmp_path: Path, model_dir: Path, rows: list[dict[str, Any]]) -> None:
    run = write_run(tmp_path / "run", rows)
    assert main(["--model", str(model_dir), str(run)]) == 0
    s = summary(run)
    assert s["passed"] and s["audited"] == 3 and s["metrics"]["audit/tokens"] == 3 * 24
    assert s["metrics"]["audit/logprob_abs_diff_max"] < 1e-5 and s["metrics"]["rollout_corr/k3_kl"] < 1e-9
    assert s["outliers"] == [] and s["worst"]["abs_diff"] == s["metrics"]["audit/logprob_abs_diff_max"]
    lines = [json.loads(x) for x in (run / "audit.jsonl").read_text().splitlines()]
    assert [(a["session_id"], a["tokens"], a["policy_versions"]) for a in lines] == [
        ("s0", 24, ["0"]), ("s1", 24, ["0"]), ("s2", 24, ["0"])]


def test_a_perturbed_token_fails_and_is_located(tmp_path: Path, model_dir: Path,
                                                rows: list[dict[str, Any]]) -> None:
    broken = json.loads(json.dumps(rows))
    position = broken[1]["metadata"]["spans"][2]["start"] + 3
    broken[1]["response_logprobs"][position]["logprob"] -= 0.7  # the engine "said" a lower logprob
    run = write_run(tmp_path / "run", broken)
    out = tmp_path / "out"
    assert main(["--model", str(model_dir), str(run), "--out", str(out)]) == 1
    s = summary(out)
    assert not s["passed"]
    assert any(f.startswith("rollout_corr/rollout_is_ratio_fraction_high") for f in s["failures"])  # e^0.7 > 2
    assert any(f.startswith("rollout_corr/k3_kl") for f in s["failures"])
    [worst] = s["outliers"]
    assert (worst["session_id"], worst["position"], worst["policy_version"]) == ("s1", position, 0)
    assert worst["token_id"] == broken[1]["response_ids"][position]
    assert worst["abs_diff"] == pytest.approx(0.7, abs=1e-4)
    assert worst["absolute_position"] == len(broken[1]["prompt_ids"]) + position
    # the thresholds are the user's: with the checks that tripped turned off, the same run passes
    assert main(["--model", str(model_dir), str(run), "--out", str(out), "--max-kl", "off",
                 "--max-ratio-fraction-high", "off", "--min-pearson", "0.5"]) == 0


def test_skipped_and_unaudited_are_counted(tmp_path: Path, model_dir: Path, rows: list[dict[str, Any]]) -> None:
    no_logprobs = {**rows[0], "session_id": "nolp", "response_logprobs": [],
                   "metadata": {**rows[0]["metadata"], "has_logprobs": False}}
    masked = {**rows[0], "session_id": "masked", "loss_mask": [0] * len(rows[0]["loss_mask"])}
    pixels_lost = {**rows[1], "session_id": "no-pixels", "metadata": {**rows[1]["metadata"], "images": [
        {"sha256": "ab" * 32, "media_type": "image/png", "size": 9, "prompt_span": {"start": 2, "end": 6}}]}}
    newer = json.loads(json.dumps(rows[2]))
    newer["session_id"] = "v1"
    newer["metadata"]["spans"][1]["policy_version"] = 1  # one span sampled by a version with no model given
    run = write_run(tmp_path / "run", [rows[0], no_logprobs, masked, pixels_lost, newer])
    assert main(["--model", f"0={model_dir}", str(run)]) == 0
    s = summary(run)
    # a multimodal trace whose messages lost the images (an export without them) cannot be scored as the model saw it
    assert s["skipped"] == {"no_logprobs": 1, "no_trainable_tokens": 1, "images_not_carried": 1}
    assert s["audited"] == 2 and s["unaudited_tokens"] == 8 and s["metrics"]["audit/tokens"] == 24 + 16
    # giving version 1 its own weights audits every token
    assert main(["--model", f"0={model_dir}", "--model", f"1={model_dir}", str(run)]) == 0
    assert summary(run)["unaudited_tokens"] == 0


def test_nothing_to_audit_exits_2(tmp_path: Path, model_dir: Path, rows: list[dict[str, Any]]) -> None:
    run = write_run(tmp_path / "run", [{**rows[0], "response_logprobs": [],
                                        "metadata": {**rows[0]["metadata"], "has_logprobs": False}}])
    assert main(["--model", str(model_dir), str(run)]) == 2
    assert main(["--model", str(model_dir), str(tmp_path / "missing")]) == 2


def test_slime_samples_are_read_with_their_spans(rows: list[dict[str, Any]], tmp_path: Path) -> None:
    trace = Trace.model_validate({k: v for k, v in rows[0].items() if k in Trace.model_fields})
    result = SessionResult(session_id="s0", task_id="t", status=SessionStatus.COMPLETED,
                           trajectory=Trajectory(session_id="s0", traces=[trace], builder="prefix_merging"))
    path = tmp_path / "slime.jsonl"
    path.write_text("".join(json.dumps(s.model_dump()) + "\n" for s in slime_samples(result)))
    [got] = list(read_traces(path))
    assert got.response_ids == rows[0]["response_ids"] and got.prompt_ids == rows[0]["prompt_ids"]
    assert [(s.start, s.end, s.policy_version) for s in got.spans] == [
        (s["start"], s["end"], 0) for s in rows[0]["metadata"]["spans"]]
    assert got.logprobs == trace.response_logprobs


def test_the_module_runs_as_a_command(tmp_path: Path, model_dir: Path, rows: list[dict[str, Any]]) -> None:
    run = write_run(tmp_path / "run", rows[:1])
    done = subprocess.run([sys.executable, "-m", "polar_gym.audit", "--model", str(model_dir), str(run)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout and "k3 KL" in done.stdout
