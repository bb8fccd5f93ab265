"""The proxy's HTTP surface (FastAPI). Thin: every model route reads the raw body and hands it to the service;
admin routes need the admin token (invariant 4: nothing administrative is open by default), checked before their
body is read (polar_gym.httpguard.BodyGuard), and their bodies are capped; validation errors quote only excerpts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, field_validator

from polar_gym.httpguard import (
    MAX_JSON_DEPTH,
    BodyGuard,
    TokenCheck,
    check_upstream_url,
    json_depth,
    safe_validation_errors,
)
from polar_gym.merge import MergeConfig, build_trajectory
from polar_gym.proxy.detect import detect_provider, split_google_path
from polar_gym.proxy.engines.base import Engine
from polar_gym.proxy.errors import AuthError, PayloadTooLarge, RequestError
from polar_gym.proxy.providers.base import Route
from polar_gym.proxy.service import ProxyService, Reply, SessionInfo, new_session_key, session_key
from polar_gym.registry import BUILDERS
from polar_gym.schema import BuilderSpec, CompletionRecord, CompletionSession

__all__ = ["create_app"]

_MODEL_ROUTES = {
    "/v1/messages": "anthropic",
    "/v1/chat/completions": "openai_chat",
    "/chat/completions": "openai_chat",
    "/v1/responses": "openai_responses",
    "/responses": "openai_responses",
}


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


def _to_response(reply: Reply) -> Response:
    if reply.stream is not None:
        return StreamingResponse(reply.stream, status_code=reply.status, media_type=reply.media_type,
                                 headers=reply.headers)
    return Response(reply.body, status_code=reply.status, media_type=reply.media_type, headers=reply.headers)


def _builder_spec(builder: str, config: str | None, engine: Engine) -> BuilderSpec:
    """The builder a trajectory request names: registered names only (a dotted path would import code chosen by the
    caller); end-of-turn IDs default to the engine tokenizer's."""
    if builder not in BUILDERS.names():
        raise RequestError(f"unknown builder {builder!r}; known builders: {', '.join(BUILDERS.names())}")
    try:
        options = orjson.loads(config) if config else {}
        if not isinstance(options, dict):
            raise ValueError("config must be a JSON object")
        eot = engine.end_of_turn_ids
        if eot and "end_of_turn_ids" not in options:
            options["end_of_turn_ids"] = list(eot)
        MergeConfig.from_dict(options)
    except (orjson.JSONDecodeError, ValueError, TypeError) as exc:
        raise RequestError(f"invalid builder config: {exc}") from exc
    return BuilderSpec(strategy=builder, config=options)


def _trajectory_json(session_id: str, records: list[CompletionRecord], spec: BuilderSpec) -> bytes:
    """CPU work (building and serializing), run in a thread so the event loop keeps serving model calls."""
    traj = build_trajectory(CompletionSession(session_id=session_id, completions=records), spec)
    return orjson.dumps(traj.model_dump())


