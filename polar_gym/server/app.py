"""The rollout server's HTTP app, assembled from the routers in polar_gym.server.routes (the API is listed there).
Everything but /metrics, /health and the OpenAPI docs needs the admin token (the trace viewer under /view
checks it itself, so a browser can use the HttpOnly cookie that ``/view/?token=`` hands out).

Input is bounded before a route sees it (polar_gym.httpguard through polar_gym.web.install): the token is checked
before the body is read, bodies are capped (``max_body_bytes``), validation errors quote only excerpts, query
parameters have ranges, and backend URLs must be http(s) URLs with a host. Refusals, and the RolloutServer's
ServerError, answer in the polar_gym.web error envelope.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

import polar_gym
from polar_gym.httpguard import TokenCheck
from polar_gym.server.core import RolloutServer, ServerError
from polar_gym.server.routes import (
    backends_router,
    gateways_router,
    health_router,
    sessions_router,
    tasks_router,
)
from polar_gym.server.viewer import lazy_source
from polar_gym.view.router import PREFIX as VIEW_PREFIX
from polar_gym.view.router import ViewerAuth, viewer_router
from polar_gym.web import error_response, install

__all__ = ["OPEN_PATHS", "create_server_app"]

#: routes anyone may call (everything else needs the admin token, checked before the body is read)
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, ServerError):
        return error_response(exc.status, exc.kind, str(exc))
    return error_response(500, "internal", "internal server error")


async def _hung_up(request: Request, exc: Exception) -> JSONResponse:
    """A client that hung up while sending its body (a gateway stopping mid-heartbeat): nobody reads the answer, and
    it is no server error to log with a traceback."""
    return error_response(400, "client_disconnected", "the client hung up while sending its request")


def create_server_app(server: RolloutServer, admin_token: str, *, manage_lifecycle: bool = True,
                      max_body_bytes: int = 16 * 1024 * 1024) -> FastAPI:
    """The app; with ``manage_lifecycle`` its lifespan starts and stops the server's loops. Only a hash of the
    admin token is kept; request bodies over ``max_body_bytes`` are refused (413)."""
    if not admin_token:
        raise ValueError("the rollout server needs an admin token")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            await server.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                await server.stop()

    app = FastAPI(title="polar_gym rollout server", version=polar_gym.__version__, lifespan=lifespan)
    app.state.server = server
    for router in (tasks_router, sessions_router, gateways_router, backends_router, health_router):
        app.include_router(router)
    # the trace viewer (GETs only): its routes check the admin token themselves, or the cookie ?token= hands out
    app.include_router(viewer_router(lazy_source(lambda: server.store), ViewerAuth(TokenCheck(admin_token))))
    install(app, TokenCheck(admin_token), needs_token=lambda method, path: path not in OPEN_PATHS and not (
                method == "GET" and (path == VIEW_PREFIX or path.startswith(VIEW_PREFIX + "/"))),
            limit=lambda method, path: max_body_bytes)
    app.add_exception_handler(ServerError, _server_error)
    app.add_exception_handler(ClientDisconnect, _hung_up)
    return app
