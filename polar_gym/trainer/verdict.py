"""Did a GRPO step train? The verdict that keeps a run from "training" silently on nothing (pure: no torch, no I/O).

A step is not counted as training, and its update is skipped, when (codes from :mod:`polar_gym.report.training`):

- ``no_traces``: no trace had a trained (mask-1) token;
- ``no_signal``: within every group all rewards were equal, so every advantage is 0 and the update would only
  move the optimizer's state (the oracle's reward 1.000 in every session);
- ``not_policy_sampled``: a trace was not sampled by the policy (:func:`sampled_by_policy`): its tokens are a
  script's, so a policy gradient on them is not on-policy learning of anything;
- ``mismatch``: the trainer's logprobs of the sampled tokens are far from the engine's (``trainer.mismatch_metric``,
  by default ``audit/logprob_abs_diff_mean``, above ``trainer.max_mismatch``; each token scored by the weights of
  the version that sampled it, :class:`polar_gym.trainer.policy.Trainer`): the engine does not run the weights being
  trained (another model, another dtype, a reload that did not happen), so the ratio is meaningless.

The GRPO loop calls :func:`step_verdict` after the forward pass and before the optimizer step, writes
``trained`` and ``not_trained_reasons`` into the step's row, and prints :attr:`StepVerdict.message` when not
trained; :func:`polar_gym.report.training.trained_summary` reads the rows back ("N of M steps trained").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from polar_gym.report.training import MISMATCH, NO_SIGNAL, NO_TRACES, NOT_POLICY_SAMPLED, NOT_TRAINED
from polar_gym.schema import Trace

__all__ = ["DEFAULT_METRIC", "SCRIPTED_ENGINES", "StepVerdict", "mismatch_message", "sampled_by_policy",
           "step_verdict"]

#: ``trainer.mismatch_metric``'s default
DEFAULT_METRIC = "audit/logprob_abs_diff_mean"

#: engines whose "samples" are a script's, not a model's (their logprobs are made up)
SCRIPTED_ENGINES = frozenset({"oracle"})


@dataclass(frozen=True)
class StepVerdict:
    """``trained``: count the step and apply its update; ``reasons``: the codes when not (in a fixed order);
    ``message``: one line for the console."""

    trained: bool
    reasons: tuple[str, ...]
    message: str


def _engines(trace: Trace) -> set[str]:
    spans = trace.metadata.get("spans")
    if isinstance(spans, list) and spans:
        return {str(s.get("engine")) for s in spans if isinstance(s, dict) and s.get("engine") is not None}
    engine = trace.metadata.get("engine")
    return {str(engine)} if engine is not None else set()


def sampled_by_policy(trace: Trace) -> bool:
    """Whether every trained token of ``trace`` was sampled by a model: the trace has logprobs, and no engine that
    produced it is scripted (:data:`SCRIPTED_ENGINES`). The builders record the engine per completion span
    (``metadata["spans"][i]["engine"]``) and for the trace (``metadata["engine"]``); spans are read when present,
    since one chain can cross engines. A trace naming no engine (an older journal, a custom builder) is not held
    against the step: the verdict refuses only what the trace shows. The policy version (``policy_versions``) is
    not part of the test: an engine a user serves records none before the trainer's first weight push, and its
    samples are the policy's all the same."""
    if not trace.response_logprobs:
        return False
    return not (_engines(trace) & SCRIPTED_ENGINES)


def mismatch_message(metric: str, value: float, bound: float) -> str:
    """Why a step was refused for mismatch, and what to do (the console line and the report's)."""
    unit = " nats" if metric.startswith("audit/logprob_abs_diff") else ""
    return (f"trainer-vs-engine mismatch {metric} = {value:.4g}{unit} > trainer.max_mismatch {bound:g} (each token "
            "scored by the weights of the version that sampled it): the engine does not compute what these weights "
            "do (another model, another dtype, a weight reload that did not happen); serve the policy in the "
            "trainer's dtype (trainer.engine_dtype, `python -m polar_gym.trainer serve --dtype`), or, where a "
            "bf16 engine is meant (GPUs), raise trainer.max_mismatch and set trainer.rollout_correction "
            "(docs/trainer/correction.md)")


def _no_signal(rewards: Sequence[float], groups: Sequence[str], eps: float) -> bool:
    by_group: dict[str, list[float]] = {}
    for group, reward in zip(groups, rewards, strict=True):
        by_group.setdefault(group, []).append(float(reward))
    return all(max(values) - min(values) <= eps for values in by_group.values())


def step_verdict(rewards: Sequence[float], groups: Sequence[str], traces: Iterable[Trace], *,
                 mismatch: float | None = None, max_mismatch: float | None = None,
                 mismatch_metric: str = DEFAULT_METRIC, eps: float = 1e-9) -> StepVerdict:
    """Whether a GRPO step trains. ``rewards`` and ``groups``: one per trained trace, the rewards the advantages
    are computed from (after ``shuffle_rewards``, so a control step still trains); ``traces``: the step's trained
    traces; ``mismatch``: the step's value of ``mismatch_metric`` (``trainer.mismatch_metric``; None: not
    measured, e.g. no finite token); ``max_mismatch``: ``trainer.max_mismatch`` (None: no bound). Every reason that
    holds is listed."""
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards for {len(groups)} groups")
    traces = list(traces)
    if not rewards and not traces:
        return StepVerdict(False, (NO_TRACES,), "not trained: " + NOT_TRAINED[NO_TRACES])
    reasons: list[str] = []
    details: list[str] = []
    if _no_signal(rewards, groups, eps):
        reasons.append(NO_SIGNAL)
        details.append(NOT_TRAINED[NO_SIGNAL])
    scripted = [t for t in traces if not sampled_by_policy(t)]
    if scripted:
        engines = sorted(set().union(*(_engines(t) for t in scripted)) & SCRIPTED_ENGINES) or ["no logprobs"]
        reasons.append(NOT_POLICY_SAMPLED)
        details.append(f"{len(scripted)} of {len(traces)} traces were not sampled by the policy "
                       f"({', '.join(engines)}): set an engine that serves the model being trained")
    if mismatch is not None and max_mismatch is not None and mismatch > max_mismatch:
        reasons.append(MISMATCH)
        details.append(mismatch_message(mismatch_metric, mismatch, max_mismatch))
    if not reasons:
        return StepVerdict(True, (), "trained")
    return StepVerdict(False, tuple(reasons), "not trained: " + "; ".join(details))
