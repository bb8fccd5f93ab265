"""Rewards on a built trajectory: an evaluator's outcome broadcast to every trace, or one reward per trace, plus
session weights so that one session counts once in the loss however many traces it yields.

Why weights: under ``per_request`` a 50-turn session yields 50 traces that all carry the session's reward, so a
trainer that averages over traces gives long sessions 50x the say of short ones (and the policy learns to make more
calls: the reward hacking the Polar paper reports). ``trace.metadata["weight"]`` fixes that; a trainer multiplies a
trace's loss (or advantage) by it. Modes:

- ``"traces"``: ``1 / len(traces)`` each; a session's weights sum to 1 whatever the builder.
- ``"tokens"``: a trace's share of the session's trainable (mask-1) tokens; the weights still sum to 1, but a short
  side request no longer counts as much as the main chain. Falls back to ``"traces"`` when nothing is trainable.
- ``"none"``: weight 1.0 each (the un-normalised behaviour, kept for ablations).

Everything here is pure: a new Trajectory is returned and the input is left untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from polar_gym.merge.tool_calls import REWARD_REASON, zeroed_by_policy
from polar_gym.schema import EvalResult, Trace, Trajectory

__all__ = ["RewardError", "Weighting", "apply_rewards", "session_weights", "token_rewards", "with_session_weights"]

Weighting = Literal["traces", "tokens", "none"]


class RewardError(ValueError):
    """Rewards that cannot be matched to the trajectory's traces."""


def session_weights(traces: Sequence[Trace], weighting: Weighting = "traces") -> list[float]:
    """One weight per trace; for ``"traces"`` and ``"tokens"`` they sum to 1 (a session counts once)."""
    n = len(traces)
    if n == 0:
        return []
    if weighting == "none":
        return [1.0] * n
    if weighting == "tokens":
        trainable = [sum(t.loss_mask) for t in traces]
        total = sum(trainable)
        if total > 0:
            return [k / total for k in trainable]
    elif weighting != "traces":
        raise ValueError(f"unknown weighting {weighting!r}; use 'traces', 'tokens' or 'none'")
    return [1.0 / n] * n


def _with(traj: Trajectory, rewards: Sequence[float | None], weights: Sequence[float], weighting: Weighting,
          extra: dict[str, object]) -> Trajectory:
    traces = [t.model_copy(update={"reward": r, "metadata": {**t.metadata, "weight": w, "weighting": weighting,
                                                              **extra}})
              for t, r, w in zip(traj.traces, rewards, weights, strict=True)]
    return traj.model_copy(update={"traces": traces})


def with_session_weights(traj: Trajectory, weighting: Weighting = "traces") -> Trajectory:
    """Set ``metadata["weight"]`` on every trace and leave rewards as they are (e.g. offline, before scoring)."""
    weights = session_weights(traj.traces, weighting)
    return _with(traj, [t.reward for t in traj.traces], weights, weighting, {})


def apply_rewards(traj: Trajectory, evaluation: EvalResult, weighting: Weighting = "traces") -> Trajectory:
    """Rewards from ``evaluation`` on every trace, with session weights.

    ``evaluation.per_trace_rewards`` (one per trace, in trace order) wins over the outcome ``reward``, which is
    otherwise broadcast; the outcome is kept in ``metadata["outcome_reward"]`` either way so per-trace shaping can
    be audited against it. A trace the ``reward_zero_keep`` policy marked (a malformed tool call,
    :mod:`polar_gym.merge.tool_calls`) gets 0 whatever the evaluator gave, ``metadata["reward_reason"]`` saying why.
    """
    if evaluation.per_trace_rewards is not None:
        rewards: list[float | None] = list(evaluation.per_trace_rewards)
        if len(rewards) != len(traj.traces):
            raise RewardError(
                f"per_trace_rewards has {len(rewards)} values but session {traj.session_id!r} has "
                f"{len(traj.traces)} traces (builder {traj.builder!r}); per-trace rewards must be computed on the "
                "trajectory they are applied to")
    else:
        rewards = [evaluation.reward] * len(traj.traces)
    weights = session_weights(traj.traces, weighting)
    out = _with(traj, rewards, weights, weighting, {"outcome_reward": evaluation.reward})
    if evaluation.per_trace_scores is not None or evaluation.per_turn_rewards:
        out = _with_scores(out, evaluation)
    if not any(zeroed_by_policy(t) for t in out.traces):
        return out
    return out.model_copy(update={"traces": [
        t.model_copy(update={"reward": 0.0, "metadata": {**t.metadata, "reward_reason": REWARD_REASON}})
        if zeroed_by_policy(t) else t for t in out.traces]})


def _with_scores(traj: Trajectory, evaluation: EvalResult) -> Trajectory:
    """Each trace's judge score (``metadata["trace_score"]``) and the rewards of its turns
    (``metadata["turn_rewards"]``: ``{completion_id, end, reward}``, ``end`` the turn's end in ``response_ids``)."""
    scores = evaluation.per_trace_scores
    if scores is not None and len(scores) != len(traj.traces):
        raise RewardError(f"per_trace_scores has {len(scores)} values but session {traj.session_id!r} has "
                          f"{len(traj.traces)} traces")
    turns = evaluation.per_turn_rewards or {}
    traces = []
    for i, trace in enumerate(traj.traces):
        metadata = dict(trace.metadata)
        if scores is not None:
            metadata["trace_score"] = scores[i]
        held = [{"completion_id": span["completion_id"], "end": span["end"], "reward": turns[span["completion_id"]]}
                for span in trace.metadata.get("spans") or () if span["completion_id"] in turns]
        if held:
            metadata["turn_rewards"] = held
        traces.append(trace.model_copy(update={"metadata": metadata}))
    return traj.model_copy(update={"traces": traces})


def token_rewards(trace: Trace) -> list[float]:
    """A reward per response token, for trainers that take them (dense process rewards): each turn's reward on the
    turn's last token, the trace's reward on its last token, 0 elsewhere. Its sum is the trace's reward plus its
    turns' rewards; a trainer that takes one number per trace uses ``trace.reward`` and leaves turn rewards out
    (the documented reduction: ``sum(token_rewards(trace))`` folds them in)."""
    out = [0.0] * len(trace.response_ids)
    if not out:
        return out
    for turn in trace.metadata.get("turn_rewards") or ():
        out[max(int(turn["end"]) - 1, 0)] += float(turn["reward"])
    out[-1] += trace.reward or 0.0
    return out
