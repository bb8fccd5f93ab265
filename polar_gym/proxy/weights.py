"""One weight update of a proxy's engine pool (``POST /admin/weights``): pause, so new model calls wait and in-flight
ones finish; every server of the pool loads the checkpoint (at once: they are separate processes); resume under the
new policy version, which every later completion record carries. Sessions in flight only wait.

A failure resumes the pool under its old version and raises a WeightUpdateError naming each server that failed and
each that did take the new weights (those now serve them under the old version: the caller retries or replaces
them). An engine that cannot load weights is refused before anything pauses.
"""

from __future__ import annotations

import asyncio
import time

from polar_gym.proxy.engines.base import Engine
from polar_gym.proxy.errors import WeightsUnsupported, WeightUpdateError
from polar_gym.schema import WeightUpdateReply, WeightUpdateRequest

__all__ = ["DrainTimeout", "update_pool_weights"]


class DrainTimeout(WeightUpdateError):
    """In-flight model calls did not finish within the update's ``drain_timeout``; nothing was loaded."""

    status = 504


async def update_pool_weights(engine: Engine, request: WeightUpdateRequest) -> WeightUpdateReply:
    """Update every server of ``engine``'s pool to ``request.checkpoint`` (see the module docstring)."""
    mode = engine.weight_updates
    if mode is None:
        raise WeightsUnsupported(f"the {engine.name} engine cannot load new weights (its servers are not ours to "
                                 "change); restart it on the new checkpoint instead")
    pool = engine.pool
    async with pool.weights_lock:
        previous = pool.policy_version
        started = time.perf_counter()
        try:
            await pool.pause(request.drain_timeout)
        except TimeoutError as exc:
            pool.resume()
            busy = {s.url: s.in_flight for s in pool.servers() if s.in_flight}
            raise DrainTimeout(f"in-flight model calls did not finish within {request.drain_timeout:g} s "
                               f"({busy}); nothing was loaded, the pool goes on under version {previous!r}") from exc
        drained = time.perf_counter()
        servers = [s.url for s in pool.servers()] if mode == "reload" else []
        try:
            outcomes = await asyncio.gather(
                *(engine.update_weights(url, request.checkpoint, request.policy_version) for url in servers),
                return_exceptions=True)
        except BaseException:
            pool.resume()
            raise
        failed = {url: out for url, out in zip(servers, outcomes, strict=True) if isinstance(out, BaseException)}
        if failed:
            pool.resume()
            took = [url for url in servers if url not in failed]
            errors = "; ".join(f"{url}: {getattr(exc, 'message', None) or repr(exc)}" for url, exc in failed.items())
            raise WeightUpdateError(f"weight update to {request.checkpoint} failed on {len(failed)} of {len(servers)} "
                                    f"server(s): {errors}. The pool resumed under version {previous!r}"
                                    + (f"; these took the new weights: {', '.join(took)}" if took else ""))
        pool.checkpoint = request.checkpoint
        if request.resume:
            pool.resume(request.policy_version)
        updated = time.perf_counter()
        return WeightUpdateReply(
            checkpoint=request.checkpoint, policy_version=pool.policy_version, previous_version=previous,
            paused=pool.paused, drained_seconds=drained - started, update_seconds=updated - drained,
            total_seconds=updated - started,
            servers={url: out for url, out in zip(servers, outcomes, strict=True) if isinstance(out, dict)})
