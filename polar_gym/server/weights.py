"""A weight update of the whole fleet (POST /backends/weights): every live gateway's proxy loads a checkpoint into
its inference servers and stamps the new policy version, in three phases so that no server is reloaded while any
gateway still has a call on it (gateways share servers):

1. pause every gateway: new model calls wait, in-flight ones finish (if one cannot, all resume and nothing loads),
   or with ``in_flight: cut`` (the default) token-in generations are cut and continue from their tokens after the
   resume, under the new weights (``cut`` in the answer counts them);
2. every gateway loads the checkpoint into its servers and stays paused (``resume: false``);
3. every gateway resumes under the new version, or, when one failed, under its old one (the failure names it)
   after the gateways that took the checkpoint undid it (``POST /admin/weights/undo``: their servers load their
   previous weights back); a gateway that cannot undo is drained, so no new session runs on weights its version
   does not name.

Sessions only wait; none is lost. With ``servers`` (engines restarted on the checkpoint instead of reloaded), phase
2 swaps every gateway's servers for them, and they replace the server's backends. Each of ``servers`` must be one the
fleet knows (a backend of this server, an upstream a gateway reports) or be allowed by the server's ``weight_servers``
setting, checked before anything pauses: a gateway's proxy fetches every one of them, so an open list would let an
admin call make the fleet request any URL (403 ``weight_server_not_allowed`` names the refused ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any
from urllib.parse import SplitResult, urlsplit

from polar_gym.schema import FleetWeightUpdate, WeightUpdateRequest
from polar_gym.server.core import FANOUT_TIMEOUT, RolloutServer
from polar_gym.server.errors import ServerError

__all__ = ["allowed_by", "check_servers", "update_fleet_weights"]


def _failed(answers: dict[str, Any]) -> dict[str, Any]:
    return {gid: answer for gid, answer in answers.items() if answer.get("status") != 200}


def _why(answer: dict[str, Any]) -> str:
    error = (answer.get("body") or {}).get("error") if isinstance(answer.get("body"), dict) else None
    if isinstance(error, dict):
        return str(error.get("message"))[:500]
    return str(answer.get("error") or answer.get("body"))[:500]


def _cut(answer: dict[str, Any]) -> int:
    body = answer.get("body")
    count = body.get("cut") if isinstance(body, dict) else None
    return count if isinstance(count, int) else 0


def allowed_by(url: str, entries: Iterable[str]) -> bool:
    """Whether an allowlist entry covers ``url``: same scheme and host, the same port (an entry without a port allows
    every port of its host) and a path under the entry's path."""
    want = urlsplit(url)
    for entry in entries:
        have = urlsplit(entry)
        path = have.path.rstrip("/")
        if (have.scheme.lower(), have.hostname) == (want.scheme.lower(), want.hostname) \
                and (have.port is None or have.port == _port(want)) \
                and (want.path.rstrip("/") == path or want.path.startswith(path + "/")):
            return True
    return False


def _port(parts: SplitResult) -> int:
    return parts.port or (443 if parts.scheme.lower() == "https" else 80)


async def _registered(server: RolloutServer) -> set[str]:
    """The upstreams every live gateway reports (the servers the fleet was started with or was given)."""
    urls: set[str] = set(server.backends)
    for answer in (await server.fanout("GET", "/admin/upstreams")).values():
        body = answer.get("body") if answer.get("status") == 200 else None
        for each in (body or {}).get("servers", []) if isinstance(body, dict) else []:
            if isinstance(each, dict) and isinstance(each.get("url"), str):
                urls.add(each["url"].rstrip("/"))
    return urls


