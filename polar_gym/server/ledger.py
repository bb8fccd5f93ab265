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

import orjson

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
    def __init__(self, store: Store, counters: ServerCounters, callbacks: Callbacks, *, max_attempts: int,
                 worker: str = "main") -> None:
        self.store, self.counters, self.callbacks, self.max_attempts = store, counters, callbacks, max_attempts
        self.worker = worker
        #: set when a session may be dispatched (submitted, re-queued, a slot freed, a gateway came)
        self.wake = asyncio.Event()
        #: set (and replaced) at each change: what result waits wake on
        self._changed = asyncio.Event()
        self._subscribers: dict[str, set[asyncio.Queue[dict[str, Any]]]] = collections.defaultdict(set)

    # -- who hears about changes -----------------------------------------------------------------------------

    async def notify(self, task_id: str, event: dict[str, Any]) -> None:
        """Tell this worker's subscribers and result waits, and the other workers sharing the store."""
        stamped = {"task_id": task_id, "time": time.time(), **event}
        self._deliver(stamped)
        if self.store.shared:
            await self.store.publish(_payload(self.worker, stamped))

    def heard(self, payload: str) -> None:
        """A change another worker made (polar_gym.server.sql's channel): its events reach this worker's
        subscribers, and a session it queued may be this worker's to dispatch."""
        try:
            note = orjson.loads(payload)
            if note["worker"] == self.worker:
                return
            event = note["event"]
            if not isinstance(event, dict) or not isinstance(event.get("task_id"), str):
                raise ValueError("no event")
        except (ValueError, KeyError, TypeError):
            self.counters.errors["change_unreadable"] += 1
            return
        self._deliver(event)
        if event.get("event") in _QUEUED:
            self.wake.set()

    def _deliver(self, event: dict[str, Any]) -> None:
        for queue in self._subscribers.get(event["task_id"], ()):
            queue.put_nowait(event)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

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
        """Return after the next change, or after ``timeout`` seconds (at most a second with other workers: a
        change they made reaches this one by a notification, which a lost connection to the store can miss)."""
        if self.store.shared:
            timeout = min(timeout, 1.0)
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

    async def lost(self, row: SessionRow, why: str, gateway_id: str | None = None, given_up: bool = False) -> None:
        """Re-queue a session whose gateway (``gateway_id``, else the row's) lost it, or fail it with the reason
        after max_attempts; a session of a cancelled task (its gateway left before it confirmed the cancel) ends
        CANCELLED. Nothing happens to a session the store no longer has on that gateway: another server worker
        queued it and handed it on meanwhile, and ending or queueing it here would run it twice. ``given_up``: the
        gateway may still hold its attempt (Store.requeue)."""
        on = gateway_id or row.gateway_id
        if on is not None:
            current = await self.store.session(row.session_id)
            if current is None or current.status.terminal or current.gateway_id != on:
                return
        task = await self.store.task(row.task_id)
        if task is not None and task.cancelled:
            await self.finish(ended_as(row, S.CANCELLED, f"cancelled through the rollout server ({why})"), None)
            return
        if row.attempts >= self.max_attempts:
            await self.finish(ended_as(row, S.ERROR, f"{why}; gave up after {row.attempts} attempts"), None)
            return
        if not await self.store.requeue(row.session_id, why, on, given_up):
            return
        self.counters.redispatched += 1
        await self.notify(row.task_id, {"event": "requeued", "session_id": row.session_id, "reason": why})
        self.wake.set()


#: another worker's events after which this one may have sessions to dispatch (the others do not change its queue:
#: waking its dispatch on each of them cost a round of queries per event)
_QUEUED = frozenset({"submitted", "requeued"})
#: PostgreSQL's NOTIFY takes at most 8,000 bytes: a larger event goes without its session list, its reason cut
_MAX_PAYLOAD = 7000


def _payload(worker: str, event: dict[str, Any]) -> str:
    """An event as the other workers hear it."""
    data = orjson.dumps({"worker": worker, "event": event})
    if len(data) > _MAX_PAYLOAD:
        slim = {k: v for k, v in event.items() if k != "sessions"}
        if isinstance(slim.get("reason"), str):
            slim["reason"] = excerpt(slim["reason"], 1000)
        data = orjson.dumps({"worker": worker, "event": slim})
    return data.decode()


def ended_as(row: SessionRow, status: SessionStatus, reason: str) -> SessionResult:
    """The result the server records for a session no gateway finished."""
    return SessionResult(session_id=row.session_id, task_id=row.task_id, status=status, reason=reason)
