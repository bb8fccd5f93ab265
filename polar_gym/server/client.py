"""Trainer-side helpers for any trainer: submit tasks to the rollout server, iterate session results (and their
token-faithful traces) as they finish, or receive them by callback (polar_gym.server.receiver: a tiny receiver that
takes only deliveries signed with its secret and drops repeats by idempotency key; the server delivers at least
once, so repeats are expected).

    async with RolloutClient(url, token) as client:
        await client.submit_all(tasks)
        async for result in client.results([t.task_id for t in tasks]):
            for trace in traces_of(result):
                train_on(trace.prompt_ids, trace.response_ids, trace.loss_mask, trace.response_logprobs, trace.reward)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, Literal

import httpx

from polar_gym.keepalive import client_limits
from polar_gym.result_codec import read_frame, unpack
from polar_gym.schema import FleetWeightUpdate, SessionResult, SessionStatus, TaskRequest, Trace, WeightUpdateRequest
from polar_gym.server.receiver import CallbackEvicted, CallbackReceiver

__all__ = ["CallbackEvicted", "CallbackReceiver", "RolloutClient", "WeightUpdateFailed", "traces_of", "unpack_all"]

_DONE = {"COMPLETED", "ERROR", "CANCELLED", "TIMEOUT"}


class WeightUpdateFailed(RuntimeError):
    """A fleet weight update did not reach every gateway; ``reply`` holds each gateway's answers (the fleet went on
    under its old version)."""

    def __init__(self, reply: FleetWeightUpdate) -> None:
        super().__init__(reply.message or "the weight update failed")
        self.reply = reply


class RolloutClient:
    """An async client of the rollout server API (only the calls a trainer needs)."""

    def __init__(self, url: str, admin_token: str, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.http = httpx.AsyncClient(base_url=url.rstrip("/"), headers={"x-admin-token": admin_token},
                                      transport=transport, timeout=httpx.Timeout(60.0, connect=10.0),
                                      limits=client_limits())

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

    async def release(self, task_id: str) -> dict[str, Any]:
        """POST /tasks/{id}/release: this trainer has the finished task's results; the server may let them go."""
        resp = await self.http.post(f"/tasks/{task_id}/release")
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

    async def drain_gateway(self, gateway_id: str, *, withdraw: bool = False) -> dict[str, Any]:
        """No new session goes to this gateway; the ones it runs finish there. With ``withdraw``, the ones it has
        not started running come back to the queue (their attempt refunded)."""
        resp = await self.http.post(f"/gateways/{gateway_id}/drain", json={"withdraw": withdraw})
        resp.raise_for_status()
        return dict(resp.json())

    async def update_weights(self, checkpoint: str, policy_version: int | str, *, drain_timeout: float = 600.0,
                             servers: list[str] | None = None,
                             in_flight: Literal["cut", "wait"] = "cut") -> FleetWeightUpdate:
        """Load ``checkpoint`` (a directory the inference servers can read) into every engine of the fleet and stamp
        ``policy_version`` on every later completion; sessions only wait. In-flight generations of token-in engines
        are cut and continue from their tokens under the new weights (``in_flight="wait"``: they finish first, as
        other calls always do, up to ``drain_timeout``). ``servers``: inference servers you restarted on
        ``checkpoint`` (engines that cannot reload): they replace the fleet's backends instead. Raises
        WeightUpdateFailed when a gateway did not take it."""
        body = WeightUpdateRequest(checkpoint=checkpoint, policy_version=policy_version, drain_timeout=drain_timeout,
                                   servers=servers, in_flight=in_flight)
        resp = await self.http.post("/backends/weights", content=body.model_dump_json(),
                                    headers={"content-type": "application/json"}, timeout=drain_timeout + 300.0)
        resp.raise_for_status()
        reply = FleetWeightUpdate.model_validate_json(resp.content)
        if not reply.updated:
            raise WeightUpdateFailed(reply)
        return reply

    async def submit_all(self, tasks: Iterable[TaskRequest]) -> list[dict[str, Any]]:
        return [await self.submit(task) for task in tasks]

    async def results(self, task_ids: Iterable[str], *, timeout: float = 3600.0,
                      poll: float = 0.5, release: bool = True) -> AsyncIterator[SessionResult]:
        """Every session's SessionResult as it finishes (each once), across ``task_ids``, until all ended. Results
        come packed from GET /tasks/{id}/results, each once (a cursor), and are decoded here in a worker thread.
        With ``release``, a task whose results were all yielded is released (POST /tasks/{id}/release: the
        server applies its result retention; nothing under the default ``keep``)."""
        pending = list(dict.fromkeys(task_ids))
        cursors: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while pending:
            for task_id in list(pending):
                meta, results = await self.packed_results(task_id, cursors.get(task_id))
                for result in await asyncio.to_thread(unpack_all, results):
                    yield result
                if meta.get("cursor"):
                    finished, session_id = meta["cursor"]
                    cursors[task_id] = {"after": finished, "after_session": session_id}
                if meta["status"] in _DONE:
                    pending.remove(task_id)
                    if release:
                        await self.release(task_id)
            if pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tasks {pending} not finished after {timeout} s")
                await asyncio.sleep(poll)

    async def packed_results(self, task_id: str, cursor: dict[str, Any] | None = None
                             ) -> tuple[dict[str, Any], list[bytes]]:
        """GET /tasks/{id}/results: the task view (with ``cursor``) and its finished results past ``cursor``,
        packed (polar_gym.result_codec.unpack decodes one)."""
        resp = await self.http.get(f"/tasks/{task_id}/results", params=cursor or {})
        resp.raise_for_status()
        return read_frame(resp.content)

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


def unpack_all(blobs: list[bytes]) -> list[SessionResult]:
    """Packed results decoded (a trainer runs this in a worker thread: a 30k-token result takes tens of ms)."""
    return [unpack(blob) for blob in blobs]


def traces_of(result: SessionResult, *, completed_only: bool = True) -> list[Trace]:
    """The traces a trainer should learn from: those of a COMPLETED session (others are partial; a trainer that
    wants them masked uses the Slime or NeMo exports, which keep them with a zero loss mask)."""
    if result.trajectory is None or (completed_only and result.status is not SessionStatus.COMPLETED):
        return []
    return list(result.trajectory.traces)
