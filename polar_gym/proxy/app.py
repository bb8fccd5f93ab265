"""The proxy's HTTP app (FastAPI), assembled from the routers in polar_gym.proxy.routes. Model routes read the raw
body and hand it to the service, answering in their provider's shape; admin routes need the admin token
(invariant 4: nothing administrative is open by default), checked before their body is read
(polar_gym.httpguard.BodyGuard through polar_gym.web.install), their bodies are capped, and they answer in the
polar_gym.web error envelope.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence

from fastapi import APIRouter, FastAPI
from starlette.types import Receive, Scope, Send

import polar_gym
from polar_gym.httpguard import TokenCheck
from polar_gym.proxy.routes import admin, models, sessions
from polar_gym.proxy.routes.models import ModelCallShortcut
from polar_gym.proxy.service import ProxyService
from polar_gym.web import AdminRoutes, install

__all__ = ["ProxyApp", "create_app", "is_model_route", "tune_gc_for_serving"]

#: collect the youngest generation every 50,000 net allocations instead of 700: a call parses a ~100 KB body
#: into tens of thousands of containers (freed by reference counting, not cycles), which otherwise run the
#: cyclic collector dozens of times per call
GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc_for_serving() -> None:
    """For a serving process, once everything is imported and built: move the start-up heap (modules, schemas,
    the app) out of the cyclic collector's sight (``gc.freeze``), so full collections scan only what requests
    keep, and collect less often (issue 18's profile: the collector on the stack in 16-18 % of samples at 64
    concurrent calls). Not for test processes: frozen objects' cycles are never collected."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


#: GET paths a harness reads (connectivity probe, model lists); every other GET is the operator's
_SANDBOX_GETS = frozenset({"/", "/v1/models", "/v1beta/models"})
#: POST paths that are not model calls (the admin and session APIs of the proxy and the gateway)
_NOT_MODEL_POSTS = ("/admin/", "/sessions", "/gateway/")


def is_model_route(method: str, path: str) -> bool:
    """Whether a request is one a harness makes: a model call (any POST but the admin and session APIs: provider
    detection takes any path), a model list, or ``/`` (Claude Code's HEAD probe)."""
    if method == "POST":
        return not path.startswith(_NOT_MODEL_POSTS)
    if method in ("GET", "HEAD"):
        return path in _SANDBOX_GETS or path.startswith("/v1beta/models/")
    return False


_NOT_FOUND = b'{"error":{"type":"not_found","message":"not found"}}'


class ProxyApp(FastAPI):
    """The proxy's FastAPI app, whose model calls skip starlette's middleware stack (error middleware, FastAPI's
    telemetry, routing): :class:`ModelCallShortcut` answers them first. Everything else is FastAPI as usual.

    ``sandbox_peer`` (a gateway sets it): whether a connection's peer address is a sandbox's; such a caller is
    answered its model routes only (404 for health, metrics, the OpenAPI schema, captures and the admin API)."""

    model_calls: ModelCallShortcut | None = None
    sandbox_peer: Callable[[tuple[str, int] | None], bool] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.sandbox_peer is not None and scope["type"] in ("http", "websocket")
                and not (scope["type"] == "http" and is_model_route(scope["method"], scope["path"]))
                and self.sandbox_peer(scope.get("client"))):
            await _refuse(scope, send)
            return
        if self.model_calls is not None and await self.model_calls.handled(self, scope, receive, send):
            return
        await super().__call__(scope, receive, send)


async def _refuse(scope: Scope, send: Send) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    await send({"type": "http.response.start", "status": 404, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(_NOT_FOUND)).encode())]})
    await send({"type": "http.response.body", "body": _NOT_FOUND})


def create_app(service: ProxyService, admin_token: str | None = None, *,
               routers: Sequence[APIRouter] = (), title: str = "polar_gym proxy",
               max_admin_body_bytes: int = 16 * 1024 * 1024) -> ProxyApp:
    """The proxy app. ``routers`` (e.g. the gateway's session API) are mounted before the model routes, so the
    catch-all ``POST /{path}`` provider detection cannot shadow them. Every route that declares
    ``polar_gym.web.require_admin`` (and anything under ``/admin/``) has its token checked before its body is read
    and its body capped at ``max_admin_body_bytes``."""
    app = ProxyApp(title=title, version=polar_gym.__version__)
    app.state.service = service
    for router in (*routers, models.router, sessions.router, admin.router, models.detect_router):
        app.include_router(router)
    declared = AdminRoutes(app)

    def admin_only(method: str, path: str) -> bool:
        return path.startswith("/admin/") or declared(method, path)

    install(app, TokenCheck(admin_token), needs_token=admin_only,
            limit=lambda method, path: max_admin_body_bytes if admin_only(method, path) else None)
    app.model_calls = ModelCallShortcut(guarded=admin_only)
    return app
