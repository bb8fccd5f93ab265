"""The rollout server's API as routers, one per concern (vLLM entrypoints style: routes read the RolloutServer
from ``app.state``). Routes are thin: parse, call the RolloutServer, answer; its ServerError and every refusal
answer in the polar_gym.web envelope. Everything but ``health_router`` needs the admin token.

    tasks_router     POST /tasks (201 created, 200 when the task_id exists), GET /tasks, GET /tasks/{id},
                     GET /tasks/{id}/results (packed, ``?after=F&after_session=ID``: those past a cursor),
                     POST /tasks/{id}/release (apply the result retention), POST /tasks/{id}/cancel,
                     GET /tasks/{id}/events (server-sent events of status changes)
    sessions_router  GET /sessions/{id}/result (202 while running; ``?wait=S`` long-polls; ``?format=atif``: as one
                     ATIF trajectory, polar_gym.merge.atif),
                     GET /sessions/{id}/nemo (NeMo Gym token items per chain), POST /sessions/{id}/cancel
    gateways_router  POST /gateways/register, GET /gateways, POST /gateways/{id}/heartbeat, POST /gateways/{id}/drain
    backends_router  GET/POST/DELETE /backends, POST /backends/pause, /backends/resume: forwarded to every gateway;
                     POST /backends/weights: every gateway loads a checkpoint (polar_gym.server.weights)
    health_router    GET /health, GET /metrics (Prometheus text)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from polar_gym.harness import PINS
from polar_gym.httpguard import MAX_JSON_DEPTH, check_upstream_url, excerpt, json_depth
from polar_gym.merge.atif import atif_json
from polar_gym.merge.nemo_payload import session_nemo_payload
from polar_gym.prometheus import PROMETHEUS_CONTENT_TYPE
from polar_gym.result_codec import MEDIA_TYPE
from polar_gym.schema import FleetWeightUpdate, GatewayDrainRequest, TaskRequest, WeightUpdateRequest
from polar_gym.server.core import RolloutServer
from polar_gym.server.fleet import GatewayRegistration
from polar_gym.server.metrics import server_metrics
from polar_gym.server.tasks import packed_task_view
from polar_gym.server.weights import update_fleet_weights
from polar_gym.web import ADMIN_ONLY, ApiError

__all__ = ["Backend", "Resume", "backends_router", "gateways_router", "health_router", "rollout_server",
           "sessions_router", "tasks_router"]

tasks_router = APIRouter(dependencies=ADMIN_ONLY)
sessions_router = APIRouter(dependencies=ADMIN_ONLY)
gateways_router = APIRouter(dependencies=ADMIN_ONLY)
backends_router = APIRouter(dependencies=ADMIN_ONLY)
health_router = APIRouter()


def rollout_server(request: Request) -> RolloutServer:
    """The app's RolloutServer (``app.state.server``, set by ``create_server_app``)."""
    server: RolloutServer = request.app.state.server
    return server


async def _json(data: Any, status: int = 200) -> Response:
    """A big JSON answer (a task view holds every result) encoded in a worker thread, not on the event loop."""
    body = await asyncio.to_thread(orjson.dumps, data)  # orjson: a few ms where json held the GIL for 100
    return Response(body, status_code=status, media_type="application/json")


