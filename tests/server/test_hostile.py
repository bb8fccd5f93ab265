"""The rollout server against hostile and careless input (issue 11, faults 5, 6 and the db part of 3): what is
stored can always be read back, a row that still cannot be read is quarantined while dispatch goes on (also after a
restart), the token is checked before a body is read, bodies and task sizes are capped, error bodies quote only
excerpts, malformed headers and query parameters are 4xx, upstream URLs are validated, and the db is 0600."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar_gym.httpguard import MAX_JSON_DEPTH
from polar_gym.schema import SessionSpec
from polar_gym.server import Store
from polar_gym.server.__main__ import parse_args
from polar_gym.server.core import expand
from tests.server._server_kit import SERVER_TOKEN, Harness, make_task

JSON = {"content-type": "application/json"}


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def corrupt_spec(db: Path, session_id: str) -> None:
    """Write, behind the server's back, a spec no reader can parse (nested past pydantic's JSON limit)."""
    with sqlite3.connect(db) as conn:
        spec = json.loads(conn.execute("SELECT spec FROM sessions WHERE session_id = ?", (session_id,)).fetchone()[0])
        spec["metadata"]["deep"] = nested(300)
        conn.execute("UPDATE sessions SET spec = ? WHERE session_id = ?", (json.dumps(spec), session_id))


async def raw_request(url: str, head: str, body: bytes = b"", timeout: float = 20) -> tuple[int, bytes]:
    """One HTTP/1.1 request over a socket (the head may declare a body that is never sent); status and body."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        with contextlib.suppress(ConnectionError):  # the server may refuse and close before the body is sent
            writer.write(head.encode("latin-1") + b"\r\n\r\n" + body)
            await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout)  # the server closes after refusing
    finally:
        writer.close()
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


@pytest.mark.slow
async def test_unreadable_input_never_stops_dispatch(harness: Harness) -> None:
    srv = await harness.server()
    deep = make_task("t-deep").model_dump(mode="json")
    deep["metadata"] = {"nested": nested(200)}
    refused = await srv.http.post("/tasks", json=deep)
    assert refused.status_code == 422, refused.text  # on main: 201, then the dispatch loop died on reading it
    assert refused.json()["error"]["type"] == "too_deep" and len(refused.content) < 2000
    infinite = make_task("t-inf").model_dump_json().replace('"timeout_seconds":120.0', '"timeout_seconds":Infinity')
    refused = await srv.http.post("/tasks", content=infinite, headers=JSON)
    assert refused.status_code == 422 and refused.json()["error"]["type"] == "unreadable_task", refused.text

    # a row corrupted in SQLite after intake: quarantined with a reason, every other session is dispatched
    await srv.http.post("/tasks", content=make_task("t-poisoned", 2).model_dump_json(), headers=JSON)
    await srv.http.post("/tasks", content=make_task("t-after", 1).model_dump_json(), headers=JSON)
    poisoned = sorted((await srv.http.get("/tasks/t-poisoned")).json()["sessions"])
    bad = next(s for s in poisoned if s.startswith("t-poisoned-0-"))
    corrupt_spec(Path(srv.store.path), bad)
    gw = await harness.gateway()
    await srv.register(gw, 4)
    after = await srv.wait_task("t-after", 60)
    assert after["status"] == "COMPLETED"
    view = await srv.wait_task("t-poisoned", 60)
    assert view["sessions"][bad] == "ERROR" and view["aggregate"]["counts"] == {"ERROR": 1, "COMPLETED": 1}
    result = (await srv.http.get(f"/sessions/{bad}/result")).json()
    assert result["status"] == "ERROR" and result["reason"].startswith("quarantined:"), result
    assert "could not be read back" in result["reason"]

    # after a restart, with a poisoned waiting row already in the db: it is quarantined, the rest runs
    await srv.stop()
    store = Store(srv.store.path)
    task = make_task("t-restart", 2)
    specs = expand(task, 8, 2**20)
    assert await store.add_task(task, specs)
    store.close()
    corrupt_spec(Path(srv.store.path), specs[1].session_id)
    again = await harness.server(db=Path(srv.store.path))
    view = await again.wait_task("t-restart", 60)
    assert view["sessions"] == {specs[0].session_id: "COMPLETED", specs[1].session_id: "ERROR"}
    reasons = {r["session_id"]: r["reason"] for r in view["results"]}
    assert reasons[specs[1].session_id].startswith("quarantined:")
    await again.http.post("/tasks", content=make_task("t-last", 1).model_dump_json(), headers=JSON)
    assert (await again.wait_task("t-last", 60))["status"] == "COMPLETED"


