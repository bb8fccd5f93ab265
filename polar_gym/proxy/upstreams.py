"""Several inference servers behind one engine: least-loaded choice, sticky per session, changed at run time,
and paused around a weight update (requests wait; none fail, none are lost).

A pause drains the pool: new calls wait, in-flight ones finish, or, when the pause says ``cut`` and a call holds a
:class:`Cut` (token-in engines: they can continue a generation from its tokens), the call is cut: its upstream read
is cancelled (the stream closes; vLLM and SGLang abort a request whose client hung up) and it waits for the resume
with the tokens it had, then continues under the new weights. Only the read is cancelled, never the caller: the
engine catches it (:meth:`Cut.reading`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from polar_gym.proxy.errors import UpstreamUnavailable

#: what a pause does with in-flight calls: cut those that can continue from their tokens, or wait for all
InFlight = Literal["cut", "wait"]
_CUT = "cut by a weight update"

__all__ = ["Cut", "InFlight", "StagedUpdate", "Upstream", "UpstreamPool"]


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


class Cut:
    """A cuttable call's handle: the pool sets ``requested`` at a cutting pause and cancels ``task``, which the
    engine sets only while it awaits the upstream (so the cancel lands on that read and nowhere else: between reads
    the engine checks ``requested``); the engine sets ``done`` when it cut (a call that had just finished is not
    counted)."""

    __slots__ = ("done", "requested", "task")

    def __init__(self) -> None:
        self.requested = False
        self.done = False
        self.task: asyncio.Task[Any] | None = None

    def request(self) -> None:
        if self.requested:
            return
        self.requested = True
        if self.task is not None:
            self.task.cancel(_CUT)

    def cancelled_by_cut(self) -> bool:
        """Called on a CancelledError from the upstream read: True (and the task's cancel undone) when it was the
        cut's alone; False when someone else cancelled the task too (re-raise)."""
        task = asyncio.current_task()
        if not self.requested or task is None:
            return False
        return task.uncancel() == 0


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
        #: in-flight calls a pause may cut (token-in generations)
        self._cuttable: set[Cut] = set()
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
    async def lease(self, session_id: str | None = None, cut: Cut | None = None) -> AsyncIterator[Upstream]:
        """Hold a server for one request; waits while paused or while the pool is empty (bounded). With ``cut``, a
        cutting pause may cut the request (see the module docstring)."""
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
        if cut is not None:
            self._cuttable.add(cut)
        try:
            yield server
            server.served += 1
        except BaseException:
            server.failures += 1
            raise
        finally:
            server.in_flight -= 1
            if cut is not None:
                self._cuttable.discard(cut)
            if self.paused:
                self._notify()

    async def pause(self, drain_timeout: float | None = None, in_flight: InFlight = "wait") -> int:
        """Stop handing out servers, then wait for in-flight requests to finish, or with ``in_flight="cut"`` cut
        those that can continue later (a safe point for new weights either way). Answers how many were cut."""
        self._running.clear()
        cuts = list(self._cuttable) if in_flight == "cut" else []
        for cut in cuts:
            cut.request()
        async with self._changed:
            await asyncio.wait_for(
                self._changed.wait_for(lambda: all(s.in_flight == 0 for s in self._servers.values())),
                drain_timeout,
            )
        return sum(1 for cut in cuts if cut.done)

    def hold(self) -> None:
        """Model calls wait from now until the next :meth:`resume` (a weight update's): a resumed training run's
        fleet samples nothing before the trainer has pushed the weights it resumes from."""
        self._running.clear()

    def resume(self, policy_version: int | str | None = None) -> None:
        if policy_version is not None:
            self.policy_version = policy_version
        self.staged = None  # committed: nothing left to undo
        self._running.set()
