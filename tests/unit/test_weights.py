"""Weight updates through the proxy's admin API (POST /admin/weights) with fake inference servers: in-flight calls
drain first and calls made meanwhile wait; every server gets vLLM's reload, tied-layer refresh, prefix-cache reset
and version tag in that order; later records carry the new version, earlier ones the old; a failing server leaves
the pool under its old version and is named; engines without weights refuse (openai) or only stamp (oracle);
SGLang's /update_weights_from_disk (SGLang cannot run here: its API as its source declares it)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import orjson
import pytest

from polar_gym.proxy.app import create_app
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.base import Engine
from polar_gym.proxy.engines.openai import OpenAIEngine
from polar_gym.proxy.engines.sglang import SGLangEngine
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.upstreams import UpstreamPool
from tests._fakes import FakeVLLM
from tests._serving import oracle_service
from tests._waiting import BOUND, until

ADMIN = {"x-admin-token": "admin-secret"}
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
SERVERS = ["http://engine1", "http://engine2"]
CKPT = "/ckpt/step-3"


class FakeFleet:
    """vLLM servers by host: chat answers (held while ``gate`` is clear), the weight routes, and per-host faults."""

    def __init__(self) -> None:
        self.vllm = FakeVLLM()
        self.gate = asyncio.Event()
        self.gate.set()
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.missing: dict[str, set[str]] = {}  # host -> paths answering 404 (no dev mode, no extension)
        self.cache_busy = 0  # /reset_prefix_cache answers success false this many times first
        self.chats = 0
        self.down: set[str] = set()  # hosts that refuse connections
        self.served: dict[str, str] = {}  # host -> the model it serves (default "policy")
        self.hosts: list[str] = []  # the host of every chat call

    async def handler(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if path == "/v1/models":  # what a server serves, and the checkpoint it started from
            if host in self.down:
                raise httpx.ConnectError("connection refused", request=request)
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": self.served.get(host, "policy"), "object": "model", "root": f"/models/{host}-start"}]})
        body = json.loads(request.content or b"{}")
        if path == "/v1/chat/completions":
            self.chats += 1
            self.hosts.append(host)
            await self.gate.wait()
            return httpx.Response(200, json=self.vllm.answer(body))
        self.calls.append((host, path, body))
        if path in self.missing.get(host, set()):
            return httpx.Response(404, json={"detail": "Not Found"})
        if path == "/collective_rpc" and body["method"] in self.missing.get(host, set()):
            return httpx.Response(500, json={"error": {"message": f"Worker failed with error ''CPUWorker' object has "
                                                                 f"no attribute '{body['method']}''"}})
        if path == "/reset_prefix_cache":
            self.cache_busy -= 1
            return httpx.Response(200, json={"success": self.cache_busy < 0})
        if path == "/collective_rpc":
            return httpx.Response(200, json={"results": [None]})
        return httpx.Response(200, json={"success": True})

    def steps(self, host: str) -> list[str]:
        return [p if p != "/collective_rpc" else b["method"] for h, p, b in self.calls if h == host]


def proxy(engine: Engine) -> tuple[ProxyService, httpx.AsyncClient]:
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True))
    app = create_app(service, ADMIN["x-admin-token"])
    return service, httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy")


def vllm_proxy(fleet: FakeFleet) -> tuple[ProxyService, httpx.AsyncClient]:
    client = httpx.AsyncClient(transport=httpx.MockTransport(fleet.handler))
    return proxy(VLLMEngine(UpstreamPool(SERVERS, policy_version=2), client=client))


async def chat(client: httpx.AsyncClient, session: str) -> httpx.Response:
    return await client.post("/v1/chat/completions", content=orjson.dumps(CHAT),
                             headers={"authorization": f"Bearer {session}", "content-type": "application/json"})


async def update(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/admin/weights", json={"checkpoint": CKPT, "policy_version": 3, **body}, headers=ADMIN)


async def test_update_waits_for_in_flight_calls_then_reloads_every_server_and_stamps_later_records():
    fleet = FakeFleet()
    fleet.cache_busy = 2  # a reset refused while blocks are held is retried
    service, client = vllm_proxy(fleet)
    fleet.gate.clear()
    before = asyncio.create_task(chat(client, "before"))
    await until(lambda: fleet.chats == 1, what="a model call in flight")
    updating = asyncio.create_task(update(client))
    await until(lambda: service.engine.pool.paused, what="the pool to pause")
    during = asyncio.create_task(chat(client, "during"))  # arrives while paused: waits, then goes on
    await asyncio.sleep(0.05)  # (a chance to fail early: nothing may load while a call is in flight)
    assert fleet.calls == [] and not updating.done() and fleet.chats == 1
    fleet.gate.set()
    reply = await asyncio.wait_for(updating, BOUND)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert (body["policy_version"], body["previous_version"], body["paused"]) == (3, 2, False)
    assert sorted(body["servers"]) == SERVERS and body["drained_seconds"] > 0
    assert set(body["servers"]["http://engine1"]) == {"reload_seconds", "cache_reset_seconds", "version_tag_seconds"}
    for host in ("engine1", "engine2"):
        steps = fleet.steps(host)
        assert steps[:2] == ["reload_weights", "polar_refresh_tied_weights"] and steps[-1] == "/update_weight_version"
        assert set(steps[2:-1]) == {"/reset_prefix_cache"}
    reload = next(b for h, p, b in fleet.calls if p == "/collective_rpc")
    assert reload == {"method": "reload_weights", "kwargs": {"weights_path": CKPT}}
    assert {"new_version": "3"} in [b for _, p, b in fleet.calls if p == "/update_weight_version"]
    assert (await before).status_code == 200 and (await asyncio.wait_for(during, BOUND)).status_code == 200
    (old,) = await service.journal.records("before")
    (new,) = await service.journal.records("during")
    assert (old.policy_version, new.policy_version) == (2, 3)
    view = (await client.get("/admin/upstreams", headers=ADMIN)).json()
    assert (view["checkpoint"], view["policy_version"], view["paused"]) == (CKPT, 3, False)


async def test_a_failing_server_leaves_the_pool_under_the_old_version_and_is_named():
    fleet = FakeFleet()
    fleet.missing["engine2"] = {"/collective_rpc"}  # started without VLLM_SERVER_DEV_MODE
    service, client = vllm_proxy(fleet)
    reply = await update(client)
    assert reply.status_code == 502
    error = reply.json()["error"]
    assert error["type"] == "weight_update_failed"
    assert "http://engine2/collective_rpc answered 404" in error["message"]
    assert "VLLM_SERVER_DEV_MODE" in error["message"]
    # engine1 had taken the new weights: it loads back the checkpoint it reports it started from
    assert "back on their previous weights: http://engine1" in error["message"]
    reloads = [b["kwargs"]["weights_path"] for h, p, b in fleet.calls
               if h == "engine1" and p == "/collective_rpc" and b["method"] == "reload_weights"]
    assert reloads == [CKPT, "/models/engine1-start"]
    pool = service.engine.pool
    assert not pool.paused and pool.policy_version == 2 and pool.checkpoint is None
    assert sorted(s.url for s in pool.servers()) == SERVERS
    assert (await chat(client, "after")).status_code == 200  # the pool serves on, under the old version
    (rec,) = await service.journal.records("after")
    assert rec.policy_version == 2


async def test_a_server_that_took_the_new_weights_and_cannot_go_back_leaves_the_pool():
    fleet = FakeFleet()
    fleet.missing["engine2"] = {"/collective_rpc"}
    service, client = vllm_proxy(fleet)
    assert (await update(client, checkpoint="/ckpt/step-1", policy_version=2)).status_code == 502
    fleet.missing["engine2"] = set()
    assert (await update(client, checkpoint="/ckpt/step-2")).status_code == 200  # both on step-2 now, version 3
    fleet.missing["engine2"] = {"/collective_rpc"}
    fleet.missing["engine1"] = {"/reset_prefix_cache"}  # engine1 loads step-3, then fails, and so does its way back
    reply = await update(client, policy_version=4)
    message = reply.json()["error"]["message"]
    assert reply.status_code == 502 and "taken out of the pool" in message
    pool = service.engine.pool
    assert [s.url for s in pool.servers()] == ["http://engine2"] and pool.policy_version == 3
    assert pool.checkpoint == "/ckpt/step-2"


async def test_restarted_servers_replace_an_engine_that_cannot_reload():
    """The openai engine cannot load weights: servers restarted on the checkpoint take the pool's place (checked
    first), after in-flight calls drained; later calls go to them under the new version."""
    fleet = FakeFleet()
    engine = OpenAIEngine(UpstreamPool(["http://old1"], policy_version=1),
                          client=httpx.AsyncClient(transport=httpx.MockTransport(fleet.handler)),
                          upstream_model="policy")
    service, client = proxy(engine)
    fleet.gate.clear()
    before = asyncio.create_task(chat(client, "s1"))
    await until(lambda: fleet.chats == 1, what="a model call in flight")
    updating = asyncio.create_task(update(client, servers=["http://new1", "http://new2/"], policy_version=2))
    await until(lambda: engine.pool.paused, what="the pool to pause")
    fleet.gate.set()
    reply = await asyncio.wait_for(updating, BOUND)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["replaced"] == ["http://old1"] and sorted(body["servers"]) == ["http://new1", "http://new2"]
    assert (body["policy_version"], body["previous_version"]) == (2, 1)
    assert (await before).status_code == 200
    assert (await chat(client, "s1")).status_code == 200  # the same session: its sticky server is gone
    first, second = await service.journal.records("s1")
    assert (first.server, first.policy_version) == ("http://old1", 1)
    assert second.server in ("http://new1", "http://new2") and second.policy_version == 2
    assert fleet.hosts == ["old1", second.server.removeprefix("http://")]
    view = (await client.get("/admin/upstreams", headers=ADMIN)).json()
    assert view["checkpoint"] == CKPT and sorted(s["url"] for s in view["servers"]) == ["http://new1", "http://new2"]


@pytest.mark.parametrize(("trouble", "named"), [("down", "did not answer"), ("other_model", "not 'policy'")])
async def test_a_restarted_server_that_cannot_serve_changes_nothing(trouble: str, named: str):
    fleet = FakeFleet()
    if trouble == "down":
        fleet.down.add("new1")
    else:
        fleet.served["new1"] = "base-model"
    engine = VLLMEngine(UpstreamPool(["http://old1"], policy_version=1), upstream_model="policy",
                        client=httpx.AsyncClient(transport=httpx.MockTransport(fleet.handler)))
    _, client = proxy(engine)
    reply = await update(client, servers=["http://new1"])
    assert reply.status_code == 502 and named in reply.json()["error"]["message"]
    assert "http://new1" in reply.json()["error"]["message"]
    assert [s.url for s in engine.pool.servers()] == ["http://old1"] and not engine.pool.paused
    assert engine.pool.policy_version == 1 and fleet.calls == []


async def test_a_staged_update_is_undone_on_request():
    """The rollout server's answer to another gateway failing: a reload staged with resume false goes back to the
    servers' previous checkpoints, a staged swap puts the old servers back; both resume under the old version."""
    fleet = FakeFleet()
    service, client = vllm_proxy(fleet)
    assert (await client.post("/admin/weights/undo", headers=ADMIN)).status_code == 409  # nothing staged
    assert (await client.post("/admin/weights/undo")).status_code == 401  # admin only
    assert (await update(client, resume=False)).status_code == 200
    fleet.calls.clear()
    undone = await client.post("/admin/weights/undo", headers=ADMIN)
    assert undone.status_code == 200, undone.text
    pool = service.engine.pool
    assert not pool.paused and pool.policy_version == 2 and pool.checkpoint is None
    back = sorted((h, b["kwargs"]["weights_path"]) for h, p, b in fleet.calls
                  if p == "/collective_rpc" and b["method"] == "reload_weights")
    assert back == [("engine1", "/models/engine1-start"), ("engine2", "/models/engine2-start")]
    assert (await update(client, servers=["http://engine3"], resume=False)).status_code == 200
    assert (await client.post("/admin/weights/undo", headers=ADMIN)).status_code == 200
    assert sorted(s.url for s in pool.servers()) == SERVERS and pool.policy_version == 2
    assert (await update(client, resume=False)).status_code == 200
    await client.post("/admin/resume", json={"policy_version": 3}, headers=ADMIN)
    assert (await client.post("/admin/weights/undo", headers=ADMIN)).status_code == 409  # committed: nothing to undo


