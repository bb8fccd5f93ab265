"""One weight update of a proxy's engine pool (``POST /admin/weights``): pause, so new model calls wait and in-flight
ones finish; every server of the pool loads the checkpoint (at once: they are separate processes); resume under the
new policy version, which every later completion record carries. Sessions in flight only wait.

In-flight generations of token-in engines are not waited for (``in_flight: cut``, the default): the pause cuts them
(:class:`~polar_gym.proxy.upstreams.Cut`), they keep the tokens sampled so far and continue from them once the pool
resumes, under the new weights; their records say which version sampled which tokens. So an update takes about the
reload time, not the longest generation's. Other calls (chat-mode engines, passthrough) are waited for, as with
``in_flight: wait``.

Engines that cannot reload (or a change a reload cannot make) take servers already restarted on the checkpoint
instead (``servers``): each is checked first, then they replace the pool's servers while it is paused.

A failure resumes the pool under its old version and raises a WeightUpdateError naming each server that failed;
servers that had taken the new weights load their previous checkpoint back (the last update's, else the one they
report they started from), or leave the pool when they cannot, so no completion is stamped with a version its server
does not serve. An engine that cannot load weights is refused before anything pauses.
"""

from __future__ import annotations

import asyncio
import time

from polar_gym.proxy.engines.base import Engine
from polar_gym.proxy.errors import WeightsUnsupported, WeightUpdateError
from polar_gym.proxy.upstreams import StagedUpdate
from polar_gym.schema import WeightUpdateReply, WeightUpdateRequest

__all__ = ["DrainTimeout", "NothingStaged", "undo_staged_update", "update_pool_weights"]


class NothingStaged(WeightUpdateError):
    """An undo with no staged update to undo."""

    status = 409


class DrainTimeout(WeightUpdateError):
    """In-flight model calls did not finish within the update's ``drain_timeout``; nothing was loaded."""

    status = 504


async def update_pool_weights(engine: Engine, request: WeightUpdateRequest) -> WeightUpdateReply:
    """Update every server of ``engine``'s pool to ``request.checkpoint`` (see the module docstring)."""
    mode = engine.weight_updates
    if mode is None and request.servers is None:
        raise WeightsUnsupported(f"the {engine.name} engine cannot load new weights (its servers are not ours to "
                                 "change): restart them on the checkpoint and pass their URLs as the update's "
                                 "servers")
    pool = engine.pool
    async with pool.weights_lock:
        previous = pool.policy_version
        started = time.perf_counter()
        if request.servers is not None:  # checked before anything pauses: a dead server costs sessions nothing
            await _check_servers(engine, request.servers)
        try:
            cut = await pool.pause(request.drain_timeout, request.in_flight)
        except TimeoutError as exc:
            pool.resume()
            busy = {s.url: s.in_flight for s in pool.servers() if s.in_flight}
            raise DrainTimeout(f"in-flight model calls did not finish within {request.drain_timeout:g} s "
                               f"({busy}); nothing was loaded, the pool goes on under version {previous!r}") from exc
        drained = time.perf_counter()
        if request.servers is not None:
            reply = _swap(engine, request, previous, started, drained)
            reply.cut = cut
            return reply
        servers = [s.url for s in pool.servers()] if mode == "reload" else []
        try:
            # what each server serves now, to load back if the update fails half way
            restore = {url: pool.checkpoint or await engine.started_checkpoint(url) for url in servers}
            outcomes = await asyncio.gather(
                *(engine.update_weights(url, request.checkpoint, request.policy_version) for url in servers),
                return_exceptions=True)
        except BaseException:
            pool.resume()
            raise
        failed = {url: out for url, out in zip(servers, outcomes, strict=True) if isinstance(out, BaseException)}
        if failed:
            took = [url for url in servers  # every server whose weights changed, also one that failed after that
                    if url not in failed or getattr(failed[url], "weights_changed", False)]
            restored, dropped = await _roll_back(engine, took, restore, previous)
            pool.resume()
            errors = "; ".join(f"{url}: {getattr(exc, 'message', None) or repr(exc)}" for url, exc in failed.items())
            raise WeightUpdateError(
                f"weight update to {request.checkpoint} failed on {len(failed)} of {len(servers)} server(s): {errors}. "
                f"The pool resumed under version {previous!r}"
                + (f"; back on their previous weights: {', '.join(restored)}" if restored else "")
                + (f"; taken out of the pool (they serve the new weights and could not load the old ones back): "
                   f"{', '.join(dropped)}" if dropped else ""))
        reply = _commit(engine, request, StagedUpdate(pool.checkpoint, restore=restore), previous, started, drained,
                        {url: out for url, out in zip(servers, outcomes, strict=True) if isinstance(out, dict)})
        reply.cut = cut
        return reply


