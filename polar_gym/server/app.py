"""The rollout server's HTTP API. Routes are thin: check the token, parse, call the RolloutServer, map its
ServerError to a status. Everything but /metrics, /health and the OpenAPI docs needs the admin token.

    POST /tasks                    submit a TaskRequest (201 created, 200 when the task_id exists)
    GET  /tasks, /tasks/{id}       list; status with per-session status, results and an aggregate
    POST /tasks/{id}/cancel        cancel every session of a task
    GET  /tasks/{id}/events        server-sent events of status changes
    GET  /sessions/{id}/result     the SessionResult (202 while running; ``?wait=S`` long-polls)
    GET  /sessions/{id}/nemo       the same session as NeMo Gym token items per chain (polar_gym.merge.nemo_payload)
    POST /sessions/{id}/cancel
    POST /gateways/register, GET /gateways, POST /gateways/{id}/heartbeat, POST /gateways/{id}/drain
    GET/POST/DELETE /backends, POST /backends/pause, /backends/resume   forwarded to every gateway's proxy
    GET  /metrics                  Prometheus text

Input is bounded before a route sees it (polar_gym.httpguard): the token is checked before the body is read, bodies
are capped (``max_body_bytes``), validation errors quote only excerpts, query parameters have ranges, and backend
URLs must be http(s) URLs with a host.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from polar_gym.httpguard import (
    MAX_JSON_DEPTH,
    BodyGuard,
    TokenCheck,
    check_upstream_url,
    excerpt,
    json_depth,
    safe_validation_errors,
)
from polar_gym.merge.nemo_payload import session_nemo_payload
from polar_gym.schema import TaskRequest
from polar_gym.server.core import RolloutServer, ServerError
from polar_gym.server.fleet import GatewayRegistration
from polar_gym.server.metrics import PROMETHEUS_CONTENT_TYPE, server_metrics

__all__ = ["create_server_app"]


#: routes anyone may call (everything else needs the admin token, checked before the body is read)
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


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


async def _json(data: Any, status: int = 200) -> Response:
    """A big JSON answer (a task view holds every result) encoded in a worker thread, not on the event loop."""
    body = await asyncio.to_thread(orjson.dumps, data)  # orjson: a few ms where json held the GIL for 100
    return Response(body, status_code=status, media_type="application/json")


def _error(status: int, kind: str, message: Any) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status)


def create_server_app(server: RolloutServer, admin_token: str, *, manage_lifecycle: bool = True,
                      max_body_bytes: int = 16 * 1024 * 1024) -> FastAPI:
    """The app; with ``manage_lifecycle`` its lifespan starts and stops the server's loops. Only a hash of the
    admin token is kept; request bodies over ``max_body_bytes`` are refused (413)."""
    if not admin_token:
        raise ValueError("the rollout server needs an admin token")
    token = TokenCheck(admin_token)
    del admin_token

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            await server.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                await server.stop()

    app = FastAPI(title="polar_gym rollout server", lifespan=lifespan)
    app.state.server = server

    app.add_middleware(BodyGuard, token=token, needs_token=lambda method, path: path not in OPEN_PATHS,
                       limit=lambda method, path: max_body_bytes)

    async def admin(request: Request) -> None:
        """Also in the middleware; kept per route so a route mounted without it is not open."""
        if not token.admits(request.scope.get("headers", ())):
            raise ServerError(401, "unauthorized", "this endpoint needs the admin token (x-admin-token header)")

    @app.exception_handler(ServerError)
    async def server_error(request: Request, exc: ServerError) -> JSONResponse:
        return _error(exc.status, exc.kind, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """FastAPI's own refusals (an unparseable body, an unknown route) in this API's error shape."""
        return _error(exc.status_code, "invalid_request" if exc.status_code < 500 else "internal",
                      excerpt(exc.detail, 300))

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, "invalid_request", safe_validation_errors(exc.errors()))

    auth = [Depends(admin)]

    @app.post("/tasks", dependencies=auth)
    async def submit(task: TaskRequest) -> Response:
        view, created = await server.submit(task)
        return await _json({**view, "created": created}, 201 if created else 200)

    @app.get("/tasks", dependencies=auth)
    async def list_tasks(limit: int = Query(1000, ge=1, le=10_000),
                         offset: int = Query(0, ge=0, le=2**62)) -> dict[str, Any]:
        return {"tasks": await server.store.task_ids(limit, offset)}

    @app.get("/tasks/{task_id}", dependencies=auth)
    async def task(task_id: str) -> Response:
        return await _json(await server.task_view(task_id))

    @app.post("/tasks/{task_id}/cancel", dependencies=auth)
    async def cancel_task(task_id: str) -> Response:
        return await _json(await server.cancel_task(task_id))

    @app.get("/tasks/{task_id}/events", dependencies=auth)
    async def events(task_id: str) -> StreamingResponse:
        await server.task_view(task_id)  # 404 before the stream starts

        async def stream() -> AsyncIterator[str]:
            async for event in server.events(task_id):
                yield f"event: {event['event']}\ndata: {json.dumps(event)}\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.get("/sessions/{session_id}/result", dependencies=auth)
    async def result(session_id: str, wait: float = Query(0.0, ge=0.0, le=600.0)) -> Response:
        row = await server.result(session_id, wait)
        if row.result is None:
            return JSONResponse({"session_id": session_id, "task_id": row.task_id, "status": row.status.value,
                                 "gateway_id": row.gateway_id, "attempts": row.attempts, "reason": row.reason},
                                status_code=202)
        return Response(await asyncio.to_thread(row.result.model_dump_json), media_type="application/json")

    @app.get("/sessions/{session_id}/nemo", dependencies=auth)
    async def nemo(session_id: str, wait: float = Query(0.0, ge=0.0, le=600.0)) -> Response:
        row = await server.result(session_id, wait)
        if row.result is None:
            return JSONResponse({"session_id": session_id, "status": row.status.value, "reason": row.reason},
                                status_code=202)
        return JSONResponse(await asyncio.to_thread(session_nemo_payload, row.result))  # long chains: off the loop

    @app.post("/sessions/{session_id}/cancel", dependencies=auth)
    async def cancel_session(session_id: str) -> dict[str, Any]:
        row = await server.cancel_session(session_id)
        return {"session_id": session_id, "task_id": row.task_id, "cancel_requested": True}

    @app.post("/gateways/register", dependencies=auth)
    async def register(reg: GatewayRegistration) -> JSONResponse:
        return JSONResponse((await server.register(reg)).describe(), status_code=201)

    @app.get("/gateways", dependencies=auth)
    async def gateways() -> dict[str, Any]:
        return {"gateways": [g.describe() for g in server.fleet.gateways.values()]}

    @app.post("/gateways/{gateway_id}/heartbeat", dependencies=auth)
    async def heartbeat(gateway_id: str, request: Request) -> dict[str, Any]:
        try:
            health = await request.json() if await request.body() else {}
        except (ValueError, RecursionError) as exc:
            raise ServerError(400, "invalid_json", f"the heartbeat body is not JSON: {excerpt(exc)}") from exc
        if not isinstance(health, dict) or json_depth(health) > MAX_JSON_DEPTH:
            raise ServerError(400, "invalid_heartbeat", "the heartbeat body is the gateway's health object "
                                                        f"(a JSON object at most {MAX_JSON_DEPTH} levels deep)")
        return (await server.heartbeat(gateway_id, health)).describe()

    @app.post("/gateways/{gateway_id}/drain", dependencies=auth)
    async def drain(gateway_id: str) -> dict[str, Any]:
        return (await server.drain(gateway_id)).describe()

    @app.get("/backends", dependencies=auth)
    async def backends() -> dict[str, Any]:
        return {"backends": server.backends, "gateways": await server.fanout("GET", "/admin/upstreams")}

    @app.post("/backends", dependencies=auth)
    async def add_backend(body: Backend) -> dict[str, Any]:
        if body.url not in server.backends:
            server.backends.append(body.url)
        return {"backends": server.backends,
                "gateways": await server.fanout("POST", "/admin/upstreams", {"url": body.url})}

    @app.delete("/backends", dependencies=auth)
    async def remove_backend(url: str | None = Query(None, max_length=2048)) -> dict[str, Any]:
        """Remove one backend, or all of them (no ``url``) on a checkpoint swap."""
        urls = [url] if url else list(server.backends)
        results = {}
        for each in urls:
            if each in server.backends:
                server.backends.remove(each)
            results[each] = await server.fanout("POST", "/admin/upstreams/remove", {"url": each})
        return {"backends": server.backends, "removed": results}

    @app.post("/backends/pause", dependencies=auth)
    async def pause() -> dict[str, Any]:
        return {"gateways": await server.fanout("POST", "/admin/pause")}

    @app.post("/backends/resume", dependencies=auth)
    async def resume(body: Resume) -> dict[str, Any]:
        return {"gateways": await server.fanout("POST", "/admin/resume", body.model_dump())}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "gateways": len(server.fleet.live())}

    @app.get("/metrics")
    async def metrics() -> Response:
        sessions, tasks = await server.store.counts()
        counts = server.counters
        text = server_metrics(sessions, tasks, [g.describe() for g in server.fleet.gateways.values()],
                              counts.dispatched, counts.dispatch_seconds, counts.redispatched, counts.errors,
                              counts.callbacks)
        return Response(text, media_type=PROMETHEUS_CONTENT_TYPE)

    return app