async def test_a_server_without_the_worker_extension_or_version_route_still_updates():
    fleet = FakeFleet()
    fleet.missing["engine1"] = {"polar_refresh_tied_weights", "/update_weight_version"}  # a GPU build, older vLLM
    service, client = vllm_proxy(fleet)
    reply = await update(client, policy_version="v9")
    assert reply.status_code == 200 and service.engine.pool.policy_version == "v9"


async def test_drain_timeout_loads_nothing_and_resumes():
    fleet = FakeFleet()
    service, client = vllm_proxy(fleet)
    fleet.gate.clear()
    stuck = asyncio.create_task(chat(client, "long"))
    await until(lambda: fleet.chats == 1, what="a model call in flight")
    reply = await update(client, drain_timeout=0.05)
    assert reply.status_code == 504 and reply.json()["error"]["type"] == "drain_timeout"
    assert fleet.calls == [] and not service.engine.pool.paused and service.engine.pool.policy_version == 2
    fleet.gate.set()
    assert (await stuck).status_code == 200


async def test_staged_update_stays_paused_until_resumed():
    fleet = FakeFleet()
    service, client = vllm_proxy(fleet)
    reply = await update(client, resume=False)
    assert reply.status_code == 200 and reply.json()["paused"] is True
    assert service.engine.pool.paused and service.engine.pool.policy_version == 2  # the caller resumes it
    await client.post("/admin/resume", json={"policy_version": 3}, headers=ADMIN)
    assert not service.engine.pool.paused and service.engine.pool.policy_version == 3