async def check_servers(server: RolloutServer, servers: list[str]) -> None:
    """Refuse (403, naming them) the ``servers`` of an update that the fleet does not know and the server's
    ``weight_servers`` allowlist does not cover."""
    refused = [url for url in servers if url not in server.backends and not allowed_by(url, server.weight_servers)]
    if refused:
        registered = await _registered(server)
        refused = [url for url in refused if url.rstrip("/") not in registered]
    if refused:
        raise ServerError(403, "weight_server_not_allowed",
                          f"weight update servers {', '.join(refused)} are not servers of this fleet and not in the "
                          "rollout server's weight-server allowlist; start the server with --weight-server URL "
                          "(repeatable; a URL without a port allows every port of its host) for servers you "
                          "restart on new checkpoints")


async def update_fleet_weights(server: RolloutServer, update: WeightUpdateRequest) -> FleetWeightUpdate:
    """Load ``update.checkpoint`` into every live gateway's servers (see the module docstring)."""
    async with server.weights_lock, _fleet_lock(server):
        await server.recall_fleet()
        if update.servers is not None:
            await check_servers(server, update.servers)
        return await _update(server, update)


#: the store-wide lock of a fleet weight update (server workers sharing a store take turns)
WEIGHTS_LOCK = 7040002


@contextlib.asynccontextmanager
async def _fleet_lock(server: RolloutServer) -> AsyncIterator[None]:
    while True:  # another worker's update holds it: the fleet pauses for one update at a time
        if await server.store.try_lock(WEIGHTS_LOCK):
            break
        await asyncio.sleep(0.2)
    try:
        yield
    finally:
        await server.store.unlock(WEIGHTS_LOCK)


async def _update(server: RolloutServer, update: WeightUpdateRequest) -> FleetWeightUpdate:
    if not await server.reachable():
        raise ServerError(409, "no_gateways", "no live gateway to update")
    started = time.perf_counter()
    wait = update.drain_timeout + FANOUT_TIMEOUT
    phases: dict[str, dict[str, Any]] = {}
    paused = await server.broadcast(lambda c: c.pause(timeout=wait, in_flight=update.in_flight))
    failed, loaded = _failed(paused), {}
    if not failed:
        staged = update.model_copy(update={"resume": False})
        loaded = await server.broadcast(lambda c: c.update_weights(staged, timeout=wait))
        failed = _failed(loaded)
    updated = not failed
    undone: dict[str, Any] = {}
    if failed and loaded:  # the gateways that took the checkpoint go back to what they served before
        took = [gid for gid in loaded if gid not in failed]
        undone = await server.broadcast(lambda c: c.undo_weights(timeout=wait), only=took) if took else {}
    version = update.policy_version if updated else None
    resumed = await server.broadcast(lambda c: c.resume(version, timeout=FANOUT_TIMEOUT))
    for name, answers in (("pause", paused), ("weights", loaded), ("undo", undone), ("resume", resumed)):
        for gid, answer in answers.items():
            phases.setdefault(gid, {})[name] = answer
    if updated:
        server.policy_version = update.policy_version
        if update.servers is not None:  # restarted servers replaced the old ones: they are the backends now
            server.backends[:] = update.servers
        await server.remember_fleet()
        message = ""
    else:
        stage = "load the checkpoint" if loaded else "drain"
        message = (f"{len(failed)} gateway(s) could not {stage}; every gateway resumed under its old version: "
                   + "; ".join(f"{gid}: {_why(answer)}" for gid, answer in failed.items()))
        if _failed(undone):  # their servers may serve the new weights under the old version: no new sessions there
            for gid in _failed(undone):
                await server.drain_anywhere(gid)
            message += ("; these gateways took the new weights and could not load the old ones back, so they are "
                        "drained: " + ", ".join(_failed(undone)))
    if _failed(resumed):
        message += ("; " if message else "") + "these gateways did not resume: " + ", ".join(_failed(resumed))
    return FleetWeightUpdate(updated=updated, checkpoint=update.checkpoint,
                             policy_version=update.policy_version if updated else server.policy_version,
                             message=message, seconds=time.perf_counter() - started, gateways=phases,
                             cut=sum(_cut(answer) for answer in paused.values()))
