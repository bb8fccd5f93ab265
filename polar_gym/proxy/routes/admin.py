"""The proxy's admin API (the admin token, checked before the body is read; refusals in the polar_gym.web
envelope): session registration, and the engine pool's upstreams, pause and resume around a weight update.

    POST   /admin/sessions             register a session; answers its fresh key
    DELETE /admin/sessions/{id}        revoke it
    GET    /admin/upstreams            the pool: servers, paused, policy version
    POST   /admin/upstreams            add a server; POST /admin/upstreams/remove drops one
    POST   /admin/pause, /admin/resume hold new model calls (in-flight ones drain, or token-in generations are cut:
                                       body {"in_flight": "cut" | "wait"}, cut by default), then resume under a
                                       new version
    POST   /admin/weights              pause, load a checkpoint into every upstream, resume under its version
                                       (polar_gym.proxy.weights; 409 weights_unsupported, 502 weight_update_failed
                                       naming the server, 504 drain_timeout); with ``servers``, swap in servers
                                       restarted on the checkpoint instead
    POST   /admin/weights/undo         undo an update loaded with resume false (409 nothing_staged)
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, field_validator

from polar_gym.httpguard import MAX_JSON_DEPTH, check_upstream_url, json_depth
from polar_gym.proxy.errors import SessionMetadataError, WeightsUnsupported, WeightUpdateError
from polar_gym.proxy.routes.common import proxy_service
from polar_gym.proxy.service import SessionInfo, new_session_key
from polar_gym.proxy.weights import DrainTimeout, NothingStaged, undo_staged_update, update_pool_weights
from polar_gym.schema import PauseRequest, WeightUpdateReply, WeightUpdateRequest
from polar_gym.web import ADMIN_ONLY, ApiError

__all__ = ["Resume", "SessionRegistration", "UpstreamAdd", "UpstreamChange", "router"]

router = APIRouter(prefix="/admin", dependencies=ADMIN_ONLY)


class SessionRegistration(BaseModel):
    session_id: str = Field(min_length=1, max_length=512)
    model_name: str | None = None
    oracle: dict[str, Any] | None = None
    metadata: dict[str, Any] = {}


class UpstreamChange(BaseModel):
    url: str = Field(max_length=2048)


class UpstreamAdd(UpstreamChange):
    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        return check_upstream_url(value)


class Resume(BaseModel):
    policy_version: int | str | None = None


@router.post("/sessions")
async def register(request: Request, body: SessionRegistration) -> dict[str, Any]:
    service = proxy_service(request)
    if json_depth([body.metadata, body.oracle]) > MAX_JSON_DEPTH:
        raise ApiError(400, "invalid_request", f"session metadata nests JSON deeper than {MAX_JSON_DEPTH} levels")
    try:  # the proxy (a sampling override) and the engine (the oracle its script) read what they need and refuse
        # bad metadata before the key exists
        info = SessionInfo(body.session_id, body.model_name, body.metadata)
        service.engine.open_session(body.session_id, {**body.metadata, "oracle": body.oracle})
    except SessionMetadataError as exc:
        raise ApiError(400, "invalid_request", str(exc)) from exc
    key = info.key = new_session_key()  # a fresh secret, never the session id (invariant 7)
    service.sessions.register(info)
    return {"registered": body.session_id, "api_key": key}


@router.delete("/sessions/{session_id}")
async def unregister(request: Request, session_id: str) -> dict[str, Any]:
    service = proxy_service(request)
    service.engine.pool.forget(session_id)  # unregistering also calls the service's forget hook (the engine's)
    return {"unregistered": service.sessions.unregister(session_id)}


@router.get("/upstreams")
async def upstreams(request: Request) -> dict[str, Any]:
    pool = proxy_service(request).engine.pool
    return {"paused": pool.paused, "policy_version": pool.policy_version, "checkpoint": pool.checkpoint,
            "servers": [vars(s) for s in pool.servers()]}


@router.post("/upstreams")
async def add_upstream(request: Request, body: UpstreamAdd) -> dict[str, Any]:
    return {"added": proxy_service(request).engine.pool.add(body.url).url}


@router.post("/upstreams/remove")
async def remove_upstream(request: Request, body: UpstreamChange) -> dict[str, Any]:
    return {"removed": proxy_service(request).engine.pool.remove(body.url)}


@router.post("/pause")
async def pause(request: Request, body: PauseRequest | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    cut = await proxy_service(request).engine.pool.pause(in_flight=(body or PauseRequest()).in_flight)
    return {"paused": True, "drained_seconds": time.perf_counter() - started, "cut": cut}


@router.post("/resume")
async def resume(request: Request, body: Resume) -> dict[str, Any]:
    pool = proxy_service(request).engine.pool
    pool.resume(body.policy_version)
    return {"paused": False, "policy_version": pool.policy_version}


@router.post("/weights")
async def weights(request: Request, body: WeightUpdateRequest) -> WeightUpdateReply:
    try:
        return await update_pool_weights(proxy_service(request).engine, body)
    except WeightsUnsupported as exc:
        raise ApiError(409, "weights_unsupported", exc.message) from exc
    except DrainTimeout as exc:
        raise ApiError(504, "drain_timeout", exc.message) from exc
    except WeightUpdateError as exc:
        raise ApiError(502, "weight_update_failed", exc.message) from exc


@router.post("/weights/undo")
async def undo_weights(request: Request) -> WeightUpdateReply:
    try:
        return await undo_staged_update(proxy_service(request).engine)
    except NothingStaged as exc:
        raise ApiError(409, "nothing_staged", exc.message) from exc
    except WeightUpdateError as exc:
        raise ApiError(502, "weight_update_failed", exc.message) from exc
