"""Flat memory (issue 18): what the proxy keeps per session goes when the session ends, counted object by object
after many sessions (not timed): with a gateway, when it revokes the session's key; standalone, when the session
has been idle for ``session_idle_seconds`` (a fake clock here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson

from polar_gym.proxy.app import create_app
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.providers.base import Route
from polar_gym.proxy.service import ProxyService, SessionInfo, SessionRegistry, new_session_key
from polar_gym.schema import OracleScript
from tests._fakes import ByteTokenizer

SCRIPT = OracleScript(commands=["ls", "cat README"], final_answer="done")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def retained(service: ProxyService) -> dict[str, int]:
    """Every per-session structure of the service, the registry, the engine (its prefix chains and scripts), the
    upstream pool and the journal, by how many sessions it holds."""
    engine = service.engine
    assert isinstance(engine, OracleEngine) and engine.renderer is not None
    registry = service.sessions
    return {"registered": len(registry._sessions), "adhoc": len(registry._adhoc),
            "last_used": len(registry._last_used), "keys": len(registry._by_key),
            "sticky": len(engine.pool._sticky), "chains": len(engine.renderer._sessions),
            "scripts": len(engine.scripts), "journal_streams": service.journal.open_streams(),
            "inflight": len(service._inflight), "idle_events": len(service._idle),
            "call_failures": len(service.call_failures)}


def _body(turn: int) -> bytes:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": "fix the bug"}]
    for n in range(turn):
        messages += [{"role": "assistant", "content": f"step {n}"}, {"role": "user", "content": f"ok {n}"}]
    return orjson.dumps({"model": "policy", "messages": messages, "max_tokens": 64})


async def test_a_gateway_session_leaves_nothing_behind_once_it_ends(tmp_path: Path) -> None:
    journal = CaptureJournal(tmp_path / "capture")
    service = ProxyService(OracleEngine(ByteTokenizer(), default_script=SCRIPT), journal,
                           SessionRegistry(allow_adhoc=False), keepalive_after=None)
    route = Route("/v1/chat/completions")
    try:
        for n in range(300):  # as polar_gym.gateway.sandbox does with each session
            sid, key, attempt = f"task-{n}", new_session_key(), f"a{n}"
            await journal.begin_attempt(sid, attempt)
            service.sessions.register(SessionInfo(sid, "policy", {}, attempt=attempt, key=key))
            service.engine.open_session(sid, {"oracle": SCRIPT.model_dump()})
            for turn in range(2):
                reply = await service.handle("openai_chat", _body(turn), route, {"authorization": f"Bearer {key}"})
                assert reply.status == 200, reply.body
            if n == 0:
                assert retained(service)["chains"] == 1  # state is kept while the session runs
            service.sessions.unregister(sid)
            service.take_call_failures(sid)
            journal.release(sid, attempt)
            service.forget(sid)
        assert set(retained(service).values()) == {0}
        assert [r.index for r in await journal.records("task-0")] == [0, 1]  # the journal stays on disk
    finally:
        journal.close()


async def test_idle_standalone_sessions_are_forgotten_and_come_back(tmp_path: Path) -> None:
    """Through the proxy's HTTP app: 400 ad-hoc sessions, each idle longer than the limit before the next starts,
    leave only the latest one in memory; the first, calling again, continues its journal and its chain anew."""
    clock = Clock()
    journal = CaptureJournal(tmp_path / "capture")
    service = ProxyService(OracleEngine(ByteTokenizer(), default_script=SCRIPT), journal,
                           SessionRegistry(allow_adhoc=True, idle_seconds=60, clock=clock), keepalive_after=None)
    app = create_app(service, "admin-token")
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            for n in range(400):
                for turn in range(2):
                    resp = await client.post("/v1/chat/completions", content=_body(turn),
                                             headers={"authorization": f"Bearer adhoc-{n}"})
                    assert resp.status_code == 200, resp.text
                    clock.now += 1
                clock.now += 61
            counts = retained(service)
            assert counts["adhoc"] == counts["last_used"] == counts["chains"] == counts["sticky"] == 1
            assert counts["journal_streams"] <= 1 and counts["inflight"] == counts["idle_events"] == 0
            resp = await client.post("/v1/chat/completions", content=_body(2),
                                     headers={"authorization": "Bearer adhoc-0"})
            assert resp.status_code == 200
            assert retained(service)["adhoc"] == 1  # adhoc-399 went idle meanwhile
            records = (await client.get("/sessions/adhoc-0/completions",
                                        headers={"authorization": "Bearer adhoc-0"})).json()["completions"]
            assert [r["index"] for r in records] == [0, 1, 2]
    finally:
        journal.close()


def test_a_session_with_a_call_in_flight_is_not_expired() -> None:
    clock = Clock()
    busy = {"slow"}
    forgotten: list[str] = []
    registry = SessionRegistry(allow_adhoc=True, idle_seconds=10, clock=clock, on_forget=forgotten.append)
    registry.in_use = busy.__contains__
    registry.resolve("slow")
    registry.resolve("quick")
    clock.now += 11
    registry.resolve("new")
    assert forgotten == ["quick"] and registry.ids() == ["new", "slow"]
    busy.clear()
    clock.now += 11
    assert registry.expire() == ["new", "slow"] and registry.count() == 0


def test_sessions_beyond_the_cap_go_least_recently_used_first() -> None:
    registry = SessionRegistry(allow_adhoc=True, max_adhoc=3)
    for key in ("a", "b", "c", "a", "d"):
        registry.resolve(key)
    assert registry.ids() == ["a", "c", "d"] and len(registry._last_used) == 3


def test_a_session_with_a_call_in_flight_is_kept_even_beyond_the_cap() -> None:
    """Its record is still to be written: forgetting it would drop what the engine keeps for the call."""
    forgotten: list[str] = []
    registry = SessionRegistry(allow_adhoc=True, max_adhoc=2, on_forget=forgotten.append)
    registry.in_use = {"busy"}.__contains__
    for key in ("busy", "b", "c", "d"):
        registry.resolve(key)
    assert forgotten == ["b", "c"] and registry.ids() == ["busy", "d"]
