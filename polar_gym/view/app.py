"""The standalone viewer of a finished run: ``python -m polar_gym.view OUT_DIR``.

Loopback by default, and with a token (``python -m polar_gym.view`` makes a fresh one per start and prints the URL
that carries it, as Jupyter does): on a shared login node every user reaches every loopback port, and a run's
prompts and outputs are the user's own. A Host header that is not the address it listens on is refused, so a web
page in the same browser cannot reach it through a DNS name that re-binds to 127.0.0.1. Every answer, errors
included, carries the viewer's security headers.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import polar_gym
from polar_gym.httpguard import TokenCheck
from polar_gym.view.router import PREFIX, SECURITY_HEADERS, ViewerAuth, viewer_router
from polar_gym.view.source import OutDirSource, ViewSource
from polar_gym.web import install

__all__ = ["allowed_hosts", "create_view_app"]

_LOOPBACK = ["127.0.0.1", "localhost", "::1", "[::1]"]


def allowed_hosts(host: str) -> list[str]:
    """Host header values the app answers: loopback names, and ``host`` itself when bound elsewhere."""
    return _LOOPBACK + ([host] if host not in _LOOPBACK and host not in ("0.0.0.0", "::") else [])


class _SecurityHeaders:
    """Adds the viewer's headers to every response the app sends (404s and redirects too)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()
                         if k.lower().encode() not in names]
                message = {**message, "headers": list(message.get("headers", [])) + extra}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def create_view_app(source: ViewSource | str | Path, *, host: str = "127.0.0.1", token: str | None = None) -> FastAPI:
    """The viewer app over a run's folder (or any ViewSource). With ``token`` every route needs it (``/view/?token=``
    once in a browser, which sets the viewer cookie; or the x-admin-token header). The OpenAPI docs are off: the
    page is the UI."""
    if isinstance(source, str | Path):
        source = OutDirSource(source)
    app = FastAPI(title="polar_gym viewer", version=polar_gym.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.include_router(viewer_router(source, ViewerAuth(TokenCheck(token)) if token else None))

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse(f"{PREFIX}/", status_code=307)

    install(app, TokenCheck(None), needs_token=lambda method, path: False, limit=lambda method, path: 0)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(host))
    app.add_middleware(_SecurityHeaders)
    return app
