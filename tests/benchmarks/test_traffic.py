"""benchmarks/traffic.py, the sessions bench_traffic.py replays: each harness's bodies grow as that harness grows them,
read as that harness's protocol by the proxy's own front end, and the direct target's Chat body carries the same
conversation; Claude Code's cache marker moves to the newest tool result; a compaction makes the prompt shorter."""

from __future__ import annotations

from itertools import pairwise

import orjson
import pytest

from polar_gym.proxy.providers.base import Route
from polar_gym.registry import PROVIDERS
from tests._benchmarks import load_benchmark

traffic = load_benchmark("traffic")


def _chat(harness: str, session, body: bytes):  # type: ignore[no-untyped-def]
    from polar_gym.proxy.detect import split_google_path

    front_end = traffic.HARNESSES[harness].front_end
    path, _, query = session.path.partition("?")
    split = split_google_path(path) if front_end == "google" else None
    route = Route(path, model=split[0] if split else None, action=split[1] if split else None,
                  query=dict(q.split("=", 1) for q in query.split("&") if "=" in q))
    return PROVIDERS.get(front_end)().parse(orjson.loads(body), route).chat


@pytest.mark.parametrize("harness", sorted(traffic.HARNESSES))
def test_a_session_grows_by_one_round_a_turn_in_its_harness_protocol(harness: str) -> None:
    session = traffic.HarnessSession(harness, seed=3)
    bodies = [session.next_body() for _ in range(6)]
    chats = [_chat(harness, session, body) for body in bodies]
    counts = [len(chat.messages) for chat in chats]
    assert all(b - a == 2 for a, b in pairwise(counts)), counts  # an answer and a result
    assert all(len(b) > len(a) for a, b in pairwise(bodies))
    for earlier, later in pairwise(chats):  # a harness sends its history on unchanged
        assert later.messages[:len(earlier.messages)] == earlier.messages
    answers = [m for m in chats[-1].messages if m.role == "assistant" and m.tool_calls]
    ids = [call.id for m in answers for call in m.tool_calls]
    assert len(ids) == len(set(ids))  # fresh call ids every round, paired with their results
    direct = orjson.loads(traffic.direct_body(harness, session.path, bodies[-1]))
    assert direct["stream"] is True and len(direct["messages"]) == counts[-1]
    assert traffic.HarnessSession(harness, seed=3).next_body() == bodies[0]  # seeded: every target gets the same


def test_claude_codes_cache_marker_moves_to_the_newest_tool_result() -> None:
    session = traffic.HarnessSession("claude_code", seed=1)
    for _ in range(4):
        body = orjson.loads(session.next_body())
    marked = [n for n, message in enumerate(body["messages"]) if b"cache_control" in orjson.dumps(message)]
    assert marked == [len(body["messages"]) - 1]
    assert body["messages"][-1]["content"][-1]["type"] == "tool_result"


def test_a_compaction_sends_a_shorter_conversation() -> None:
    session = traffic.HarnessSession("qwen_code", seed=2)
    grown = [session.next_body() for _ in range(8)][-1]
    session.compact()
    assert len(session.next_body()) < len(grown)