def _commit(engine: Engine, request: WeightUpdateRequest, undo: StagedUpdate, previous: int | str | None,
            started: float, drained: float, servers: dict[str, dict[str, float]]) -> WeightUpdateReply:
    """The servers serve the checkpoint: resume under its version, or stay paused with what undoing it takes."""
    pool = engine.pool
    pool.checkpoint = request.checkpoint
    if request.resume:
        pool.resume(request.policy_version)
    else:
        pool.staged = undo
    updated = time.perf_counter()
    return WeightUpdateReply(
        checkpoint=request.checkpoint, policy_version=pool.policy_version, previous_version=previous,
        paused=pool.paused, drained_seconds=drained - started, update_seconds=updated - drained,
        total_seconds=updated - started, servers=servers, replaced=undo.replaced)


async def undo_staged_update(engine: Engine) -> WeightUpdateReply:
    """Undo an update loaded with ``resume: false`` (``POST /admin/weights/undo``: the rollout server's answer to
    another gateway failing): servers load their previous checkpoint back (or leave the pool when they cannot), a
    swap puts the old servers back, and the pool resumes under its old version."""
    pool = engine.pool
    staged = pool.staged
    if staged is None or not pool.paused:
        raise NothingStaged("no weight update is staged (loaded with resume: false and not resumed) on this pool")
    async with pool.weights_lock:
        started = time.perf_counter()
        dropped: list[str] = []
        if staged.restore:
            _, dropped = await _roll_back(engine, list(staged.restore), staged.restore, pool.policy_version)
        for url in staged.replaced:
            pool.add(url)
        for url in staged.added:
            pool.remove(url)
        pool.checkpoint = staged.checkpoint
        pool.resume()
        return WeightUpdateReply(checkpoint=staged.checkpoint or "", policy_version=pool.policy_version,
                                 previous_version=pool.policy_version, total_seconds=time.perf_counter() - started,
                                 replaced=dropped + staged.added)


async def _roll_back(engine: Engine, took: list[str], restore: dict[str, str | None],
                     version: int | str | None) -> tuple[list[str], list[str]]:
    """Servers that took the new weights in an update that failed elsewhere load their previous checkpoint back, so
    every server of the pool serves what its version says; one that cannot leaves the pool. (restored, dropped)"""
    async def back(url: str) -> bool:
        checkpoint = restore.get(url)
        if checkpoint is None:
            return False
        try:
            await engine.update_weights(url, checkpoint, "unknown" if version is None else version)
        except Exception:
            return False
        return True

    outcomes = await asyncio.gather(*(back(url) for url in took))
    dropped = [url for url, ok in zip(took, outcomes, strict=True) if not ok]
    for url in dropped:
        engine.pool.remove(url)
    return [url for url in took if url not in dropped], dropped


async def _check_servers(engine: Engine, urls: list[str]) -> None:
    outcomes = await asyncio.gather(*(engine.check_server(url) for url in urls), return_exceptions=True)
    failed = {url: out for url, out in zip(urls, outcomes, strict=True) if isinstance(out, BaseException)}
    for out in failed.values():
        if not isinstance(out, Exception) or isinstance(out, WeightsUnsupported):
            raise out
    if failed:
        raise WeightUpdateError(f"{len(failed)} of {len(urls)} new server(s) cannot serve: "
                                + "; ".join(f"{getattr(exc, 'message', None) or exc!r}" for exc in failed.values())
                                + ". Nothing was changed")


def _swap(engine: Engine, request: WeightUpdateRequest, previous: int | str | None, started: float,
          drained: float) -> WeightUpdateReply:
    """The pool (paused, drained) takes ``request.servers``, already serving the checkpoint, in place of its own."""
    pool = engine.pool
    assert request.servers is not None
    before = [s.url for s in pool.servers()]
    replaced = [url for url in before if url not in request.servers]
    replaced_before = set(before)
    for url in request.servers:
        pool.add(url)
    for url in replaced:
        pool.remove(url)
    undo = StagedUpdate(pool.checkpoint, added=[u for u in request.servers if u not in replaced_before],
                        replaced=replaced)
    return _commit(engine, request, undo, previous, started, drained, {url: {} for url in request.servers})