async def test_openai_engine_refuses_a_reload_before_pausing_and_oracle_only_stamps():
    calls: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(500)

    engine = OpenAIEngine(UpstreamPool(SERVERS), client=httpx.AsyncClient(transport=httpx.MockTransport(record)))
    service, client = proxy(engine)
    reply = await update(client)
    assert reply.status_code == 409 and reply.json()["error"]["type"] == "weights_unsupported"
    assert calls == [] and not service.engine.pool.paused

    oracle = oracle_service()
    _, client = proxy(oracle.engine)
    reply = await update(client, policy_version=5)
    assert reply.status_code == 200 and reply.json()["servers"] == {}
    assert oracle.engine.pool.policy_version == 5 and not oracle.engine.pool.paused


@pytest.mark.parametrize("body", [{"checkpoint": "", "policy_version": 1}, {"checkpoint": CKPT},
                                  {"checkpoint": CKPT, "policy_version": "x" * 300},
                                  {"checkpoint": CKPT, "policy_version": 1, "drain_timeout": 0},
                                  {"checkpoint": CKPT, "policy_version": 1, "drain_timeout": 1e12},
                                  {"checkpoint": "/ckpt\x00/../etc", "policy_version": 1},
                                  {"checkpoint": "/ckpt\nstep-1", "policy_version": 1},
                                  {"checkpoint": CKPT, "policy_version": 1, "servers": []},
                                  {"checkpoint": CKPT, "policy_version": 1, "servers": ["file:///etc/passwd"]},
                                  {"checkpoint": CKPT, "policy_version": 1, "servers": "http://new1"},
                                  {"checkpoint": CKPT, "policy_version": 1, "servers": ["http://a b"]}])
