"""The gateway's session API as routers (vLLM entrypoints style: routes read the node from ``app.state``), mounted
on the proxy's app in front of its catch-all; refusals in the polar_gym.web envelope.

    POST /sessions                 dispatch a SessionSpec (admin; 409 an id still running here, 503 draining)
    GET  /sessions/{id}            status, stage, timings, history (admin or the session's key)
    GET  /sessions/{id}/result     the SessionResult (202 while not finished; ``?wait=S`` long-polls; ``?format=atif``:
                                   the session as one ATIF trajectory, polar_gym.merge.atif)
    POST /sessions/{id}/cancel     (admin)
    POST /sessions/poll            many sessions in one long poll: finished results, statuses, unknown ids (admin;
                                   with ``accept: application/vnd.polar-gym.result`` the results come packed,
                                   polar_gym.result_codec)
    POST /gateway/drain            stop accepting, finish in-flight sessions (admin; ``?wait=true`` blocks)
    GET  /gateway/health           stage metrics: counts per stage, queue depths, slots busy, latencies
    GET  /metrics                  the same, with tokens captured and errors, in Prometheus text format
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from polar_gym.gateway.errors import DuplicateSession, GatewayClosed, UnknownSession
from polar_gym.gateway.metrics import gateway_metrics
from polar_gym.gateway.node import GatewayNode
from polar_gym.gateway.session import Session
from polar_gym.harness import PINS
from polar_gym.httpguard import MAX_JSON_DEPTH, json_depth
from polar_gym.merge.atif import atif_json
from polar_gym.prometheus import PROMETHEUS_CONTENT_TYPE
from polar_gym.proxy.routes.common import proxy_service
from polar_gym.proxy.routes.sessions import TrajectoryFormat, require_session_or_admin
from polar_gym.result_codec import MEDIA_TYPE, frame_results, pack
from polar_gym.schema import SessionPollRequest, SessionSpec, SessionWithdrawReply, SessionWithdrawRequest
from polar_gym.web import ADMIN_ONLY, ApiError

__all__ = ["admin_router", "metrics_router", "sessions_router"]

sessions_router = APIRouter()
admin_router = APIRouter(dependencies=ADMIN_ONLY)
metrics_router = APIRouter()

_background: set[asyncio.Task[None]] = set()


def gateway_node(request: Request) -> GatewayNode:
    """The app's GatewayNode (``app.state.node``, set by ``create_gateway_app``)."""
    node: GatewayNode = request.app.state.node
    return node


def _session(node: GatewayNode, session_id: str) -> Session:
    try:
        return node.get(session_id)
    except UnknownSession as exc:
        raise ApiError(404, "unknown_session", str(exc)) from exc


@admin_router.post("/sessions")
async def dispatch(request: Request, spec: SessionSpec) -> Response:
    try:
        depth = json_depth(spec.model_dump(mode="json"))
    except ValueError:  # nested past the serializer's own guard
        depth = MAX_JSON_DEPTH + 1
    if depth > MAX_JSON_DEPTH:  # its result could not be serialized, nor read back by the rollout server
        raise ApiError(422, "too_deep", f"the session spec nests JSON deeper than {MAX_JSON_DEPTH} levels")
    try:
        session = gateway_node(request).submit(spec)
    except DuplicateSession as exc:
        raise ApiError(409, "duplicate_session", str(exc)) from exc
    except GatewayClosed as exc:
        raise ApiError(503, "gateway_closed", str(exc)) from exc
    return JSONResponse(session.describe(), status_code=201)


@admin_router.post("/sessions/poll")
async def poll(request: Request, body: SessionPollRequest) -> Response:
    """Many sessions in one long poll (the rollout server's watch): finished results, other statuses, unknown ids;
    answers as soon as one of them finished, else after ``wait`` seconds."""
    results, statuses, unknown = await gateway_node(request).wait_any(body.session_ids, body.wait)
    if MEDIA_TYPE in request.headers.get("accept", ""):  # the server's watch: packed, so it files them unparsed
        packed = await asyncio.to_thread(lambda: [pack(r) for r in results])
        return Response(frame_results(packed, {"statuses": statuses, "unknown": unknown}), media_type=MEDIA_TYPE)
    payload = b'{"results":[' + b",".join(r.model_dump_json().encode() for r in results) + b"],"
    payload += f'"statuses":{json.dumps(statuses)},"unknown":{json.dumps(unknown)}}}'.encode()
    return Response(payload, media_type="application/json")


@admin_router.post("/sessions/withdraw")
async def withdraw(request: Request, body: SessionWithdrawRequest) -> SessionWithdrawReply:
    """Cancel the named sessions that have not started running; the rollout server queues them again."""
    return SessionWithdrawReply(withdrawn=gateway_node(request).withdraw(body.session_ids))


@admin_router.post("/sessions/{session_id}/cancel")
async def cancel(request: Request, session_id: str) -> Response:
    node = gateway_node(request)
    try:
        cancelled = node.cancel(session_id, "cancelled through the API")
    except UnknownSession as exc:
        raise ApiError(404, "unknown_session", str(exc)) from exc
    return JSONResponse({"cancelled": cancelled, **_session(node, session_id).describe()})


@admin_router.post("/gateway/drain")
async def drain(request: Request, wait: bool = False) -> dict[str, Any]:
    node = gateway_node(request)
    if wait:
        await node.drain()
    else:
        node.accepting, node.draining = False, True
        task = asyncio.create_task(node.drain())
        _background.add(task)
        task.add_done_callback(_background.discard)
    return node.health()


@sessions_router.get("/sessions/{session_id}")
async def status(request: Request, session_id: str) -> Response:
    require_session_or_admin(request, session_id)
    return JSONResponse(_session(gateway_node(request), session_id).describe())


@sessions_router.get("/sessions/{session_id}/result")
async def result(request: Request, session_id: str, wait: float = Query(0.0, ge=0.0, le=600.0),
                 fmt: Annotated[TrajectoryFormat, Query(alias="format")] = "polar") -> Response:
    require_session_or_admin(request, session_id)
    session = _session(gateway_node(request), session_id)
    if session.result is None and wait > 0:
        try:
            await asyncio.wait_for(session.done.wait(), min(wait, 600.0))
        except TimeoutError:
            pass
    if session.result is None:
        return JSONResponse(session.describe(), status_code=202)
    if fmt == "atif":
        agent = session.spec.agent
        pin = PINS.get(agent.harness)
        doc = await asyncio.to_thread(atif_json, session.result, agent_name=agent.harness,
                                      agent_version=pin.version if pin else None, model_name=agent.model_name)
        return Response(await asyncio.to_thread(orjson.dumps, doc), media_type="application/json")
    return Response(session.result.model_dump_json(), media_type="application/json")


@metrics_router.get("/gateway/health")
async def health(request: Request) -> dict[str, Any]:
    return gateway_node(request).health()


@metrics_router.get("/metrics")
async def metrics(request: Request) -> Response:
    """For a cluster's Prometheus: stage counts and latencies, queue depths, tokens, errors."""
    text = gateway_metrics(gateway_node(request).health(), proxy_service(request).stats)
    return Response(text, media_type=PROMETHEUS_CONTENT_TYPE)
