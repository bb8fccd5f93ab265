"""A weight update of the whole fleet through the rollout server (POST /backends/weights, RolloutClient.update_weights)
with real gateways (oracle engine: it has no weights, so an update stamps the version): every gateway pauses, loads,
resumes under the new version, and later sessions' trace spans carry it; a gateway that cannot load makes the update
fail by name with every gateway back under its old version; a gateway registering later resumes under the fleet's
version; sessions running during an update wait and complete, their later calls under the new version."""

from __future__ import annotations

import pytest

from polar_gym.proxy.errors import WeightUpdateError
from polar_gym.proxy.routes import admin as admin_routes
from polar_gym.server import RolloutClient
from polar_gym.server.client import WeightUpdateFailed, traces_of
from polar_gym.server.fleet import DRAINING
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
        await client.submit(make_task("t-during", 2, calls=3, sleep=1.0))
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
