"""Trainer-side helpers: submit tasks to the rollout server and wait for them, and a tiny callback receiver that
drops repeated deliveries by idempotency key (the server delivers at least once, so repeats are expected)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from polar_gym.schema import TaskRequest

__all__ = ["CallbackReceiver", "RolloutClient"]

_DONE = {"COMPLETED", "ERROR", "CANCELLED", "TIMEOUT"}


class RolloutClient:
    """An async client of the rollout server API (only the calls a trainer needs)."""

    def __init__(self, url: str, admin_token: str, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.http = httpx.AsyncClient(base_url=url.rstrip("/"), headers={"x-admin-token": admin_token},
                                      transport=transport, timeout=httpx.Timeout(60.0, connect=10.0))

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def submit(self, task: TaskRequest) -> dict[str, Any]:
        resp = await self.http.post("/tasks", content=task.model_dump_json(),
                                    headers={"content-type": "application/json"})
        resp.raise_for_status()
        return dict(resp.json())

    async def status(self, task_id: str) -> dict[str, Any]:
        resp = await self.http.get(f"/tasks/{task_id}")
        resp.raise_for_status()
        return dict(resp.json())

    async def cancel(self, task_id: str) -> dict[str, Any]:
        resp = await self.http.post(f"/tasks/{task_id}/cancel")
        resp.raise_for_status()
        return dict(resp.json())

    async def gateways(self) -> list[dict[str, Any]]:
        """The registered gateways with their state, load and last heartbeat's health."""
        resp = await self.http.get("/gateways")
        resp.raise_for_status()
        return list(resp.json()["gateways"])

    async def wait(self, task_id: str, timeout: float = 3600.0, poll: float = 0.5) -> dict[str, Any]:
        """Poll until every session of the task ended; TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            view = await self.status(task_id)
            if view["status"] in _DONE:
                return view
            if time.monotonic() > deadline:
                raise TimeoutError(f"task {task_id} not finished after {timeout} s: {view['aggregate']}")
            await asyncio.sleep(poll)


class CallbackReceiver:
    """A FastAPI app receiving task callbacks: each idempotency key is handed to ``on_task`` once; repeats are
    acknowledged (200) and dropped. ``received`` keeps the first body per key; ``deliveries`` counts every POST."""

    def __init__(self, on_task: Callable[[dict[str, Any]], Awaitable[None] | None] | None = None) -> None:
        self.on_task = on_task
        self.received: dict[str, dict[str, Any]] = {}
        self.deliveries = 0
        self.arrived = asyncio.Event()
        self.app = FastAPI(title="polar_gym callback receiver")
        self.app.post("/callback")(self._receive)

    async def _receive(self, request: Request) -> JSONResponse:
        self.deliveries += 1
        key = request.headers.get("idempotency-key")
        if not key:
            return JSONResponse({"error": "missing idempotency-key header"}, status_code=400)
        if key in self.received:
            return JSONResponse({"duplicate": True, "key": key})
        body = await request.json()
        if self.on_task is not None:
            out = self.on_task(body)
            if isinstance(out, Awaitable):
                await out
        self.received[key] = body  # recorded only once handled: a failing handler gets the retry
        self.arrived.set()
        return JSONResponse({"duplicate": False, "key": key})
