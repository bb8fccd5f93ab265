"""What our own HTTP APIs share (the rollout server's, the gateway's session API, the proxy's admin and capture
routes): one admin-auth dependency, one error envelope and the handlers that answer in it.

    {"error": {"type": "<kind>", "message": "<what went wrong>"}}

401 without the admin token, 413 over a body cap, 422 on invalid input (validation errors quoted by excerpt, never
the whole input), FastAPI's own refusals (404, 405, ...) and every ``ApiError``: all in that envelope, which the
OpenAI SDK also reads (``error.message``, ``error.type``). The proxy's model routes are not among these APIs: they
answer in their provider's own error shape (DESIGN invariant 3).

Auth, two layers. ``install`` puts ``httpguard.BodyGuard`` in front of routing, so the token is checked before a
byte of the body is read (FastAPI reads and parses a body before dependencies run). Each admin route also declares
``Depends(require_admin)``, which reads the app's ``TokenCheck`` from ``app.state`` (no token configured: every
admin route refuses), so a router mounted without the middleware is not open. ``AdminRoutes`` derives the
middleware's rule from those declarations.

Ground layer: imports only polar_gym.httpguard.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute, iter_route_contexts
from starlette.exceptions import HTTPException as StarletteHTTPException

from polar_gym.httpguard import BodyGuard, TokenCheck, excerpt, safe_validation_errors

__all__ = [
    "ADMIN_ONLY",
    "ADMIN_TOKEN_MESSAGE",
    "AdminRoutes",
    "ApiError",
    "RouteInfo",
    "error_body",
    "error_response",
    "install",
    "is_admin",
    "require_admin",
    "route_table",
]

ADMIN_TOKEN_MESSAGE = "this endpoint needs the admin token (x-admin-token header)"

_CLOSED = TokenCheck(None)


class ApiError(StarletteHTTPException):
    """A refusal of one of our APIs: its status, a short machine-readable ``kind`` and a message for people.
    An HTTPException, so even an app without ``install``'s handlers answers with the right status."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(status, detail=message)
        self.kind = kind
        self.message = message


def error_body(kind: str, message: Any) -> dict[str, Any]:
    return {"error": {"type": kind, "message": message}}


def error_response(status: int, kind: str, message: Any) -> JSONResponse:
    return JSONResponse(error_body(kind, message), status_code=status)


def is_admin(request: Request) -> bool:
    """Whether the request carries the app's admin token (``app.state.admin_token``, a TokenCheck)."""
    token = getattr(request.app.state, "admin_token", None)
    check = token if isinstance(token, TokenCheck) else _CLOSED
    return check.admits(request.scope.get("headers", ()))


async def require_admin(request: Request) -> None:
    """The dependency every admin-only route declares (async: a sync dependency would cost a worker thread)."""
    if not is_admin(request):
        raise ApiError(401, "unauthorized", ADMIN_TOKEN_MESSAGE)


#: ``dependencies=ADMIN_ONLY`` on a route or a router
ADMIN_ONLY = [Depends(require_admin)]


@dataclass(frozen=True)
class RouteInfo:
    """One route of an app as routing sees it (after router prefixes): its path, methods, regex, and whether it
    declares ``require_admin``."""

    path: str
    methods: frozenset[str]
    regex: re.Pattern[str]
    admin: bool

    def matches(self, method: str, path: str) -> bool:
        return method in self.methods and self.regex.match(path) is not None


def _declares_admin(dependant: Dependant | None) -> bool:
    stack = list(dependant.dependencies) if dependant is not None else []
    while stack:
        dep = stack.pop()
        if dep.call is require_admin:
            return True
        stack.extend(dep.dependencies)
    return False


def route_table(app: FastAPI) -> list[RouteInfo]:
    """The app's routes in routing order, included routers flattened; ``admin`` when the route declares
    ``require_admin`` (on itself, its router, its inclusion, or in a nested dependency)."""
    table = []
    for context in iter_route_contexts(app.routes):
        regex, methods = getattr(context, "path_regex", None), getattr(context, "methods", None)
        if regex is None or not methods:
            continue
        admin = isinstance(context.original_route, APIRoute) and _declares_admin(getattr(context, "dependant", None))
        table.append(RouteInfo(str(context.path), frozenset(methods), regex, admin))
    return table


class AdminRoutes:
    """``(method, path) -> bool`` for BodyGuard: whether the route that serves the request declares
    ``require_admin``. Routing is replayed in order (the first route matching path and method wins, as in
    Starlette), so a public route is never made to ask for the token by an admin route it shadows. The route table
    is read at the first request, once every router is included."""

    def __init__(self, app: FastAPI) -> None:
        self._app = app
        self._table: list[RouteInfo] | None = None
        self._admin: list[RouteInfo] = []

    def __call__(self, method: str, path: str) -> bool:
        if self._table is None:
            self._table = route_table(self._app)
            self._admin = [route for route in self._table if route.admin]
        if not any(route.matches(method, path) for route in self._admin):
            return False  # the common case (a model call), decided without replaying the routing
        return next((route.admin for route in self._table if route.matches(method, path)), False)


def _reject(status: int, kind: str, message: str) -> tuple[bytes, str]:
    """BodyGuard's refusals (401, 413, a malformed content-length) in the envelope."""
    return orjson.dumps(error_body(kind, message)), "application/json"


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """ApiError, and FastAPI's own refusals (an unknown route, a wrong method) in the envelope."""
    if not isinstance(exc, StarletteHTTPException):
        return error_response(500, "internal", "internal server error")
    if isinstance(exc, ApiError):
        return error_response(exc.status_code, exc.kind, exc.message)
    status = exc.status_code
    return JSONResponse(error_body("invalid_request" if status < 500 else "internal", excerpt(exc.detail, 300)),
                        status_code=status, headers=exc.headers)  # e.g. Allow on a 405


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's default answer echoes the whole input; this one quotes excerpts."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    return error_response(422, "invalid_request", safe_validation_errors(errors))


def install(app: FastAPI, admin_token: TokenCheck, *, needs_token: Callable[[str, str], bool],
            limit: Callable[[str, str], int | None]) -> None:
    """What every API of ours has: the admin TokenCheck in ``app.state.admin_token`` (read by ``require_admin``),
    BodyGuard in front of routing (``needs_token``: checked before the body is read; ``limit``: body caps; its
    refusals in the envelope) and the envelope's exception handlers."""
    app.state.admin_token = admin_token
    app.add_middleware(BodyGuard, token=admin_token, needs_token=needs_token, limit=limit, reject=_reject)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
