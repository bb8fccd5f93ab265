"""Several inference servers behind one engine: least-loaded choice, sticky per session, changed at run time,
and paused around a weight update (requests wait; none fail, none are lost).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from polar_gym.proxy.errors import UpstreamUnavailable

__all__ = ["StagedUpdate", "Upstream", "UpstreamPool"]


@dataclass
class Upstream:
    url: str
    in_flight: int = 0
    assigned: int = 0
    served: int = 0
    failures: int = 0
    removed: bool = False


@dataclass
class StagedUpdate:
    """A weight update loaded but not resumed yet (``resume: false``): what undoing it takes (the rollout server undoes
    it on every gateway that took it when another gateway failed)."""

    checkpoint: str | None  # the pool's checkpoint before it
    restore: dict[str, str | None] = field(default_factory=dict)  # reload: what each server served before
    added: list[str] = field(default_factory=list)  # swap: the servers it put in the pool
    replaced: list[str] = field(default_factory=list)  # swap: the servers it took out


class UpstreamPool:
    """Chooses a server per request. Sticky: a session keeps its server while that server is in the pool, so its
    growing prompt hits the same prefix cache."""

    def __init__(self, urls: list[str] | None = None, *, policy_version: int | str | None = None,
                 wait_for_server_seconds: float = 30.0) -> None:
        self._servers: dict[str, Upstream] = {}
        self._sticky: dict[str, str] = {}
        self._running = asyncio.Event()
        self._running.set()
        self._changed = asyncio.Condition()
        self.policy_version = policy_version
        #: the checkpoint the servers last loaded through a weight update (None: the one they started with)
        self.checkpoint: str | None = None
        #: held by a weight update from pause to resume, so two updates never interleave
        self.weights_lock = asyncio.Lock()
        #: an update loaded while paused and not resumed yet (None once resumed)
        self.staged: StagedUpdate | None = None
        self.wait_for_server_seconds = wait_for_server_seconds
        for url in urls or []:
            self.add(url)

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def servers(self) -> list[Upstream]:
        return list(self._servers.values())

    def add(self, url: str) -> Upstream:
        url = url.rstrip("/")
        server = self._servers.get(url) or Upstream(url)
        server.removed = False
        self._servers[url] = server
        self._notify()
        return server

    def remove(self, url: str) -> bool:
        server = self._servers.pop(url.rstrip("/"), None)
        if server is None:
            return False
        server.removed = True
        self._sticky = {sid: u for sid, u in self._sticky.items() if u != server.url}
        return True

    def clear(self) -> None:
        for url in list(self._servers):
            self.remove(url)

    def forget(self, session_id: str) -> None:
        self._sticky.pop(session_id, None)

    def _notify(self) -> None:
        async def wake() -> None:
            async with self._changed:
                self._changed.notify_all()

        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(wake())

    def _choose(self, session_id: str | None) -> Upstream | None:
        if session_id is not None:
            sticky = self._servers.get(self._sticky.get(session_id, ""))
            if sticky is not None:
                return sticky
        if not self._servers:
            return None
        server = min(self._servers.values(), key=lambda s: (s.in_flight, s.assigned))
        if session_id is not None:
            self._sticky[session_id] = server.url
            server.assigned += 1
        return server

    async def _wait_for_server(self) -> None:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: bool(self._servers)),
                                   self.wait_for_server_seconds)

    @contextlib.asynccontextmanager
    async def lease(self, session_id: str | None = None) -> AsyncIterator[Upstream]:
        """Hold a server for one request; waits while paused or while the pool is empty (bounded)."""
        while True:
            if not self._running.is_set():  # (a coroutine call less per request when running)
                await self._running.wait()
            server = self._choose(session_id)
            if server is not None:
                break
            try:
                await self._wait_for_server()
            except TimeoutError as exc:
                raise UpstreamUnavailable("no inference server is registered with the proxy") from exc
        server.in_flight += 1
        try:
            yield server
            server.served += 1
        except BaseException:
            server.failures += 1
            raise
        finally:
            server.in_flight -= 1
            if self.paused:
                self._notify()

    async def pause(self, drain_timeout: float | None = None) -> None:
        """Stop handing out servers, then wait for in-flight requests to finish (a safe point for new weights)."""
        self._running.clear()
        async with self._changed:
            await asyncio.wait_for(
                self._changed.wait_for(lambda: all(s.in_flight == 0 for s in self._servers.values())),
                drain_timeout,
            )

    def resume(self, policy_version: int | str | None = None) -> None:
        if policy_version is not None:
            self.policy_version = policy_version
        self.staged = None  # committed: nothing left to undo
        self._running.set()
