"""The proxy's HTTP app (FastAPI), assembled from the routers in polar_gym.proxy.routes. Model routes read the raw
body and hand it to the service, answering in their provider's shape; admin routes need the admin token
(invariant 4: nothing administrative is open by default), checked before their body is read
(polar_gym.httpguard.BodyGuard through polar_gym.web.install), their bodies are capped, and they answer in the
polar_gym.web error envelope.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

from fastapi import APIRouter, FastAPI
from starlette.types import Receive, Scope, Send

import polar_gym
from polar_gym.httpguard import TokenCheck
from polar_gym.proxy.routes import admin, models, sessions
from polar_gym.proxy.routes.models import ModelCallShortcut
from polar_gym.proxy.service import ProxyService
from polar_gym.web import AdminRoutes, install

__all__ = ["ProxyApp", "create_app", "tune_gc_for_serving"]

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


class ProxyApp(FastAPI):
    """The proxy's FastAPI app, whose model calls skip starlette's middleware stack (error middleware, FastAPI's
    telemetry, routing): :class:`ModelCallShortcut` answers them first. Everything else is FastAPI as usual."""

    model_calls: ModelCallShortcut | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.model_calls is not None and await self.model_calls.handled(self, scope, receive, send):
            return
        await super().__call__(scope, receive, send)


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
