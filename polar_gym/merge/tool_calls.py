"""What a run does with traces whose sampled answer holds a tool call the output parser could not read.

The proxy answers such a block to the harness as text (the harness never ran it) and records where it was sampled;
every builder marks the trace (``metadata["tool_call_parse"]``: ``ok`` or ``malformed``, and
``metadata["malformed_tool_calls"]``: ``{completion_id, start, end, located}`` per block, at its tokens in
``response_ids``). The run's policy (``builder.config.malformed_tool_calls``) then decides what a trainer gets:

- ``reward_zero_keep`` (the default, Polar upstream's rule): the trace's reward becomes 0 whatever the evaluator
  said (:func:`polar_gym.merge.rewards.apply_rewards` reads the mark), and its tokens stay trainable: the model
  must learn not to write such a call. Its ids, logprobs and mask line up like any trace's (the builders'
  invariant), so nothing becomes a diagnostic.
- ``mask``: every token of each completion that holds a malformed block gets mask 0 (the reply as a whole, not
  just the block: the text around a call the harness never ran is not a turn it answered); rewards are untouched.
- ``ignore``: the mark stays; nothing else changes.

Pure: a new Trajectory is returned.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from polar_gym.schema import Trace, Trajectory

__all__ = ["MALFORMED_POLICIES", "REWARD_REASON", "MalformedToolCallPolicy", "apply_tool_call_policy",
           "zeroed_by_policy"]

MalformedToolCallPolicy = Literal["reward_zero_keep", "mask", "ignore"]
MALFORMED_POLICIES: tuple[str, ...] = get_args(MalformedToolCallPolicy)
#: the reason a trace's reward was set by the policy, in ``metadata["reward_reason"]``
REWARD_REASON = "malformed_tool_call"


def apply_tool_call_policy(traj: Trajectory, policy: MalformedToolCallPolicy) -> Trajectory:
    """Stamp ``policy`` on every trace with a malformed call and, for ``mask``, mask its completions' replies."""
    if policy not in MALFORMED_POLICIES:
        raise ValueError(f"unknown malformed_tool_calls policy {policy!r}; use one of {', '.join(MALFORMED_POLICIES)}")
    if not any(t.metadata.get("tool_call_parse") == "malformed" for t in traj.traces):
        return traj
    traces = [_applied(t, policy) if t.metadata.get("tool_call_parse") == "malformed" else t for t in traj.traces]
    return traj.model_copy(update={"traces": traces})


def _applied(trace: Trace, policy: MalformedToolCallPolicy) -> Trace:
    metadata: dict[str, Any] = {**trace.metadata, "malformed_tool_call_policy": policy}
    update: dict[str, Any] = {"metadata": metadata}
    if policy == "mask":
        bad = {m["completion_id"] for m in trace.metadata.get("malformed_tool_calls") or ()}
        mask = list(trace.loss_mask)
        for span in trace.metadata.get("spans") or ():
            if span["completion_id"] in bad:
                mask[span["start"]:span["end"]] = [0] * (span["end"] - span["start"])
        metadata["masked_tokens_malformed"] = sum(trace.loss_mask) - sum(mask)
        update["loss_mask"] = mask
    return trace.model_copy(update=update)


def zeroed_by_policy(trace: Trace) -> bool:
    """Whether ``trace``'s reward is 0 by the ``reward_zero_keep`` policy."""
    return trace.metadata.get("malformed_tool_call_policy") == "reward_zero_keep"
