"""A finished session as NeMo Gym material: the token items of every prefix-merged chain (cumulative prompts, built
by :func:`polar_gym.merge.exports.nemo_item_chains`), the assistant turn each item sampled and the evaluator's
reward. The rollout server serves it at ``GET /sessions/{id}/nemo`` so the Gym-side agent (which runs in NeMo Gym's
own interpreter, without polar_gym) stays a thin HTTP client."""

from __future__ import annotations

from typing import Any

from polar_gym.merge.exports import check_contiguity, nemo_items
from polar_gym.schema import SessionResult, SessionStatus, Trace
from polar_gym.schema.images import image_data_of

__all__ = ["session_nemo_payload"]


def _turns(trace: Trace, count: int) -> list[dict[str, Any] | None]:
    """The assistant message of each sampled completion, when the trace's response messages line up with its items
    one to one (prefix merging alternates assistant turns and tool results); else Nones (tokens stay exact, only
    the readable text is missing)."""
    assistants = [m for m in trace.response_messages if m.get("role") == "assistant"]
    if len(assistants) != count:
        return [None] * count
    tool_results: list[list[dict[str, Any]]] = [[] for _ in range(count)]
    turn = -1
    for message in trace.response_messages:
        if message.get("role") == "assistant":
            turn += 1
        elif turn >= 0:
            tool_results[turn].append(message)
    return [{**a, "tool_results": r} for a, r in zip(assistants, tool_results, strict=True)]


def session_nemo_payload(result: SessionResult) -> dict[str, Any]:
    """JSON-ready dict: session status, reward and one chain per trace (``items`` with prompt_token_ids,
    generation_token_ids, generation_log_probs, completion_id and the sampled ``turn``). A chain that breaks NeMo
    RL's contiguity rule is reported in ``contiguity_error`` instead of being dropped. A chain with images has
    ``images`` (each one's SHA-256 and its placeholders' span in the chain's token positions) and ``image_data``
    (each one's pixels as a data URL, by SHA-256, once)."""
    traj = result.trajectory
    evaluation = result.evaluation
    chains = []
    for index, trace in enumerate(traj.traces if traj is not None else []):
        items = nemo_items(trace)
        error = None
        try:
            check_contiguity(items)
        except ValueError as exc:
            error = str(exc)
        turns = _turns(trace, len(items))
        images = trace.metadata.get("images") or []
        chains.append({
            "trace_index": index, "finish_reason": trace.finish_reason, "reward": trace.reward,
            "chain_cause": trace.metadata.get("chain_cause"), "contiguity_error": error,
            "items": [{**item.model_dump(), "turn": turn} for item, turn in zip(items, turns, strict=True)],
            **({"images": images, "image_data": image_data_of(
                images, [*trace.prompt_messages, *trace.response_messages])} if images else {})})
    return {
        "session_id": result.session_id, "task_id": result.task_id, "status": SessionStatus(result.status).value,
        "reason": result.reason, "builder": traj.builder if traj is not None else None,
        "reward": evaluation.reward if evaluation is not None else None,
        "passed": evaluation.passed if evaluation is not None else None,
        "diagnostics": traj.diagnostics if traj is not None else {},
        "chains": chains}
