"""The model APIs a harness calls, each answering in its provider's own shape, errors included (DESIGN invariant
3): Anthropic Messages (and count_tokens), OpenAI Chat Completions and Responses, Google generateContent (and
countTokens), the model listings, and provider detection for any other POST (``detect_router``: mounted last, its
catch-all would shadow every POST route after it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from polar_gym.proxy.detect import detect_provider, split_google_path
from polar_gym.proxy.errors import AuthError, PayloadTooLarge, RequestError
from polar_gym.proxy.providers.base import Route
from polar_gym.proxy.routes.common import disconnect_check, is_plain, proxy_service, read_body, send_reply, to_response
from polar_gym.proxy.service import Reply, session_key

__all__ = ["MODEL_ROUTES", "ModelCallShortcut", "detect_router", "router"]

#: path -> provider of the fixed model routes
MODEL_ROUTES = {
    "/v1/messages": "anthropic",
    "/v1/chat/completions": "openai_chat",
    "/chat/completions": "openai_chat",
    "/v1/responses": "openai_responses",
    "/responses": "openai_responses",
}

router = APIRouter()
detect_router = APIRouter()
_NO_QUERY: Mapping[str, str] = MappingProxyType({})
#: model paths whose admin-guard answer is kept (the fixed routes, and Google's per model and action)
_GUARDED_PATHS = 256


async def _keyed_body(request: Request, provider: str, route: Route) -> bytes | Response:
    """The body of a caller with a served key, else the refusal in the provider's shape. The key is checked first:
    a caller without one costs no buffering of up to ``max_body_bytes``."""
    service = proxy_service(request)
    try:
        service.sessions.resolve(session_key(request.headers, route.query))
        return await read_body(request, service.max_body_bytes)
    except (AuthError, PayloadTooLarge) as exc:
        return to_response(service.error_reply(exc, provider))


def _response(reply: Reply | Response) -> Response:
    return reply if isinstance(reply, Response) else to_response(reply)


async def model_call(request: Request, provider: str, route: Route) -> Response:
    return _response(await model_reply(request, provider, route))


async def model_reply(request: Request, provider: str, route: Route) -> Reply | Response:
    """The call's reply (a refusal of its key or body size as a Response)."""
    raw = await _keyed_body(request, provider, route)
    if isinstance(raw, Response):
        return raw
    return await proxy_service(request).handle(provider, raw, route, request.headers, disconnect_check(request))


async def count_call(request: Request, provider: str, route: Route) -> Response:
    raw = await _keyed_body(request, provider, route)
    if isinstance(raw, Response):
        return raw
    return to_response(await proxy_service(request).count_tokens(provider, raw, route, request.headers))


def _query(request: Request) -> Mapping[str, str]:
    """The call's query parameters (none, most calls: nothing to parse)."""
    return request.query_params if request.scope.get("query_string") else _NO_QUERY


def _fixed_route(provider: str) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await model_call(request, provider, Route(request.url.path, query=_query(request)))

    return endpoint


for _path, _provider in MODEL_ROUTES.items():
    router.add_route(_path, _fixed_route(_provider), methods=["POST"], include_in_schema=False)


@router.post("/v1/messages/count_tokens", include_in_schema=False)
async def count_tokens(request: Request) -> Response:
    return await count_call(request, "anthropic", Route(request.url.path, query=_query(request)))


@router.post("/{version}/models/{rest:path}", include_in_schema=False)
async def google(request: Request, version: str, rest: str) -> Response:
    return await google_call(request)


async def google_call(request: Request) -> Response:
    return _response(await google_reply(request))


async def google_reply(request: Request) -> Reply | Response:
    path = request.scope["path"]  # as the fixed routes take it (``request.url`` builds the whole URL: ~5 us)
    split = split_google_path(path)
    if split is None:
        exc = RequestError(f"unsupported path {path}")
        return proxy_service(request).error_reply(exc, "google")
    model, action = split
    route = Route(path, model=model, action=action, query=_query(request))
    if action == "countTokens":
        return await count_call(request, "google", route)
    return await model_reply(request, "google", route)


