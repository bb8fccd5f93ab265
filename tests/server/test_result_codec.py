"""The packed session result (polar_gym.result_codec): exact round trips, a size near the unique token bytes, a head
readable alone, and clear errors for anything that is not a whole packed result."""

from __future__ import annotations

import random
import struct
import zlib

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_gym.result_codec import (
    MAGIC,
    PackedResult,
    frame_results,
    head,
    pack,
    read_frame,
    unique_token_bytes,
    unpack,
)
from polar_gym.schema import EvalResult, SessionResult, SessionStatus, Trace, Trajectory


def growing_session(turns: int = 30, seed: int = 0) -> SessionResult:
    """A per_request result of a growing chat: each call's prompt is the previous prompt, answer and a tool result."""
    rng = random.Random(seed)
    context = [rng.randrange(151_000) for _ in range(1500)]
    traces = []
    for turn in range(turns):
        answer = [rng.randrange(151_000) for _ in range(rng.randrange(1, 200))]
        mask = [1] * len(answer) if turn % 7 else [0] * len(answer)  # a masked call now and then
        logprobs = [] if turn == 3 else [-rng.random() * 5 for _ in answer]  # a call without logprobs
        traces.append(Trace(prompt_ids=list(context), response_ids=answer, loss_mask=mask, response_logprobs=logprobs,
                            prompt_messages=[{"role": "user", "content": f"turn {turn}"}],
                            response_messages=[{"role": "assistant", "content": "ok", "tool_calls": []}],
                            finish_reason="tool_calls", reward=1.0, metadata={"turn": turn, "chain": 0}))
        context += answer + [rng.randrange(151_000) for _ in range(rng.randrange(0, 600))]
    return SessionResult(session_id="s-1", task_id="t-1", status=SessionStatus.COMPLETED,
                         trajectory=Trajectory(session_id="s-1", traces=traces, builder="per_request",
                                               diagnostics={"completions": turns}),
                         evaluation=EvalResult(reward=1.0, details={"tests": "passed"}),
                         timings={"total": 12.5, "run": 10.0},
                         metadata={"attempt_id": "a-7", "artifacts": {"error_cause": "none_really"}})


def test_a_growing_session_round_trips_and_costs_its_unique_tokens() -> None:
    result = growing_session()
    data = pack(result)
    assert unpack(data) == result
    h = head(data)
    # every prompt shares the one before it: the ids stored are the session's unique tokens only
    last = result.trajectory.traces[-1]  # type: ignore[union-attr]
    assert h.token_ids == len(last.prompt_ids) + len(last.response_ids)
    assert h.logprobs == sum(len(t.response_logprobs) for t in result.trajectory.traces)  # type: ignore[union-attr]
    assert len(data) <= 1.2 * unique_token_bytes(h)
    assert len(result.model_dump_json()) > 20 * len(data)  # what the store held per result before


def test_the_head_names_what_the_server_files_by() -> None:
    h = head(pack(growing_session(turns=5)))
    assert (h.session_id, h.task_id, h.status, h.attempt_id, h.reward) == ("s-1", "t-1", "COMPLETED", "a-7", 1.0)
    assert (h.traces, h.completions, h.seconds, h.error_cause) == (5, 5, 12.5, "none_really")
    bare = SessionResult(session_id="s", task_id="t", status=SessionStatus.ERROR, reason="gateway lost it")
    packed = PackedResult.of(pack(bare))
    assert (packed.status, packed.reason, packed.head.reward, packed.head.traces) == ("ERROR", "gateway lost it",
                                                                                      None, 0)
    assert unpack(packed.data) == bare


#: logprobs a trainer may meet: +0.0 (a placeholder, or a token of probability 1), -0.0, tiny, ordinary, long
_LOGPROBS = st.sampled_from([0.0, -0.0, -5e-324, -1e-300, -3.5, -0.12345678901234567, -700.25])


def _bits(values: list[float]) -> list[bytes]:
    return [struct.pack("<d", v) for v in values]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 2**32 - 1), max_size=30),
                          st.lists(st.tuples(st.integers(0, 2**32 - 1), _LOGPROBS), max_size=30),
                          st.booleans(), st.integers(0, 40)), max_size=6))