async def test_bad_update_bodies_are_refused(body: dict[str, Any]):
    _, client = vllm_proxy(FakeFleet())
    reply = await client.post("/admin/weights", json=body, headers=ADMIN)
    assert reply.status_code == 422 and reply.json()["error"]["type"] == "invalid_request"
    assert (await client.post("/admin/weights", json={"checkpoint": CKPT, "policy_version": 1})).status_code == 401


async def test_sglang_loads_from_disk_with_the_version_tag_and_its_refusal_is_named():
    seen: list[tuple[str, str, dict[str, Any]]] = []
    refuse = {"engine2"}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "policy", "root": "/models/start"}]})
        seen.append((request.url.host, request.url.path, json.loads(request.content)))
        if request.url.host in refuse:
            return httpx.Response(200, json={"success": False, "message": "Failed to get weights iterator"})
        return httpx.Response(200, json={"success": True, "message": "Succeeded to update model weights."})

    engine = SGLangEngine(UpstreamPool(SERVERS, policy_version=0),
                          client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    service, client = proxy(engine)
    reply = await update(client)
    assert reply.status_code == 502 and "Failed to get weights iterator" in reply.json()["error"]["message"]
    assert "http://engine2" in reply.json()["error"]["message"] and service.engine.pool.policy_version == 0
    assert ("engine1", "/update_weights_from_disk", {"model_path": CKPT, "weight_version": "3"}) in seen
    refuse.clear()
    assert (await update(client)).status_code == 200 and service.engine.pool.policy_version == 3
