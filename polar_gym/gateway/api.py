"""The gateway's HTTP surface: the session API, mounted on the proxy's app so harnesses, the rollout server and
trainers talk to one server. Routes are thin: parse, call the node, map its errors to a status.

    POST /sessions                 dispatch a SessionSpec (admin; 409 duplicate id, 503 draining)
    GET  /sessions/{id}            status, stage, timings, history (admin or the session's key)
    GET  /sessions/{id}/result     the SessionResult (202 while not finished; ``?wait=S`` long-polls)
    POST /sessions/{id}/cancel     (admin)
    POST /sessions/poll            many sessions in one long poll: finished results, statuses, unknown ids (admin)
    GET  /gateway/health           stage metrics: counts per stage, queue depths, slots busy, latencies
    GET  /metrics                  the same, with tokens captured and errors, in Prometheus text format
    POST /gateway/drain            stop accepting, finish in-flight sessions (admin; ``?wait=true`` blocks)
    ...                            the proxy's routes (model APIs, /sessions/{id}/completions, /admin/*)

Admin routes check the token before reading their body and cap it (polar_gym.httpguard through the proxy's app).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from polar_gym.gateway.config import GatewayConfig
from polar_gym.gateway.errors import DuplicateSession, GatewayClosed, UnknownSession
from polar_gym.gateway.node import GatewayNode
from polar_gym.gateway.sandbox import SandboxStages
from polar_gym.httpguard import MAX_JSON_DEPTH, TokenCheck, json_depth
from polar_gym.proxy.app import create_app
from polar_gym.proxy.errors import AuthError
from polar_gym.proxy.service import ProxyService, SessionRegistry, session_key
from polar_gym.schema import SessionSpec
from polar_gym.server.metrics import PROMETHEUS_CONTENT_TYPE, gateway_metrics

__all__ = ["admin_route", "build_gateway", "create_gateway_app", "gateway_router", "metrics_router"]

_ADMIN_POST = re.compile(r"^/(sessions|sessions/poll|sessions/[^/]+/cancel|gateway/drain)$")


def admin_route(method: str, path: str) -> bool:
    """The session API's admin-only routes (their token is checked before their body is read)."""
    return method == "POST" and _ADMIN_POST.match(path) is not None


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status)


class SessionPoll(BaseModel):
    """POST /sessions/poll: the sessions to watch and how long to wait for one of them to finish."""

    model_config = ConfigDict(extra="forbid")

    session_ids: list[Annotated[str, Field(max_length=512)]] = Field(max_length=100_000)
    wait: float = Field(default=0.0, ge=0.0, le=600.0)


