"""The gateway's HTTP API end to end over a real socket with httpx: dispatch, status, result, completions, cancel,
health, drain; registered keys only on the proxy routes; admin endpoints need the admin token."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from polar_gym.gateway import GatewayConfig, GatewayNode, SandboxStages, build_gateway
from polar_gym.gateway.cli import config_from_args, parse_args
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.schema import SessionResult
from tests.gateway._gateway_kit import MakeGateway, no_processes_with


async def until(probe: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    """Wait for a condition (never for a fixed time): generous, since CI may be loaded."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not await probe():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_http_api_end_to_end(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(run_slots=1)
    admin = {"x-admin-token": gw.admin}
    spec = gw.spec("api-1", calls=2)
    body = spec.model_dump(mode="json")
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        assert (await client.post("/sessions", json=body)).status_code == 401  # admin only
        created = await client.post("/sessions", json=body, headers=admin)
        assert created.status_code == 201, created.text
        assert created.json()["session_id"] == "api-1"
        assert (await client.post("/sessions", json=body, headers=admin)).status_code == 409
        assert (await client.post("/sessions", json={"nonsense": 1}, headers=admin)).status_code == 422

        status = await client.get("/sessions/api-1", headers=admin)
        assert status.status_code == 200 and status.json()["stage"] in ("queued", "init", "ready", "run", "postrun",
                                                                         "done")
        assert (await client.get("/sessions/api-1")).status_code == 401
        assert (await client.get("/sessions/nope", headers=admin)).status_code == 404

        done = await client.get("/sessions/api-1/result", params={"wait": 25}, headers=admin)
        assert done.status_code == 200, done.text
        result = SessionResult.model_validate(done.json())
        assert result.status.value == "COMPLETED" and result.trajectory is not None
        assert len(result.trajectory.traces) == 2
        # the session id is not a key; once the session is over, its captures need the admin token
        own = {"authorization": "Bearer api-1"}
        assert (await client.get("/sessions/api-1/result", headers=own)).status_code == 401
        assert (await client.get("/sessions/api-1/completions", headers=own)).status_code == 401
        completions = await client.get("/sessions/api-1/completions", headers=admin)
        assert len(completions.json()["completions"]) == 2

        # after teardown the key is no longer served: unknown keys get 401 from the model routes
        chat = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
        late = await client.post("/v1/chat/completions", json=chat, headers=own)
        assert late.status_code == 401
        assert (await client.post("/v1/chat/completions", json=chat,
                                  headers={"authorization": "Bearer never-registered"})).status_code == 401
        assert (await client.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": []},
                                  headers={"x-api-key": "never-registered"})).status_code == 401

        # cancel through the API, while the harness runs
        long = gw.spec("api-2", sleep=60).model_dump(mode="json")
        assert (await client.post("/sessions", json=long, headers=admin)).status_code == 201
        async def running() -> bool:
            return bool((await client.get("/sessions/api-2", headers=admin)).json()["stage"] == "run")

        await until(running, 60, "api-2 to run")
        assert (await client.post("/sessions/api-2/cancel")).status_code == 401
        cancelled = await client.post("/sessions/api-2/cancel", headers=admin)
        assert cancelled.json()["cancelled"] is True
        res = await client.get("/sessions/api-2/result", params={"wait": 20}, headers=admin)
        assert res.json()["status"] == "CANCELLED"

        health = (await client.get("/gateway/health")).json()
        assert health["finished"] == {"COMPLETED": 1, "CANCELLED": 1}
        assert set(health["stages"]) == {"queued", "init", "ready", "run", "postrun"}
        assert health["pools"]["run"]["capacity"] == 1 and health["pools"]["run"]["busy"] == 0
        assert health["latency_seconds"]["run"]["count"] == 2
        assert health["runtimes_live"] == 0

        # drain: in-flight sessions finish, new ones are refused
        third = gw.spec("api-3", sleep=0.3).model_dump(mode="json")
        assert (await client.post("/sessions", json=third, headers=admin)).status_code == 201
        assert (await client.post("/gateway/drain")).status_code == 401
        drained = await client.post("/gateway/drain", params={"wait": True}, headers=admin)
        assert drained.json()["status"] == "draining"
        assert gw.node.get("api-3").status.value == "COMPLETED"
        again = gw.spec("api-4").model_dump(mode="json")
        assert (await client.post("/sessions", json=again, headers=admin)).status_code == 503
    assert await no_processes_with(gw.marker) == []


async def test_result_is_202_while_running(make_gateway: MakeGateway) -> None:
    gw = await make_gateway()
    gw.node.submit(gw.spec("slow", sleep=60))
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        pending = await client.get("/sessions/slow/result", headers={"x-admin-token": gw.admin})
        assert pending.status_code == 202 and pending.json()["status"] != "COMPLETED"
        # end only once the harness is well under way (see the report: a cancel in the first milliseconds of an
        # exec can race the local runtime's sandbox start)
        async def called() -> bool:
            return bool(await gw.service.journal.records("slow"))

        await until(called, 60, "the harness's model call")


def test_a_gateway_refuses_an_adhoc_registry() -> None:
    from tests._fakes import ByteTokenizer

    service = ProxyService(OracleEngine(ByteTokenizer()), sessions=SessionRegistry(allow_adhoc=True))
    with pytest.raises(ValueError, match="registered sessions only"):
        build_gateway(service, GatewayConfig(), "token")


