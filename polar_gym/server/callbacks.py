"""Callback delivery: once every session of a task ended, POST the task view to its ``callback_url`` until a 2xx,
with exponential backoff, then give up and record why. The store records the claim and the outcome, so a restarted
server delivers what was pending (at least once; the idempotency key lets the receiver drop repeats). A task with a
``callback_secret`` gets each attempt signed afresh (polar_gym.server.signing); the secret is never logged. Once
delivered, the server's result retention applies (``ResultRetention``): a long run's store then grows by heads,
not by trajectories."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal

import httpx
import orjson

from polar_gym.result_codec import MEDIA_TYPE
from polar_gym.server.background import Background
from polar_gym.server.counters import ServerCounters
from polar_gym.server.signing import sign
from polar_gym.server.store import Store
from polar_gym.server.tasks import packed_task_view, task_view

__all__ = ["Callbacks", "ResultRetention"]

#: what the server keeps of a task's results once its callback was delivered: everything (``keep``), all but the
#: trajectories (``compact``: status, reward, timings, metadata), or only status, reason and reward (``drop``)
ResultRetention = Literal["keep", "compact", "drop"]


class Callbacks:
    def __init__(self, store: Store, counters: ServerCounters, background: Background,
                 http: Callable[[], httpx.AsyncClient], *, attempts: int = 8, backoff: float = 0.5,
                 retention: ResultRetention = "keep") -> None:
        self.store, self.counters, self.background, self.http = store, counters, background, http
        self.attempts, self.backoff = attempts, backoff
        self.retention = retention

    async def task_done(self, task_id: str) -> None:
        """Every session of the task ended: deliver its callback, if it has one and nobody claimed it yet."""
        task = await self.store.task(task_id)
        if task is not None and task.request.callback_url and await self.store.claim_callback(task_id):
            self.background.spawn(self.deliver(task_id))

    async def resume(self) -> None:
        """After a restart: deliver the callbacks claimed and not delivered."""
        for task_id in await self.store.pending_callbacks():
            self.background.spawn(self.deliver(task_id))

    async def deliver(self, task_id: str) -> None:
        """POST the finished task to its callback_url until a 2xx, with exponential backoff; the idempotency key
        lets the receiver drop repeats (delivery is at least once)."""
        task = await self.store.task(task_id)
        if task is None or not task.request.callback_url:
            return
        if task.request.callback_format == "packed":
            body, content_type = await packed_task_view(self.store, task_id), MEDIA_TYPE
        else:
            body = await asyncio.to_thread(orjson.dumps, await task_view(self.store, task_id))
            content_type = "application/json"
        key, secret = f"polar-task-{task_id}", task.request.callback_secret
        error = "no attempt made"
        for attempt in range(self.attempts):
            headers = {"idempotency-key": key, "content-type": content_type}
            if secret is not None:  # signed at each attempt: a retry after a long backoff is not stale
                headers |= await asyncio.to_thread(sign, secret, key, body)
            try:
                resp = await self.http().post(task.request.callback_url, content=body, headers=headers)
                if 200 <= resp.status_code < 300:
                    self.counters.callbacks["delivered"] += 1
                    await self.store.set_callback(task_id, "delivered")
                    if self.retention != "keep":  # the trainer has the results: keep what the config says
                        await self.store.retain(task_id, self.retention)
                    return
                error = f"HTTP {resp.status_code}: {resp.text[:200]}"
            except httpx.HTTPError as exc:
                error = repr(exc)
            self.counters.callbacks["retried"] += 1
            self.counters.errors["callback_failed"] += 1
            await asyncio.sleep(self.backoff * 2**attempt)
        self.counters.callbacks["failed"] += 1
        await self.store.set_callback(task_id, "failed", error)