def test_any_traces_round_trip(shapes: list[tuple[list[int], list[tuple[int, float]], bool, int]]) -> None:
    """Prompts that share prefixes with earlier traces, or not; empty prompts and answers; with and without
    logprobs, each back bit for bit (-0.0 too); masks of both values."""
    traces: list[Trace] = []
    for tail, answer, with_logprobs, reuse in shapes:
        earlier = traces[reuse % len(traces)] if traces and reuse else None
        prefix = (earlier.prompt_ids + earlier.response_ids)[:reuse] if earlier else []
        traces.append(Trace(prompt_ids=prefix + tail, response_ids=[t for t, _ in answer],
                            loss_mask=[t % 2 for t, _ in answer],
                            response_logprobs=[lp for _, lp in answer] if with_logprobs else []))
    result = SessionResult(session_id="s", task_id="t", status=SessionStatus.COMPLETED,
                           trajectory=Trajectory(session_id="s", traces=traces))
    back = unpack(pack(result))
    assert back == result
    for mine, theirs in zip(back.trajectory.traces, traces, strict=True):  # type: ignore[union-attr]
        assert _bits(mine.response_logprobs) == _bits(theirs.response_logprobs)


def test_placeholder_logprobs_cost_a_bit_each() -> None:
    """prefix_merging's tool-output tokens carry 0.0 logprobs: stored as bits, not as 8-byte values."""
    sampled, tool = [-0.5] * 100, [0.0] * 10_000
    trace = Trace(prompt_ids=[1, 2, 3], response_ids=list(range(10_100)), loss_mask=[1] * 100 + [0] * 10_000,
                  response_logprobs=sampled + tool)
    result = SessionResult(session_id="s", task_id="t", status=SessionStatus.COMPLETED,
                           trajectory=Trajectory(session_id="s", traces=[trace]))
    data = pack(result)
    assert head(data).logprobs == 100 and unpack(data) == result
    assert len(data) < 4 * 10_103 + 8 * 100 + 2 * 10_100 / 8 + 1024


def test_what_is_not_a_whole_packed_result_is_refused() -> None:
    data = pack(growing_session(turns=3))
    for bad, why in [(b"", "bad magic"), (b"{}" * 20, "bad magic"), (data[:-1], "do not add up"),
                     (data + b"\0", "do not add up")]:
        with pytest.raises(ValueError, match=why):
            head(bad)
        with pytest.raises(ValueError, match=why):
            unpack(bad)
    lengths = struct.unpack_from("<5I", data, len(MAGIC))
    at = len(MAGIC) + 20 + lengths[0]
    scrambled = data[:at] + bytes(b ^ 0xFF for b in data[at:at + lengths[1]]) + data[at + lengths[1]:]
    with pytest.raises(ValueError, match="unreadable body"):
        unpack(scrambled)


def test_a_token_layout_pointing_outside_the_result_is_refused() -> None:
    """A body whose layout names a later trace as its base, or more tokens than the result holds."""
    result = growing_session(turns=2)
    data = pack(result)
    head_len, body_len, *rest = struct.unpack_from("<5I", data, len(MAGIC))
    at = len(MAGIC) + 20

    body = orjson.loads(zlib.decompress(data[at + head_len:at + head_len + body_len]))
    for field, value in (("base", 5), ("tail", 10**9), ("keep", 10**9)):
        changed = orjson.loads(orjson.dumps(body))
        changed["trajectory"]["traces"][1]["$tokens"][field] = value
        packed_body = zlib.compress(orjson.dumps(changed))
        forged = (MAGIC + struct.pack("<5I", head_len, len(packed_body), *rest) + data[at:at + head_len]
                  + packed_body + data[at + head_len + body_len:])
        with pytest.raises(ValueError, match="points outside"):
            unpack(forged)


def test_a_poll_frame_carries_results_back_to_back() -> None:
    blobs = [pack(growing_session(turns=2, seed=s)) for s in range(3)]
    meta, out = read_frame(frame_results(blobs, {"statuses": {"x": "RUNNING"}, "unknown": ["y"]}))
    assert out == blobs and meta == {"statuses": {"x": "RUNNING"}, "unknown": ["y"], "results": [len(b) for b in blobs]}
    frame = frame_results(blobs, {})
    for bad in (frame[:-1], frame[:2], struct.pack("<I", 3) + b"{x}", struct.pack("<I", 2) + b"{}"):
        with pytest.raises(ValueError):
            read_frame(bad)