def test_cli_arguments_become_the_config(tmp_path: object) -> None:
    args = parse_args(["--engine", "oracle", "--port", "9123", "--host", "0.0.0.0", "--workdir", "/tmp/gw",
                       "--run-slots", "3", "--init-workers", "5", "--ready-buffer", "0", "--postrun-workers", "2"])
    config = config_from_args(args)
    assert config.endpoint is not None and (config.endpoint.host, config.endpoint.port) == ("127.0.0.1", 9123)
    assert (config.run_slots, config.init_workers, config.ready_buffer, config.postrun_workers) == (3, 5, 0, 2)
    assert isinstance(GatewayNode(SandboxStages(ProxyService.__new__(ProxyService), config), config), GatewayNode)


async def test_one_poll_watches_many_sessions(make_gateway: MakeGateway) -> None:
    """POST /sessions/poll (the rollout server's watch): it answers when the first of its sessions finished, with
    that result, the others' statuses and the ids the gateway does not know; else after ``wait``."""
    gw = await make_gateway(run_slots=2)
    admin = {"x-admin-token": gw.admin}
    gw.node.submit(gw.spec("quick", sleep=0.5))
    gw.node.submit(gw.spec("slow", sleep=60))
    async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
        ids = ["quick", "slow", "elsewhere"]
        assert (await client.post("/sessions/poll", json={"session_ids": ids, "wait": 1})).status_code == 401
        assert (await client.post("/sessions/poll", json={"session_ids": ids, "wait": -1},
                                  headers=admin)).status_code == 422
        answered = await client.post("/sessions/poll", json={"session_ids": ids, "wait": 50}, headers=admin)
        body = answered.json()
        assert [r["session_id"] for r in body["results"]] == ["quick"]
        assert SessionResult.model_validate(body["results"][0]).status.value == "COMPLETED"
        assert list(body["statuses"]) == ["slow"] and body["unknown"] == ["elsewhere"]
        timed_out = (await client.post("/sessions/poll", json={"session_ids": ["slow"], "wait": 0.5},
                                       headers=admin)).json()
        assert timed_out["results"] == [] and timed_out["statuses"] == {"slow": gw.node.get("slow").status.value}
        gw.node.cancel("slow", "test over")
        cancelled = (await client.post("/sessions/poll", json={"session_ids": ["slow"], "wait": 30},
                                       headers=admin)).json()
        assert [r["status"] for r in cancelled["results"]] == ["CANCELLED"]
    assert await no_processes_with(gw.marker) == []


async def _raw(url: str, head: str) -> tuple[int, bytes]:
    """One request whose head declares a body that is never sent; the status and body of the answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head.encode() + b"\r\n\r\n")
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 20)
    finally:
        writer.close()
    return int(data.split(b" ", 2)[1]), data.split(b"\r\n\r\n", 1)[1]


async def test_admin_routes_check_the_token_before_the_body(make_gateway: MakeGateway) -> None:
    """Issue 11, fault 6: 4 x 50 MB to /sessions/poll without a token grew the gateway by 700 MB (the body was
    parsed before the token was checked); now each is refused before a byte of body is read. Malformed tokens are
    401, not 500; query parameters are range-checked; a 422 quotes an excerpt of the input."""
    gw = await make_gateway()
    for path in ["/sessions/poll", "/sessions", "/sessions/x/cancel", "/gateway/drain", "/admin/upstreams"]:
        status, body = await _raw(gw.url, f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                                          f"content-length: {50 * 2**20}")
        assert status == 401 and b"admin" in body, (path, status, body[:200])  # on main: waits for the body
    status, _ = await _raw(gw.url, f"POST /sessions/poll HTTP/1.1\r\nhost: x\r\nx-admin-token: {gw.admin}\r\n"
                                   f"content-type: application/json\r\ncontent-length: {50 * 2**20}")
    assert status == 413
    admin = {"x-admin-token": gw.admin}
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        for token in ["tökén".encode(), b"\xff\xfe"]:
            resp = await client.get("/sessions/nope", headers={"x-admin-token": token})
            assert resp.status_code == 401, resp.text  # on main: 500
            resp = await client.post("/sessions/poll", json={"session_ids": []}, headers={"x-admin-token": token})
            assert resp.status_code == 401
        for wait in ["nan", "1e309", "-1", "soon"]:
            resp = await client.get("/sessions/nope/result", params={"wait": wait}, headers=admin)
            assert resp.status_code == 422, (wait, resp.status_code)
        big = gw.spec("big").model_dump(mode="json") | {"instruction": ["x" * 500_000]}
        resp = await client.post("/sessions", json=big, headers=admin)
        assert resp.status_code == 422 and len(resp.content) < 4000, len(resp.content)  # on main: the whole input
        deep: dict = {"leaf": 1}
        for _ in range(100):
            deep = {"a": deep}
        spec = gw.spec("deep").model_dump(mode="json")
        resp = await client.post("/sessions", json=spec | {"metadata": {"deep": deep}}, headers=admin)
        assert resp.status_code == 422 and resp.json()["error"]["type"] == "too_deep"
        resp = await client.post("/sessions/poll", json={"session_ids": ["s" * 1000]}, headers=admin)
        assert resp.status_code == 422 and len(resp.content) < 4000
        resp = await client.post("/sessions/poll", json={"session_ids": ["a"], "wait": 0}, headers=admin)
        assert resp.status_code == 200 and resp.json()["unknown"] == ["a"]