class Backend(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(max_length=2048)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        return check_upstream_url(value)


class Resume(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy_version: int | str | None = None

    @field_validator("policy_version")
    @classmethod
    def _short(cls, value: int | str | None) -> int | str | None:
        if (isinstance(value, str) and len(value) > 256) or (isinstance(value, int) and abs(value) >= 2**63):
            raise ValueError("a policy version is an int64 or a string of at most 256 characters")
        return value


@tasks_router.post("/tasks")
async def submit(request: Request, task: TaskRequest) -> Response:
    view, created = await rollout_server(request).submit(task)
    return await _json({**view, "created": created}, 201 if created else 200)


@tasks_router.get("/tasks")
async def list_tasks(request: Request, limit: int = Query(1000, ge=1, le=10_000),
                     offset: int = Query(0, ge=0, le=2**62)) -> dict[str, Any]:
    return {"tasks": await rollout_server(request).store.task_ids(limit, offset)}


@tasks_router.get("/tasks/{task_id}")
async def task(request: Request, task_id: str) -> Response:
    return await _json(await rollout_server(request).task_view(task_id))


@tasks_router.get("/tasks/{task_id}/results")
async def task_results(request: Request, task_id: str, after: Annotated[float | None, Query()] = None,
                       after_session: Annotated[str, Query(max_length=512)] = "") -> Response:
    """The task view with its finished results packed as stored (polar_gym.result_codec.frame_results), those
    after the cursor ``(after, after_session)`` a previous answer's ``cursor`` gave: a trainer polling a big task
    gets each result once, and the server decodes none."""
    cursor = (after, after_session) if after is not None else None
    body = await packed_task_view(rollout_server(request).store, task_id, cursor)
    return Response(body, media_type=MEDIA_TYPE)


@tasks_router.post("/tasks/{task_id}/release")
async def release_task(request: Request, task_id: str) -> Response:
    """The trainer has every result of a finished task: the server applies its result retention to them
    (``--result-retention``; a delivered callback does the same)."""
    return await _json(await rollout_server(request).release_task(task_id))


@tasks_router.post("/tasks/{task_id}/cancel")
async def cancel_task(request: Request, task_id: str) -> Response:
    return await _json(await rollout_server(request).cancel_task(task_id))


@tasks_router.get("/tasks/{task_id}/events")
async def events(request: Request, task_id: str) -> StreamingResponse:
    server = rollout_server(request)
    await server.task_view(task_id)  # 404 before the stream starts

    async def stream() -> AsyncIterator[str]:
        async for event in server.events(task_id):
            yield f"event: {event['event']}\ndata: {json.dumps(event)}\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


@sessions_router.get("/sessions/{session_id}/result")
async def result(request: Request, session_id: str, wait: float = Query(0.0, ge=0.0, le=600.0),
                 fmt: Annotated[Literal["polar", "atif"], Query(alias="format")] = "polar") -> Response:
    row = await rollout_server(request).result(session_id, wait)
    if row.result is None:
        return JSONResponse({"session_id": session_id, "task_id": row.task_id, "status": row.status.value,
                             "gateway_id": row.gateway_id, "attempts": row.attempts, "reason": row.reason},
                            status_code=202)
    if fmt == "atif":
        agent = row.spec.agent
        pin = PINS.get(agent.harness)
        return await _json(await asyncio.to_thread(atif_json, row.result, agent_name=agent.harness,
                                                   agent_version=pin.version if pin else None,
                                                   model_name=agent.model_name))
    return Response(await asyncio.to_thread(row.result.model_dump_json), media_type="application/json")


@sessions_router.get("/sessions/{session_id}/nemo")
async def nemo(request: Request, session_id: str, wait: float = Query(0.0, ge=0.0, le=600.0)) -> Response:
    row = await rollout_server(request).result(session_id, wait)
    if row.result is None:
        return JSONResponse({"session_id": session_id, "status": row.status.value, "reason": row.reason},
                            status_code=202)
    return JSONResponse(await asyncio.to_thread(session_nemo_payload, row.result))  # long chains: off the loop


@sessions_router.post("/sessions/{session_id}/cancel")
async def cancel_session(request: Request, session_id: str) -> dict[str, Any]:
    row = await rollout_server(request).cancel_session(session_id)
    return {"session_id": session_id, "task_id": row.task_id, "cancel_requested": True}


@gateways_router.post("/gateways/register")
async def register(request: Request, reg: GatewayRegistration) -> JSONResponse:
    return JSONResponse((await rollout_server(request).register(reg)).describe(), status_code=201)


@gateways_router.get("/gateways")
async def gateways(request: Request) -> dict[str, Any]:
    return {"gateways": await rollout_server(request).fleet_view()}


@gateways_router.post("/gateways/{gateway_id}/heartbeat")
async def heartbeat(request: Request, gateway_id: str) -> dict[str, Any]:
    try:
        health = await request.json() if await request.body() else {}
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, "invalid_json", f"the heartbeat body is not JSON: {excerpt(exc)}") from exc
    if not isinstance(health, dict) or json_depth(health) > MAX_JSON_DEPTH:
        raise ApiError(400, "invalid_heartbeat", "the heartbeat body is the gateway's health object "
                                                 f"(a JSON object at most {MAX_JSON_DEPTH} levels deep)")
    return (await rollout_server(request).heartbeat(gateway_id, health)).describe()


@gateways_router.post("/gateways/{gateway_id}/drain")
async def drain(request: Request, gateway_id: str, body: GatewayDrainRequest | None = None) -> dict[str, Any]:
    """No new session goes to the gateway; with ``withdraw``, those it has not started running come back to the
    queue (their attempt never ran); with ``leaving``, the gateway is gone at once."""
    body = body or GatewayDrainRequest()
    return (await rollout_server(request).drain(gateway_id, withdraw=body.withdraw,
                                                leaving=body.leaving)).describe()


@backends_router.get("/backends")
async def backends(request: Request) -> dict[str, Any]:
    server = rollout_server(request)
    await server.recall_fleet()
    return {"backends": server.backends, "gateways": await server.fanout("GET", "/admin/upstreams")}


@backends_router.post("/backends")
async def add_backend(request: Request, body: Backend) -> dict[str, Any]:
    server = rollout_server(request)
    await server.recall_fleet()
    if body.url not in server.backends:
        server.backends.append(body.url)
        await server.remember_fleet()
    return {"backends": server.backends,
            "gateways": await server.fanout("POST", "/admin/upstreams", {"url": body.url})}


@backends_router.delete("/backends")
async def remove_backend(request: Request, url: str | None = Query(None, max_length=2048)) -> dict[str, Any]:
    """Remove one backend, or all of them (no ``url``) on a checkpoint swap."""
    server = rollout_server(request)
    await server.recall_fleet()
    urls = [url] if url else list(server.backends)
    results = {}
    for each in urls:
        if each in server.backends:
            server.backends.remove(each)
        results[each] = await server.fanout("POST", "/admin/upstreams/remove", {"url": each})
    await server.remember_fleet()
    return {"backends": server.backends, "removed": results}


@backends_router.post("/backends/pause")
async def pause(request: Request) -> dict[str, Any]:
    return {"gateways": await rollout_server(request).fanout("POST", "/admin/pause")}


@backends_router.post("/backends/resume")
async def resume(request: Request, body: Resume) -> dict[str, Any]:
    return {"gateways": await rollout_server(request).fanout("POST", "/admin/resume", body.model_dump())}


@backends_router.post("/backends/weights")
async def weights(request: Request, body: WeightUpdateRequest) -> FleetWeightUpdate:
    """200 with ``updated`` false when a gateway failed (every gateway resumed under its old version)."""
    return await update_fleet_weights(rollout_server(request), body)


@health_router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    server = rollout_server(request)
    return {"status": "ok", "gateways": len(server.fleet.live()), "worker": server.worker}


async def _metrics_text(server: RolloutServer) -> str:
    sessions, tasks = await server.store.counts()
    return server_metrics(sessions, tasks, [g.describe() for g in server.fleet.gateways.values()], server.counters)


@health_router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(await _metrics_text(rollout_server(request)), media_type=PROMETHEUS_CONTENT_TYPE)
