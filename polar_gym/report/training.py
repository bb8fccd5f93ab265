"""How a training run's steps read: which trained and why the others did not (pure; no matplotlib, no I/O).

A GRPO step row of ``train_metrics.jsonl`` carries ``trained`` (bool) and ``not_trained_reasons`` (codes from
:data:`NOT_TRAINED`, decided by :func:`polar_gym.trainer.verdict.step_verdict`). A row without ``trained`` (SFT,
or a run older than the verdict) counts as trained: nothing here is claimed that a row did not say. The same
summary is the report's banner and the trainer's last console line, so the two never read differently.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MISMATCH", "NOT_POLICY_SAMPLED", "NOT_TRAINED", "NO_SIGNAL", "NO_TRACES", "not_trained_counts",
           "trained_summary"]

NO_TRACES = "no_traces"
NO_SIGNAL = "no_signal"
NOT_POLICY_SAMPLED = "not_policy_sampled"
MISMATCH = "mismatch"

#: every reason a step is not counted as training, as one line reads it
NOT_TRAINED: dict[str, str] = {
    NO_TRACES: "no trainable trace (no completed session sampled a token)",
    NO_SIGNAL: "every group's rewards were equal (no signal)",
    NOT_POLICY_SAMPLED: "the traces were not sampled by the policy (a scripted engine such as the oracle)",
    MISMATCH: "the trainer's logprobs were far from the engine's (trainer.mismatch_metric above "
              "trainer.max_mismatch)",
}


def _reasons(row: Mapping[str, Any]) -> list[str]:
    reasons = row.get("not_trained_reasons")
    return [str(r) for r in reasons] if isinstance(reasons, list) else []


def not_trained_counts(rows: Sequence[Mapping[str, Any]]) -> tuple[int, int, Counter[str]]:
    """(steps that trained, steps with a verdict, steps per reason code) over rows that carry ``trained``."""
    judged = [r for r in rows if isinstance(r.get("trained"), bool)]
    reasons = Counter(code for r in judged if not r["trained"] for code in _reasons(r))
    return sum(bool(r["trained"]) for r in judged), len(judged), reasons


def trained_summary(rows: Sequence[Mapping[str, Any]], algorithm: str = "GRPO") -> str | None:
    """``"GRPO: 0 of 3 steps trained — every group's rewards were equal (no signal)"``; None when every judged step
    trained (or no row was judged). A reason shared by only some of the untrained steps says how many."""
    trained, judged, reasons = not_trained_counts(rows)
    if trained == judged:
        return None
    untrained = judged - trained
    parts = [NOT_TRAINED.get(code, code) + ("" if n == untrained else f" ({n} step{'s' if n != 1 else ''})")
             for code, n in reasons.most_common()]
    return (f"{algorithm}: {trained} of {judged} step{'s' if judged != 1 else ''} trained — "
            + ("; ".join(parts) or "no reason recorded"))