def test_expansion_checks_bounds_and_read_back() -> None:
    from polar_gym.server.core import ServerError

    task = make_task("t", 3)
    specs = expand(task, 3, 2**20)
    assert [s.sample_index for s in specs] == [0, 1, 2]
    assert SessionSpec.model_validate_json(specs[2].model_dump_json()) == specs[2]
    with pytest.raises(ServerError, match="limit of 2 sessions") as too_many:
        expand(task, 2, 2**20)
    assert too_many.value.status == 413
    with pytest.raises(ServerError, match="stored bytes") as too_big:
        expand(task, 3, 1000)
    assert too_big.value.status == 413
    deep = task.model_copy(update={"metadata": task.metadata.model_copy(update={"x": nested(MAX_JSON_DEPTH + 1)})})
    with pytest.raises(ServerError, match="levels deep"):
        expand(deep, 3, 2**20)
    deeper = task.model_copy(update={"metadata": task.metadata.model_copy(update={"x": nested(900)})})
    with pytest.raises(ServerError, match="cannot be stored") as unstorable:  # was a 500
        expand(deeper, 3, 2**20)
    assert unstorable.value.status == 422


async def test_hostile_requests_are_4xx_and_cheap(tmp_path: Path) -> None:
    made = Harness(tmp_path)
    srv = await made.server(app_knobs={"max_body_bytes": 1024 * 1024}, max_samples=64)
    try:
        # the token is checked before the body is read: a declared 50 MB body that is never sent gets its 401
        status, body = await raw_request(srv.url, "POST /tasks HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                                                  f"\r\ncontent-length: {50 * 2**20}")
        assert status == 401 and json.loads(body)["error"]["type"] == "unauthorized"
        # with the token, a body over the cap is refused from its declared length, and a streamed one as it grows
        status, _ = await raw_request(srv.url, f"POST /tasks HTTP/1.1\r\nhost: x\r\nx-admin-token: {SERVER_TOKEN}"
                                               f"\r\ncontent-type: application/json\r\ncontent-length: {2 * 2**20}")
        assert status == 413
        chunk = b"10000\r\n" + b" " * 0x10000 + b"\r\n"  # 64 KiB chunks, 1.5 MiB in all, no declared length
        status, body = await raw_request(srv.url, f"POST /tasks HTTP/1.1\r\nhost: x\r\nx-admin-token: {SERVER_TOKEN}"
                                                  "\r\ncontent-type: application/json\r\ntransfer-encoding: chunked",
                                         chunk * 24)
        assert status == 413 and json.loads(body)["error"]["type"] == "too_large"

        task = make_task("t-hostile").model_dump(mode="json")
        table: list[tuple[str, str, dict[str, Any], int]] = [
            ("POST", "/tasks", {"json": {**task, "num_samples": 10**9}}, 413),
            ("POST", "/tasks", {"json": {**task, "num_samples": 65}}, 413),
            ("POST", "/tasks", {"json": {**task, "num_samples": "many"}}, 422),
            ("POST", "/tasks", {"json": {**task, "callback_url": "file:///etc/passwd"}}, 422),
            ("POST", "/tasks", {"content": b"[" * 5000, "headers": JSON}, 400),
            ("POST", "/tasks", {"json": {**task, "metadata": {"deep": nested(900)}}}, 422),
            ("POST", "/tasks", {"content": b"\xff\xfe", "headers": JSON}, 422),
            ("GET", "/tasks", {"params": {"limit": str(10**30)}}, 422),
            ("GET", "/tasks", {"params": {"limit": "-1"}}, 422),
            ("GET", "/tasks", {"params": {"offset": str(10**30)}}, 422),
            ("GET", "/tasks", {"params": {"limit": "ten"}}, 422),
            ("GET", "/sessions/x/result", {"params": {"wait": "nan"}}, 422),
            ("GET", "/sessions/x/result", {"params": {"wait": "1e309"}}, 422),
            ("GET", "/sessions/x/nemo", {"params": {"wait": "-1"}}, 422),
            ("POST", "/backends", {"json": {"url": "not a url"}}, 422),
            ("POST", "/backends", {"json": {"url": "ftp://host/v1"}}, 422),
            ("POST", "/backends", {"json": {"url": "http://"}}, 422),
            ("POST", "/backends", {"json": {"url": "http://host:99999/v1"}}, 422),
            ("POST", "/backends", {"json": {"url": "http://a b/v1"}}, 422),
            ("POST", "/backends/resume", {"json": {"policy_version": "v" * 1000}}, 422),
            ("POST", "/backends/resume", {"json": {"policy_version": 10**30}}, 422),
            ("POST", "/gateways/register", {"json": {"url": "not a url", "capacity": 1}}, 422),
            ("POST", "/gateways/register", {"json": {"url": "http://h", "capacity": 10**30}}, 422),
            ("POST", "/gateways/nope/heartbeat", {"content": json.dumps(nested(500)), "headers": JSON}, 400),
            ("POST", "/gateways/nope/heartbeat", {"content": b"[" * 100_000, "headers": JSON}, 400),
        ]
        for method, path, kwargs, expected in table:
            resp = await srv.http.request(method, path, **kwargs)
            assert resp.status_code == expected, (method, path, str(kwargs)[:80], resp.status_code, resp.text[:300])
            assert resp.json()["error"]["type"], resp.text[:300]

        # a 422 quotes an excerpt of the input, not the input
        huge = await srv.http.post("/tasks", json={**task, "instruction": "x" * 500_000, "num_samples": 0})
        assert huge.status_code == 422 and len(huge.content) < 4000, len(huge.content)
        # malformed token headers are a 401, not a 500
        async with httpx.AsyncClient(base_url=srv.url) as anon:
            for value in ["tökén".encode(), b"\xff\xfe", SERVER_TOKEN.encode() + b"\x80"]:
                resp = await anon.get("/tasks", headers={"x-admin-token": value})
                assert resp.status_code == 401, (value, resp.status_code)
            resp = await anon.get("/tasks", headers={"authorization": b"Bearer \xe9\xe9"})
            assert resp.status_code == 401
            bearer = await anon.get("/tasks", headers={"authorization": f"Bearer {SERVER_TOKEN}"})
            assert bearer.status_code == 200
        # a sane task still goes in, and the server still answers
        assert (await srv.http.post("/tasks", json={**task, "num_samples": 64})).status_code == 201
        assert (await srv.http.get("/health")).status_code == 200
        assert len((await srv.http.get("/tasks/t-hostile")).json()["sessions"]) == 64
    finally:
        await srv.stop()


def test_the_db_and_its_wal_files_are_private(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        store = Store(tmp_path / "server.sqlite")
        asyncio.run(store.add_task(make_task("t"), expand(make_task("t"), 1, 2**20)))
        names = ["server.sqlite", "server.sqlite-wal", "server.sqlite-shm"]
        for name in names:  # on main: 0644, and the db holds the gateways' admin tokens in clear
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
        store.close()
        loose = tmp_path / "old.sqlite"
        loose.touch(mode=0o644)
        Store(loose).close()  # a db made by an older version is narrowed
        assert stat.S_IMODE(loose.stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_the_token_can_come_from_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("from-a-file\n")
    assert parse_args(["--admin-token-file", str(secret)]).admin_token == "from-a-file"
    with pytest.raises(SystemExit):
        parse_args(["--admin-token-file", str(tmp_path / "missing")])
    with pytest.raises(SystemExit):
        parse_args(["--admin-token", "t", "--max-samples", "0"])


async def test_the_default_limit_takes_4096_samples(tmp_path: Path) -> None:
    """4096 sessions (the default cap) are expanded and viewed off the event loop (benchmarks/bench_hostile.py
    measures /health meanwhile); one more is refused."""
    made = Harness(tmp_path)
    srv = await made.server()
    try:
        resp = await srv.http.post("/tasks", content=make_task("t-big", 4096).model_dump_json(), headers=JSON)
        assert resp.status_code == 201 and len(resp.json()["sessions"]) == 4096
        view = (await srv.http.get("/tasks/t-big")).json()
        assert view["aggregate"]["num_sessions"] == 4096
        more = await srv.http.post("/tasks", content=make_task("t-more", 4097).model_dump_json(), headers=JSON)
        assert more.status_code == 413 and more.json()["error"]["type"] == "too_many_samples"
    finally:
        await srv.stop()


def test_no_input_makes_any_route_fail_with_a_500(tmp_path: Path) -> None:
    """Whatever the method, route, token header, query and body, every answer is below 500 and in the API's error
    shape when it is an error: first an exhaustive sweep (every route x every hostile query value, every bad token,
    every hostile body), then hypothesis over routes, tokens, queries and bodies."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from polar_gym.server import RolloutServer, create_server_app
    from polar_gym.web import route_table

    loop = asyncio.new_event_loop()
    store = Store(tmp_path / "prop.sqlite")
    core = RolloutServer(store, max_samples=16)
    app = create_server_app(core, SERVER_TOKEN, manage_lifecycle=False, max_body_bytes=64 * 1024)
    loop.run_until_complete(core.start())
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://server", timeout=30)
    routes = [(m, r.path) for r in route_table(app) for m in r.methods
              if m != "HEAD" and not r.path.endswith("/events")]  # a stream that lasts while its task runs
    assert ("POST", "/tasks") in routes and ("GET", "/metrics") in routes
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                               lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                                           inner, max_size=4),
                               max_leaves=30)
    task = make_task("t-prop").model_dump(mode="json")
    bodies = st.one_of(st.binary(max_size=300), json_values.map(lambda v: json.dumps(v).encode()),
                       st.dictionaries(st.sampled_from(sorted(task)), json_values, max_size=4).map(
                           lambda d: json.dumps({**task, **d}).encode()),
                       st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n))
    # mostly the right token: the routes behind it are the ones worth trying
    tokens = st.sampled_from([SERVER_TOKEN.encode()] * 6 + [None, b"wrong", "tökén".encode(), b"\xff\x00", b""])
    queries = st.dictionaries(st.sampled_from(["limit", "offset", "wait", "url"]),
                              st.sampled_from(["1", "-1", "nan", "inf", str(10**30), "x", "http://h/v1"]),
                              min_size=1, max_size=4)

    def check(method: str, url: str, query: dict[str, str], token: bytes | None, body: bytes) -> None:
        headers = {"content-type": "application/json"} | ({"x-admin-token": token} if token is not None else {})
        resp = loop.run_until_complete(client.request(method, url, params=query, headers=headers,
                                                      content=body if method in ("POST", "DELETE") else None))
        assert resp.status_code < 500, (method, url, query, body[:100], resp.status_code, resp.text[:300])
        if resp.status_code >= 400:
            assert resp.json()["error"]["type"], resp.text[:300]

    good = SERVER_TOKEN.encode()
    hostile_values = ["-1", "nan", "inf", "-inf", str(10**30), "1e309", "x", "", "http://h/v1", "not a url"]
    hostile_bodies = [b"", b"{", b"[]", b"null", b"\xff\xfe", json.dumps(nested(300)).encode(), b"[" * 3000,
                      json.dumps({**task, "num_samples": 10**9}).encode(), json.dumps({"url": "not a url"}).encode()]
    for method, path in routes:
        url = path.replace("{task_id}", "t-prop").replace("{session_id}", "x").replace("{gateway_id}", "x")
        for key in ["limit", "offset", "wait", "url"]:
            for value in hostile_values:
                check(method, url, {key: value}, good, b"")
        for token in [None, b"", b"wrong", "tökén".encode(), b"\xff\x00", good + b"\x80"]:
            check(method, url, {}, token, b"{}")
        for body in hostile_bodies:
            check(method, url, {}, good, body)

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(route=st.sampled_from(routes), token=tokens, query=queries, body=bodies,
           segment=st.sampled_from(["x", "t-prop", "%ff", "a" * 300]))
    def one(route: tuple[str, str], token: bytes | None, query: dict[str, str], body: bytes, segment: str) -> None:
        method, path = route
        url = path.replace("{task_id}", segment).replace("{session_id}", segment).replace("{gateway_id}", segment)
        check(method, url, query, token, body)

    try:
        one()
    finally:
        loop.run_until_complete(client.aclose())
        loop.run_until_complete(core.stop())
        store.close()
        loop.close()


async def test_a_client_that_hangs_up_mid_body_is_no_server_error(tmp_path: Path) -> None:
    """A gateway that stops while sending a heartbeat: the app answers (to nobody) instead of raising, so the server
    logs no 'Exception in ASGI application' traceback."""
    from polar_gym.server import RolloutServer, create_server_app

    app = create_server_app(RolloutServer(Store(tmp_path / "s.sqlite")), SERVER_TOKEN, manage_lifecycle=False)
    sent: list[dict[str, Any]] = []
    chunks = [{"type": "http.request", "body": b'{"in_fl', "more_body": True}, {"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/gateways/gw-1/heartbeat", "raw_path": b"/gateways/gw-1/heartbeat", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
             "headers": [(b"x-admin-token", SERVER_TOKEN.encode()), (b"content-type", b"application/json"),
                         (b"content-length", b"40")]}
    await app(scope, receive, send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 400
