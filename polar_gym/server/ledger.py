"""Where a session's state changes are recorded, whoever made them (dispatch, a watcher, a cancel, a restart): the
store first, then the task's subscribers, the dispatch loop (a slot or a session to place) and, once a task's last
session ended, its callback. Also the re-queue rule for a session its gateway lost."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from polar_gym.causes import UNSTORABLE_RESULT
from polar_gym.httpguard import excerpt
from polar_gym.result_codec import PackedResult
from polar_gym.schema import SessionResult, SessionStatus
from polar_gym.server.callbacks import Callbacks
from polar_gym.server.counters import ServerCounters
from polar_gym.server.fleet import GatewayState
from polar_gym.server.store import SessionRow, Store

__all__ = ["Ledger", "ended_as"]

log = logging.getLogger(__name__)
S = SessionStatus


class Ledger:
    def __init__(self, store: Store, counters: ServerCounters, callbacks: Callbacks, *, max_attempts: int) -> None:
        self.store, self.counters, self.callbacks, self.max_attempts = store, counters, callbacks, max_attempts
        #: set when a session may be dispatched (submitted, re-queued, a slot freed, a gateway came)
        self.wake = asyncio.Event()
        self._changed = asyncio.Condition()
        self._subscribers: dict[str, set[asyncio.Queue[dict[str, Any]]]] = collections.defaultdict(set)

    # -- who hears about changes -----------------------------------------------------------------------------

    async def notify(self, task_id: str, event: dict[str, Any]) -> None:
        for queue in self._subscribers.get(task_id, ()):
            queue.put_nowait({"task_id": task_id, "time": time.time(), **event})
        async with self._changed:
            self._changed.notify_all()

    @contextlib.contextmanager
    def subscribe(self, task_id: str) -> Iterator[asyncio.Queue[dict[str, Any]]]:
        """A queue of the task's events while the block runs."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._subscribers[task_id].add(queue)
        try:
            yield queue
        finally:
            self._subscribers[task_id].discard(queue)
            if not self._subscribers[task_id]:
                del self._subscribers[task_id]

    async def changed(self, timeout: float) -> None:
        """Return after the next change, or after ``timeout`` seconds."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)

    # -- the changes -----------------------------------------------------------------------------------------

    async def status(self, session_id: str, status: SessionStatus) -> None:
        """A gateway reported a new, not final, status."""
        await self.store.set_status(session_id, status)
        row = await self.store.session(session_id)
        if row is not None:
            await self.notify(row.task_id, {"event": "status", "session_id": session_id, "status": status.value})

    async def finish(self, result: SessionResult | PackedResult, gw: GatewayState | None) -> None:
        """A final result; the first one stored stays. A result the store cannot take (it does not serialize, the
        write fails) is set aside once: the session ends ERROR with cause unstorable_result, never retried."""
        if gw is not None:
            gw.sessions.discard(result.session_id)
        try:
            stored = await self.store.finish(result)
        except Exception as exc:
            self.counters.errors["result_unstorable"] += 1
            reason = (f"{UNSTORABLE_RESULT}: the result could not be stored ({type(exc).__name__}: "
                      f"{excerpt(str(exc), 200)})")
            log.error("session %s of task %s ends ERROR, its result set aside: %s", result.session_id,
                      result.task_id, reason)
            result = SessionResult(session_id=result.session_id, task_id=result.task_id, status=S.ERROR,
                                   reason=reason)
            stored = await self.store.finish(result)
        if stored:  # False: it had already ended
            await self.ended(result.task_id, result.session_id, result.status, result.reason)

    async def ended(self, task_id: str, session_id: str, status: SessionStatus, reason: str | None) -> None:
        """A session reached its final state (a result, or quarantined): tell subscribers, call back when the
        task is done."""
        await self.notify(task_id, {"event": "finished", "session_id": session_id, "status": status.value,
                                    "reason": reason})
        self.wake.set()
        if await self.store.unfinished(task_id) == 0:
            await self.callbacks.task_done(task_id)

    async def lost(self, row: SessionRow, why: str) -> None:
        """Re-queue a session whose gateway lost it, or fail it with the reason after max_attempts; a session of a
        cancelled task (its gateway left before it confirmed the cancel) ends CANCELLED."""
        task = await self.store.task(row.task_id)
        if task is not None and task.cancelled:
            await self.finish(ended_as(row, S.CANCELLED, f"cancelled through the rollout server ({why})"), None)
            return
        if row.attempts >= self.max_attempts:
            await self.finish(ended_as(row, S.ERROR, f"{why}; gave up after {row.attempts} attempts"), None)
            return
        self.counters.redispatched += 1
        await self.store.requeue(row.session_id, why)
        await self.notify(row.task_id, {"event": "requeued", "session_id": row.session_id, "reason": why})
        self.wake.set()


def ended_as(row: SessionRow, status: SessionStatus, reason: str) -> SessionResult:
    """The result the server records for a session no gateway finished."""
    return SessionResult(session_id=row.session_id, task_id=row.task_id, status=status, reason=reason)