def _is_google_path(path: str) -> bool:
    """What ``/{version}/models/{rest:path}`` matches."""
    parts = path.split("/", 3)
    return len(parts) == 4 and not parts[0] and "" not in parts[1:3] and parts[2] == "models" and parts[3] != ""


class ModelCallShortcut:
    """Model calls go straight to their endpoint, past FastAPI's routing, middleware and per-request machinery, for
    the same endpoint and the same answer: ``app`` (a :class:`ProxyApp`) asks :meth:`handled` before anything else
    runs. Only paths ``guarded`` leaves alone (BodyGuard checks their admin token) and only the routes this module
    serves (the app's own routes, e.g. a gateway's, never collide with them); everything else goes on to ``app``."""

    def __init__(self, guarded: Callable[[str, str], bool]) -> None:
        self.guarded = guarded
        #: the answers for model paths seen (a gateway mounts its routes first); bounded: a caller picks Google's paths
        self._guarded: dict[str, bool] = {}

    async def handled(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> bool:
        """Whether this was a model call, answered."""
        if scope["type"] != "http" or scope["method"] != "POST":
            return False
        path = scope["path"]
        provider = MODEL_ROUTES.get(path)
        if provider is None and not _is_google_path(path):
            return False
        guarded = self._guarded.get(path)
        if guarded is None:
            guarded = self.guarded("POST", path)
            if len(self._guarded) < _GUARDED_PATHS:
                self._guarded[path] = guarded
        if guarded:
            return False
        scope["app"] = app  # what starlette sets: the endpoints find the service through it
        request = Request(scope, receive)
        try:
            if provider is None:
                reply: Reply | Response = await google_reply(request)
            else:
                reply = await model_reply(request, provider, Route(path, query=_query(request)))
        except ClientDisconnect:  # hung up while sending its body: nobody to answer
            return True
        if isinstance(reply, Reply) and is_plain(reply):
            await send_reply(reply, send)
        else:
            await _response(reply)(scope, receive, send)
        return True


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def root() -> dict[str, Any]:
    # Harnesses probe connectivity with HEAD / (Claude Code does) before their first call.
    return {"service": "polar_gym proxy"}


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    service = proxy_service(request)
    pool = service.engine.pool
    return {"status": "ok", "engine": service.engine.name, "paused": pool.paused,
            "upstreams": [s.url for s in pool.servers()], "stats": service.stats}


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    # One shape that both the OpenAI and the Anthropic SDKs parse.
    data = [{"id": name, "object": "model", "type": "model", "created": 0, "created_at": "1970-01-01T00:00:00Z",
             "display_name": name, "owned_by": "polar_gym"} for name in proxy_service(request).model_names]
    return {"object": "list", "data": data, "has_more": False,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


@router.get("/v1beta/models")
async def google_models(request: Request) -> dict[str, Any]:
    return {"models": [{"name": f"models/{name}", "displayName": name,
                        "supportedGenerationMethods": ["generateContent", "streamGenerateContent"]}
                       for name in proxy_service(request).model_names]}


@detect_router.post("/{path:path}", include_in_schema=False)
async def detected(request: Request, path: str) -> Response:
    service = proxy_service(request)
    try:
        raw = await read_body(request, service.max_body_bytes)
    except PayloadTooLarge as exc:
        return to_response(service.error_reply(exc, "openai_chat"))
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        body = None
    provider = detect_provider("/" + path, request.headers, body)
    if provider is None:
        return JSONResponse({"error": {"message": f"no provider protocol recognised for POST /{path}",
                                       "type": "invalid_request_error", "param": None, "code": None}},
                            status_code=404)
    return to_response(await service.handle(provider, raw, Route("/" + path, query=request.query_params),
                                            request.headers, disconnect_check(request)))