def create_app(service: ProxyService, admin_token: str | None = None, *,
               routers: Sequence[APIRouter] = (), title: str = "polar_gym proxy",
               admin_paths: Callable[[str, str], bool] | None = None,
               max_admin_body_bytes: int = 16 * 1024 * 1024) -> FastAPI:
    """The proxy app. ``routers`` (e.g. the gateway's session API) are mounted before the model routes, so the
    catch-all ``POST /{path}`` provider detection cannot shadow them; they share the auth error handlers.
    ``admin_paths(method, path)`` names the routers' admin-only routes: like ``/admin/*``, their token is checked
    before the body is read and their bodies are capped at ``max_admin_body_bytes``."""
    app = FastAPI(title=title, version="0.1.0")
    app.state.service = service
    token = TokenCheck(admin_token)

    def admin_only(method: str, path: str) -> bool:
        return path.startswith("/admin/") or (admin_paths is not None and admin_paths(method, path))

    def render(status: int, kind: str, message: str) -> tuple[bytes, str]:
        exc = AuthError(message) if status == 401 else PayloadTooLarge(message) if status == 413 \
            else RequestError(message)
        return service.error_reply(exc, "openai_chat").body, "application/json"

    app.add_middleware(BodyGuard, token=token, needs_token=admin_only, reject=render,
                       limit=lambda method, path: max_admin_body_bytes if admin_only(method, path) else None)

    def is_admin(request: Request) -> bool:
        return token.configured and token.admits(request.scope.get("headers", ()))

    def require_admin(request: Request) -> None:
        if not is_admin(request):
            raise AuthError("admin endpoints need the x-admin-token header")

    def require_session_or_admin(request: Request, session_id: str) -> None:
        """A session's captures are readable with its own live key or the admin token (invariant 4): once the
        session's key is revoked, only with the admin token."""
        if not is_admin(request) and not service.sessions.may_read(session_key(request.headers,
                                                                               request.query_params), session_id):
            raise AuthError("a session's captures are readable with its own key while it runs, else the admin token")

    @app.exception_handler(AuthError)
    async def _auth_error(request: Request, exc: AuthError) -> Response:
        return _to_response(service.error_reply(exc, "openai_chat"))

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> Response:
        return _to_response(service.error_reply(exc, "openai_chat"))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        """FastAPI's default answer echoes the whole input; this one quotes excerpts."""
        return JSONResponse({"error": {"type": "invalid_request", "message": safe_validation_errors(exc.errors())}},
                            status_code=422)

    for router in routers:
        app.include_router(router)

    async def read_body(request: Request) -> bytes:
        """The body, refusing to buffer more than the limit (a declared or a streamed oversized body)."""
        limit = service.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def model_call(request: Request, provider: str, route: Route) -> Response:
        try:
            # the key before the body: a caller without a served key costs no buffering of up to max_body_bytes
            service.sessions.resolve(session_key(request.headers, route.query))
            raw = await read_body(request)
        except (AuthError, PayloadTooLarge) as exc:
            return _to_response(service.error_reply(exc, provider))
        return _to_response(await service.handle(provider, raw, route, request.headers))

    for path, provider in _MODEL_ROUTES.items():
        async def endpoint(request: Request, _provider: str = provider) -> Response:
            return await model_call(request, _provider, Route(request.url.path, query=request.query_params))

        app.add_api_route(path, endpoint, methods=["POST"], include_in_schema=False)

    @app.post("/v1/messages/count_tokens", include_in_schema=False)
    async def count_tokens(request: Request) -> Response:
        route = Route(request.url.path, query=request.query_params)
        return _to_response(await service.count_tokens("anthropic", await read_body(request), route, request.headers))

    @app.post("/{version}/models/{rest:path}", include_in_schema=False)
    async def google(request: Request, version: str, rest: str) -> Response:
        split = split_google_path(request.url.path)
        if split is None:
            exc = RequestError(f"unsupported path {request.url.path}")
            return _to_response(service.error_reply(exc, "google"))
        model, action = split
        route = Route(request.url.path, model=model, action=action, query=request.query_params)
        if action == "countTokens":
            return _to_response(await service.count_tokens("google", await read_body(request), route, request.headers))
        return await model_call(request, "google", route)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> dict[str, Any]:
        # Harnesses probe connectivity with HEAD / (Claude Code does) before their first call.
        return {"service": "polar_gym proxy"}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        pool = service.engine.pool
        return {"status": "ok", "engine": service.engine.name, "paused": pool.paused,
                "upstreams": [s.url for s in pool.servers()], "stats": service.stats}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        # One shape that both the OpenAI and the Anthropic SDKs parse.
        data = [{"id": name, "object": "model", "type": "model", "created": 0, "created_at": "1970-01-01T00:00:00Z",
                 "display_name": name, "owned_by": "polar_gym"} for name in service.model_names]
        return {"object": "list", "data": data, "has_more": False,
                "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}

    @app.get("/v1beta/models")
    async def google_models() -> dict[str, Any]:
        return {"models": [{"name": f"models/{name}", "displayName": name,
                            "supportedGenerationMethods": ["generateContent", "streamGenerateContent"]}
                           for name in service.model_names]}

    @app.get("/sessions/{session_id}/completions")
    async def completions(request: Request, session_id: str) -> Response:
        require_session_or_admin(request, session_id)
        records = await service.completions(session_id)
        return Response(orjson.dumps({"session_id": session_id, "completions": [r.model_dump() for r in records]}),
                        media_type="application/json")

    @app.get("/sessions/{session_id}/trajectory")
    async def trajectory(request: Request, session_id: str, builder: str = "prefix_merging",
                         config: str | None = Query(None, max_length=65536)) -> Response:
        require_session_or_admin(request, session_id)
        spec = _builder_spec(builder, config, service.engine)
        records = await service.completions(session_id)
        body = await asyncio.to_thread(_trajectory_json, session_id, records, spec)
        return Response(body, media_type="application/json")

    @app.post("/admin/sessions")
    async def register(request: Request, body: SessionRegistration) -> dict[str, Any]:
        require_admin(request)
        if json_depth([body.metadata, body.oracle]) > MAX_JSON_DEPTH:
            raise RequestError(f"session metadata nests JSON deeper than {MAX_JSON_DEPTH} levels")
        # the engine reads what it needs (the oracle its script) and refuses bad metadata before the key exists
        service.engine.open_session(body.session_id, {**body.metadata, "oracle": body.oracle})
        key = new_session_key()  # a fresh secret, never the session id (invariant 7)
        service.sessions.register(SessionInfo(body.session_id, body.model_name, body.metadata, key=key))
        return {"registered": body.session_id, "api_key": key}

    @app.delete("/admin/sessions/{session_id}")
    async def unregister(request: Request, session_id: str) -> dict[str, Any]:
        require_admin(request)
        service.engine.pool.forget(session_id)
        return {"unregistered": service.sessions.unregister(session_id)}

    @app.get("/admin/upstreams")
    async def upstreams(request: Request) -> dict[str, Any]:
        require_admin(request)
        pool = service.engine.pool
        return {"paused": pool.paused, "policy_version": pool.policy_version,
                "servers": [vars(s) for s in pool.servers()]}

    @app.post("/admin/upstreams")
    async def add_upstream(request: Request, body: UpstreamAdd) -> dict[str, Any]:
        require_admin(request)
        return {"added": service.engine.pool.add(body.url).url}

    @app.post("/admin/upstreams/remove")
    async def remove_upstream(request: Request, body: UpstreamChange) -> dict[str, Any]:
        require_admin(request)
        return {"removed": service.engine.pool.remove(body.url)}

    @app.post("/admin/pause")
    async def pause(request: Request) -> dict[str, Any]:
        require_admin(request)
        started = time.perf_counter()
        await service.engine.pool.pause()
        return {"paused": True, "drained_seconds": time.perf_counter() - started}

    @app.post("/admin/resume")
    async def resume(request: Request, body: Resume) -> dict[str, Any]:
        require_admin(request)
        service.engine.pool.resume(body.policy_version)
        return {"paused": False, "policy_version": service.engine.pool.policy_version}

    @app.post("/{path:path}", include_in_schema=False)
    async def detected(request: Request, path: str) -> Response:
        raw = await read_body(request)
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            body = None
        provider = detect_provider("/" + path, request.headers, body)
        if provider is None:
            return JSONResponse({"error": {"message": f"no provider protocol recognised for POST /{path}",
                                           "type": "invalid_request_error", "param": None, "code": None}},
                                status_code=404)
        return _to_response(await service.handle(provider, raw, Route("/" + path, query=request.query_params),
                                                 request.headers))

    return app
