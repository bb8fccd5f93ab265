"""A session's captures and its trajectory, readable with the session's own key while it runs or with the admin
token (DESIGN invariant 4); refusals in the polar_gym.web envelope.

    GET /sessions/{id}/completions    the captured CompletionRecords
    GET /sessions/{id}/trajectory     the trajectory a registered builder makes of them (``?builder=&config=``;
                                      ``&format=atif``: as one ATIF document, polar_gym.merge.atif)
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from polar_gym.merge import MergeConfig, build_trajectory
from polar_gym.merge.atif import atif_json
from polar_gym.proxy.engines.base import Engine
from polar_gym.proxy.routes.common import proxy_service
from polar_gym.proxy.service import session_key
from polar_gym.registry import BUILDERS
from polar_gym.schema import BuilderSpec, CompletionRecord, CompletionSession
from polar_gym.web import ApiError, is_admin

__all__ = ["require_session_or_admin", "router"]

router = APIRouter()


def require_session_or_admin(request: Request, session_id: str) -> None:
    """A session is readable with its own live key or the admin token: once its key is revoked, with the admin
    token only."""
    key = session_key(request.headers, request.query_params)
    if not is_admin(request) and not proxy_service(request).sessions.may_read(key, session_id):
        raise ApiError(401, "unauthorized", "a session is readable with its own key while it runs, else the admin "
                                            "token")


def _builder_spec(builder: str, config: str | None, engine: Engine) -> BuilderSpec:
    """The builder a trajectory request names: registered names only (a dotted path would import code chosen by the
    caller); end-of-turn IDs default to the engine tokenizer's."""
    if builder not in BUILDERS.names():
        raise ApiError(400, "invalid_request",
                       f"unknown builder {builder!r}; known builders: {', '.join(BUILDERS.names())}")
    try:
        options = orjson.loads(config) if config else {}
        if not isinstance(options, dict):
            raise ValueError("config must be a JSON object")
        eot = engine.end_of_turn_ids
        if eot and "end_of_turn_ids" not in options:
            options["end_of_turn_ids"] = list(eot)
        MergeConfig.from_dict(options)
    except (orjson.JSONDecodeError, ValueError, TypeError) as exc:
        raise ApiError(400, "invalid_request", f"invalid builder config: {exc}") from exc
    return BuilderSpec(strategy=builder, config=options)


TrajectoryFormat = Literal["polar", "atif"]


def _trajectory_json(session_id: str, records: list[CompletionRecord], spec: BuilderSpec,
                     fmt: TrajectoryFormat = "polar") -> bytes:
    """CPU work (building and serializing), run in a thread so the event loop keeps serving model calls."""
    traj = build_trajectory(CompletionSession(session_id=session_id, completions=records), spec)
    if fmt == "atif":
        return orjson.dumps(atif_json(traj, model_name=next((r.model for r in records if r.model), None)))
    return orjson.dumps(traj.model_dump())


@router.get("/sessions/{session_id}/completions")
async def completions(request: Request, session_id: str) -> Response:
    require_session_or_admin(request, session_id)
    records = await proxy_service(request).completions(session_id)
    return Response(orjson.dumps({"session_id": session_id, "completions": [r.model_dump() for r in records]}),
                    media_type="application/json")


@router.get("/sessions/{session_id}/trajectory")
async def trajectory(request: Request, session_id: str, builder: str = "prefix_merging",
                     config: str | None = Query(None, max_length=65536),
                     fmt: Annotated[TrajectoryFormat, Query(alias="format")] = "polar") -> Response:
    require_session_or_admin(request, session_id)
    service = proxy_service(request)
    spec = _builder_spec(builder, config, service.engine)
    records = await service.completions(session_id)
    body = await asyncio.to_thread(_trajectory_json, session_id, records, spec, fmt)
    return Response(body, media_type="application/json")
