"""Readable sessions for builder tests: token IDs that name what they are, and the invariants every trajectory must
hold (DESIGN.md): mask-1 tokens are exactly sampled tokens; logprobs aligned; every completion accounted for."""

from __future__ import annotations

from typing import Any

from polar_gym.schema import CompletionRecord, CompletionSession, Trace, Trajectory

EOT = 99


def rec(index: int, prompt: list[int], response: list[int], *, messages: list[Any] | None = None,
        started: float | None = None, seconds: float = 1.0, **kw: Any) -> CompletionRecord:
    fields: dict[str, Any] = {
        "completion_id": f"c{index}", "session_id": "s", "index": index, "provider": "openai_chat",
        "engine": "oracle", "normalized_request": {"model": "m", "messages": messages or []},
        "prompt_ids": prompt, "response_ids": response,
        "response_logprobs": [-0.01 * (t % 50) - 0.001 for t in response], "finish_reason": "stop",
        "response": {"message": {"role": "assistant", "content": f"reply {index}"}},
        "started_at": float(index * 10) if started is None else started, "total_seconds": seconds,
    }
    return CompletionRecord(**{**fields, **kw})


def session(*records: CompletionRecord) -> CompletionSession:
    return CompletionSession(session_id="s", completions=list(records))


def check_invariants(sess: CompletionSession, traj: Trajectory) -> None:
    by_id = {r.completion_id: r for r in sess.completions}
    seen: list[str] = []
    for trace in traj.traces:
        Trace.model_validate(trace.model_dump())  # alignment validators
        records = [by_id[span["completion_id"]] for span in trace.metadata["spans"]]
        has_logprobs = all(r.response_logprobs for r in records)
        assert trace.metadata["has_logprobs"] is has_logprobs
        # a trace has every sampled token's logprob or says it has none: never a made-up 0.0
        assert len(trace.response_logprobs) == (len(trace.response_ids) if has_logprobs else 0)
        trained = [i for i, m in enumerate(trace.loss_mask) if m == 1]
        covered: list[int] = []
        for span in trace.metadata["spans"]:
            r = by_id[span["completion_id"]]
            assert trace.response_ids[span["start"]:span["end"]] == r.response_ids  # copied, never re-encoded
            if has_logprobs:
                assert trace.response_logprobs[span["start"]:span["end"]] == r.response_logprobs
            covered += range(span["start"], span["end"])
        assert trained == covered  # mask 1 exactly on sampled tokens
        first = by_id[trace.metadata["completion_ids"][0]]
        assert trace.prompt_ids == first.prompt_ids
        seen += trace.metadata["completion_ids"]
    diag = traj.diagnostics
    accounted = {*seen, *diag.get("superseded", []), *(c for ids in diag["excluded"].values() for c in ids)}
    assert accounted == set(by_id), "every completion is in a trace or a diagnostic"
    assert len(seen) == len(set(seen)), "no completion trained twice"


def merged(*records: CompletionRecord, config: Any = None) -> Trajectory:
    """prefix_merging over ``records`` (end of turn ``EOT`` unless ``config`` says otherwise), its invariants
    checked."""
    from polar_gym.merge.base import MergeConfig
    from polar_gym.merge.prefix_merging import prefix_merging

    sess = session(*records)
    traj = prefix_merging(sess, config if config is not None else MergeConfig(end_of_turn_ids=(EOT,)))
    check_invariants(sess, traj)
    return traj
