"""The gateway's HTTP API end to end over a real socket with httpx: dispatch, status, result, completions, cancel,
health, drain; registered keys only on the proxy routes; admin endpoints need the admin token."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from _gateway_kit import MakeGateway, no_processes_with

from polar_gym.gateway import GatewayConfig, GatewayNode, SandboxStages, build_gateway
from polar_gym.gateway.__main__ import config_from_args, parse_args
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.schema import SessionResult


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
        for _ in range(400):
            if (await client.get("/sessions/api-2", headers=admin)).json()["stage"] == "run":
                break
            await asyncio.sleep(0.05)
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
        for _ in range(400):
            if await gw.service.journal.records("slow"):
                break
            await asyncio.sleep(0.05)


def test_a_gateway_refuses_an_adhoc_registry() -> None:
    from _fakes import ByteTokenizer

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
