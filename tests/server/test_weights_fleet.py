"""A weight update of the whole fleet through the rollout server (POST /backends/weights, RolloutClient.update_weights)
with real gateways (oracle engine: it has no weights, so an update stamps the version): every gateway pauses, loads,
resumes under the new version, and later sessions' trace spans carry it; a gateway that cannot load makes the update
fail by name with every gateway back under its old version; a gateway registering later resumes under the fleet's
version; sessions running during an update wait and complete, their later calls under the new version."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from polar_gym.proxy.engines.openai import OpenAIEngine
from polar_gym.proxy.errors import WeightUpdateError
from polar_gym.proxy.routes import admin as admin_routes
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.server import RolloutClient
from polar_gym.server.__main__ import parse_args
from polar_gym.server.client import WeightUpdateFailed, traces_of
from polar_gym.server.fleet import DRAINING
from polar_gym.server.weights import allowed_by
from polar_gym.serving import free_port, serving
from tests._waiting import until
from tests.server._server_kit import SERVER_TOKEN, Harness, make_task

pytestmark = pytest.mark.slow


async def test_fleet_update_reaches_every_gateway_and_later_spans_carry_the_version(
        harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = await harness.gateway(), await harness.gateway()
    srv = await harness.server()
    ids = {await srv.register(first, 2): first, await srv.register(second, 2): second}
    async with RolloutClient(srv.url, SERVER_TOKEN) as client:
        reply = await client.update_weights("/ckpt/step-1", 1)
        assert reply.updated and reply.policy_version == 1 and set(reply.gateways) == set(ids)
        for phases in reply.gateways.values():
            assert [phases[p]["status"] for p in ("pause", "weights", "resume")] == [200, 200, 200]
            assert phases["resume"]["body"]["policy_version"] == 1
        assert all(gw.service.engine.pool.policy_version == 1 and not gw.service.engine.pool.paused
                   for gw in ids.values())

        await client.submit(make_task("t-after", 2))
        await client.wait("t-after", timeout=60)
        results = [r async for r in client.results(["t-after"], timeout=60)]
        spans = [s for r in results for t in traces_of(r) for s in t.metadata["spans"]]
        assert spans and {s["policy_version"] for s in spans} == {1}

        monkeypatch.setattr(second.service.engine, "weight_updates", None)  # this one now cannot load
        with pytest.raises(WeightUpdateFailed) as failed:
            await client.update_weights("/ckpt/step-2", 2)
        bad = next(gid for gid, gw in ids.items() if gw is second)
        assert bad in failed.value.reply.message and "cannot load new weights" in failed.value.reply.message
        assert failed.value.reply.gateways[bad]["weights"]["status"] == 409
        good = next(gid for gid in ids if gid != bad)
        # the gateway that had taken the checkpoint undid it (its servers load their previous weights back)
        phases = failed.value.reply.gateways
        assert phases[good]["undo"]["status"] == 200 and "undo" not in phases[bad]
        assert all(gw.service.engine.pool.policy_version == 1 and not gw.service.engine.pool.paused
                   and gw.service.engine.pool.staged is None for gw in ids.values())  # all back under the old version

        async def cannot_undo(engine: object) -> None:
            raise WeightUpdateError("http://engine1: connection refused")

        monkeypatch.setattr(admin_routes, "undo_staged_update", cannot_undo)
        with pytest.raises(WeightUpdateFailed) as failed:
            await client.update_weights("/ckpt/step-2", 2)
        assert failed.value.reply.gateways[good]["undo"]["status"] == 502
        assert f"could not load the old ones back, so they are drained: {good}" in failed.value.reply.message
        assert srv.core.gateway(good).row.state == DRAINING  # no new session goes where the version lies

    late = await harness.gateway()
    await srv.register(late, 2)
    assert late.service.engine.pool.policy_version == 1  # the fleet's version, stamped on registering


async def test_fleet_update_without_gateways_is_refused(harness: Harness) -> None:
    srv = await harness.server()
    resp = await srv.http.post("/backends/weights", json={"checkpoint": "/ckpt", "policy_version": 1})
    assert resp.status_code == 409 and resp.json()["error"]["type"] == "no_gateways"


async def test_sessions_in_flight_wait_through_an_update_and_go_on_under_the_new_version(harness: Harness) -> None:
    gw = await harness.gateway()
    srv = await harness.server()
    await srv.register(gw, 4)
    pool = gw.service.engine.pool
    async with RolloutClient(srv.url, SERVER_TOKEN) as client:
        # a second between calls: the update lands after each session's first call and before its last (back to
        # back, the three calls could all finish before the update, and no span carried the new version)
        await client.submit(make_task("t-during", 2, calls=3, gap=1.0))
        await until(lambda: sum(s.served for s in pool.servers()) >= 2, what="each session's first model call")
        reply = await client.update_weights("/ckpt/step-1", 1)
        assert reply.updated
        view = await client.wait("t-during", timeout=120)
        assert set(view["sessions"].values()) == {"COMPLETED"}  # none lost
        results = [r async for r in client.results(["t-during"], timeout=60)]
    for result in results:
        traces = sorted(traces_of(result), key=lambda t: t.metadata["completion_indices"][0])
        versions = [span["policy_version"] for t in traces for span in t.metadata["spans"]]
        assert len(versions) == 3 and versions[0] is None and versions[-1] == 1, versions
        assert versions == sorted(versions, key=lambda v: -1 if v is None else v)  # never back to the old one


class Bystander:
    """A real HTTP service on loopback that is not an inference server of the fleet: it counts the requests it gets
    and answers each with a 500 whose text must never travel back to the caller of the weight update."""

    TEXT = "bystander-private-answer-5c1e"

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.app = Starlette(routes=[Route("/{path:path}", self.answer, methods=["GET", "POST"])])

    async def answer(self, request: Request) -> PlainTextResponse:
        self.hits.append(request.url.path)
        return PlainTextResponse(self.TEXT, status_code=500)


async def test_weight_update_servers_are_limited_to_the_fleet_and_the_allowlist_and_answers_are_not_echoed(
        harness: Harness) -> None:
    """Issue 35, point 6: ``servers`` named any URL, a gateway's proxy fetched it, and 300 characters of its answer
    came back. Now a URL the fleet does not know is refused (403, named) before anything is fetched or paused; one
    the fleet knows (a gateway's upstream) or the allowlist covers is fetched, and its failure is told by status."""
    bystander = Bystander()
    port = free_port()
    async with serving(bystander.app, "127.0.0.1", port):
        foreign = f"http://127.0.0.1:{port}"
        gw = await harness.gateway()
        srv = await harness.server()
        await srv.register(gw, 2)
        refused = await srv.http.post("/backends/weights", json={"checkpoint": "/ckpt", "policy_version": 1,
                                                                 "servers": [foreign + "/v1"]})
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["type"] == "weight_server_not_allowed"
        assert f"{foreign}/v1" in refused.json()["error"]["message"]
        assert bystander.hits == [] and not gw.service.engine.pool.paused and srv.core.policy_version is None

        # a gateway whose proxy serves through the bystander: a server of the fleet, so it is asked, and it fails
        engine = OpenAIEngine(UpstreamPool([foreign], policy_version=0), upstream_model="policy")
        try:
            http_gw = await harness.gateway(engine=engine)
            srv2 = await harness.server(db=harness.tmp / "second.sqlite")
            await srv2.register(http_gw, 2)
            async with RolloutClient(srv2.url, SERVER_TOKEN) as client:
                with pytest.raises(WeightUpdateFailed) as failed:
                    await client.update_weights("/ckpt", 1, servers=[foreign])
            reply = failed.value.reply
            assert bystander.hits == ["/v1/models"] and "answered HTTP 500, not a model list" in reply.message
            assert Bystander.TEXT not in reply.model_dump_json()

            # the allowlist: an entry without a port allows every port of its host
            srv3 = await harness.server(db=harness.tmp / "third.sqlite", weight_servers=["http://127.0.0.1"])
            await srv3.register(http_gw, 2)
            async with RolloutClient(srv3.url, SERVER_TOKEN) as client:
                with pytest.raises(WeightUpdateFailed) as failed:
                    await client.update_weights("/ckpt", 1, servers=[f"http://127.0.0.1:{port}/other"])
            assert bystander.hits == ["/v1/models", "/other/v1/models"]
            assert Bystander.TEXT not in failed.value.reply.model_dump_json()
        finally:
            await engine.aclose()


@pytest.mark.parametrize(("url", "entries", "allowed"), [
    ("http://gpu-07:8000", ["http://gpu-07:8000"], True),
    ("http://gpu-07:8000", ["http://gpu-07"], True),  # no port: every port of the host
    ("http://gpu-07:8001", ["http://gpu-07:8000"], False),
    ("http://GPU-07:8000/v1", ["http://gpu-07:8000"], True),
    ("https://gpu-07:8000", ["http://gpu-07:8000"], False),
    ("http://gpu-070:8000", ["http://gpu-07"], False),
    ("http://gpu-07:8000/a/b", ["http://gpu-07:8000/a"], True),
    ("http://gpu-07:8000/ab", ["http://gpu-07:8000/a"], False),
    ("http://gpu-07", ["http://gpu-07:80"], True),
    ("http://evil.example", [], False),
])
def test_the_allowlist_matches_scheme_host_port_and_path(url: str, entries: list[str], allowed: bool) -> None:
    assert allowed_by(url, entries) is allowed


def test_the_allowlist_is_a_server_setting(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(["--admin-token", "t", "--weight-server", "http://gpu-07", "--weight-server",
                       "https://gpu-08:8000/v1"])
    assert args.weight_server == ["http://gpu-07", "https://gpu-08:8000/v1"]
    with pytest.raises(SystemExit):
        parse_args(["--admin-token", "t", "--weight-server", "file:///etc/passwd"])
    assert "--weight-server 'file:///etc/passwd'" in capsys.readouterr().err