def gateway_router(node: GatewayNode, admin_token: str | None,
                   sessions: SessionRegistry | None = None) -> APIRouter:
    router = APIRouter()
    token = TokenCheck(admin_token)

    def is_admin(request: Request) -> bool:
        return token.configured and token.admits(request.scope.get("headers", ()))

    def require_admin(request: Request) -> None:
        if not is_admin(request):
            raise AuthError("gateway admin endpoints need the x-admin-token header")

    def require_session_or_admin(request: Request, session_id: str) -> None:
        """The session's own key while it runs (its key is revoked after), else the admin token."""
        key = session_key(request.headers, request.query_params)
        if not is_admin(request) and (sessions is None or not sessions.may_read(key, session_id)):
            raise AuthError("a session is readable with its own key while it runs, else the admin token")

    @router.post("/sessions")
    async def dispatch(request: Request, spec: SessionSpec) -> Response:
        require_admin(request)
        try:
            depth = json_depth(spec.model_dump(mode="json"))
        except ValueError:  # nested past the serializer's own guard
            depth = MAX_JSON_DEPTH + 1
        if depth > MAX_JSON_DEPTH:  # its result could not be serialized, nor read back by the rollout server
            return _error(422, "too_deep", f"the session spec nests JSON deeper than {MAX_JSON_DEPTH} levels")
        try:
            session = node.submit(spec)
        except DuplicateSession as exc:
            return _error(409, "duplicate_session", str(exc))
        except GatewayClosed as exc:
            return _error(503, "gateway_closed", str(exc))
        return JSONResponse(session.describe(), status_code=201)

    @router.post("/sessions/poll")
    async def poll(request: Request, body: SessionPoll) -> Response:
        """Many sessions in one long poll (the rollout server's watch): finished results, other statuses, unknown
        ids; answers as soon as one of them finished, else after ``wait`` seconds."""
        require_admin(request)
        results, statuses, unknown = await node.wait_any(body.session_ids, body.wait)
        payload = b'{"results":[' + b",".join(r.model_dump_json().encode() for r in results) + b"],"
        payload += f'"statuses":{json.dumps(statuses)},"unknown":{json.dumps(unknown)}}}'.encode()
        return Response(payload, media_type="application/json")

    @router.get("/sessions/{session_id}")
    async def status(request: Request, session_id: str) -> Response:
        require_session_or_admin(request, session_id)
        try:
            return JSONResponse(node.get(session_id).describe())
        except UnknownSession as exc:
            return _error(404, "unknown_session", str(exc))

    @router.get("/sessions/{session_id}/result")
    async def result(request: Request, session_id: str, wait: float = Query(0.0, ge=0.0, le=600.0)) -> Response:
        require_session_or_admin(request, session_id)
        try:
            session = node.get(session_id)
        except UnknownSession as exc:
            return _error(404, "unknown_session", str(exc))
        if session.result is None and wait > 0:
            try:
                await asyncio.wait_for(session.done.wait(), min(wait, 600.0))
            except TimeoutError:
                pass
        if session.result is None:
            return JSONResponse(session.describe(), status_code=202)
        return Response(session.result.model_dump_json(), media_type="application/json")

    @router.post("/sessions/{session_id}/cancel")
    async def cancel(request: Request, session_id: str) -> Response:
        require_admin(request)
        try:
            cancelled = node.cancel(session_id, "cancelled through the API")
            return JSONResponse({"cancelled": cancelled, **node.get(session_id).describe()})
        except UnknownSession as exc:
            return _error(404, "unknown_session", str(exc))

    @router.get("/gateway/health")
    async def health() -> dict[str, Any]:
        return node.health()

    @router.post("/gateway/drain")
    async def drain(request: Request, wait: bool = False) -> dict[str, Any]:
        require_admin(request)
        if wait:
            await node.drain()
        else:
            node.accepting, node.draining = False, True
            task = asyncio.create_task(node.drain())
            _background.add(task)
            task.add_done_callback(_background.discard)
        return node.health()

    return router


_background: set[asyncio.Task[None]] = set()


def metrics_router(node: GatewayNode, service: ProxyService) -> APIRouter:
    """GET /metrics for a cluster's Prometheus: stage counts and latencies, queue depths, tokens, errors."""
    router = APIRouter()

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway_metrics(node.health(), service.stats), media_type=PROMETHEUS_CONTENT_TYPE)

    return router


def create_gateway_app(node: GatewayNode, service: ProxyService, admin_token: str | None) -> FastAPI:
    """The proxy's app with the session API in front of its catch-all route."""
    app = create_app(service, admin_token, routers=[gateway_router(node, admin_token, service.sessions),
                                                    metrics_router(node, service)],
                     title="polar_gym gateway", admin_paths=admin_route)
    app.state.node = node
    return app


def build_gateway(service: ProxyService, config: GatewayConfig, admin_token: str | None) -> tuple[GatewayNode, FastAPI]:
    """A node with the real stage functions, and its app. The service must serve registered keys only."""
    if service.sessions.allow_adhoc:
        raise ValueError("a gateway serves registered sessions only: use SessionRegistry(allow_adhoc=False)")
    node = GatewayNode(SandboxStages(service, config), config)
    return node, create_gateway_app(node, service, admin_token)
