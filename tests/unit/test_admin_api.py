"""One admin auth and one error envelope for the three apps (proxy, rollout server, gateway): every route that
declares ``polar_gym.web.require_admin`` answers 401 in the same envelope without the token, before a byte of its
body is read; every route of each app is either such an admin route or one we listed as public on purpose; a router
mounted without the app's middleware is still protected by its dependency; FastAPI's own refusals share the
envelope. The route lists come from the apps' route tables, so a route added later is covered without a new test.

The apps here hold stand-ins that fail the test when touched: a refused request must not reach any service."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, cast

import httpx
import pytest
from fastapi import APIRouter, FastAPI

from polar_gym.gateway.api import create_gateway_app
from polar_gym.gateway.node import GatewayNode
from polar_gym.gateway.routes import admin_router as gateway_admin_router
from polar_gym.httpguard import BodyGuard, TokenCheck
from polar_gym.proxy.app import create_app
from polar_gym.proxy.routes import admin as proxy_admin
from polar_gym.proxy.service import ProxyService
from polar_gym.server import routes as server_routes
from polar_gym.server.app import OPEN_PATHS, create_server_app
from polar_gym.server.core import RolloutServer
from polar_gym.web import ADMIN_TOKEN_MESSAGE, route_table

ADMIN = "one-admin-token"
UNAUTHORIZED = {"error": {"type": "unauthorized", "message": ADMIN_TOKEN_MESSAGE}}


class Untouchable:
    """A service stand-in: any use of it fails the test."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a refused request reached the service ({name})")


def proxy_app() -> FastAPI:
    return create_app(cast(ProxyService, Untouchable()), ADMIN)


def server_app() -> FastAPI:
    return create_server_app(cast(RolloutServer, Untouchable()), ADMIN, manage_lifecycle=False)


def gateway_app() -> FastAPI:
    return create_gateway_app(cast(GatewayNode, Untouchable()), cast(ProxyService, Untouchable()), ADMIN)


APPS: dict[str, Callable[[], FastAPI]] = {"proxy": proxy_app, "server": server_app, "gateway": gateway_app}

_DOCS = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
_PROXY_PUBLIC = _DOCS | {"/v1/messages", "/v1/chat/completions", "/chat/completions", "/v1/responses", "/responses",
                         "/v1/messages/count_tokens", "/{version}/models/{rest:path}", "/", "/health", "/v1/models",
                         "/v1beta/models", "/{path:path}",
                         # the session's own key or the admin token (checked in the route)
                         "/sessions/{session_id}/completions", "/sessions/{session_id}/trajectory"}
#: routes that do not need the admin token, on purpose
PUBLIC = {
    "proxy": _PROXY_PUBLIC,
    # the trace viewer checks the admin token or its cookie in the route (tests/view/test_view_server.py)
    "server": set(OPEN_PATHS) | {"/view", "/view/", "/view/static/{name}", "/view/api/run", "/view/api/sessions",
                                 "/view/api/sessions/{session_id}",
                                 "/view/api/sessions/{session_id}/traces/{index}/tokens",
                                 "/view/api/sessions/{session_id}/traces/{index}/prompt"},
    "gateway": _PROXY_PUBLIC | {"/gateway/health", "/metrics", "/sessions/{session_id}",
                                "/sessions/{session_id}/result"},
}


def concrete(path: str) -> str:
    """A request path for a route path: every parameter filled in."""
    out, depth = "", 0
    for char in path:
        if char == "{":
            depth += 1
            out += "x"
        elif char == "}":
            depth -= 1
        elif not depth:
            out += char
    return out


def admin_routes() -> list[tuple[str, str, str]]:
    return [(name, method, route.path) for name, make in APPS.items() for route in route_table(make())
            if route.admin for method in sorted(route.methods)]


def test_every_app_has_admin_routes_and_classifies_every_route() -> None:
    for name, make in APPS.items():
        table = route_table(make())
        assert any(route.admin for route in table), name
        unclassified = [(route.path, sorted(route.methods)) for route in table
                        if not route.admin and route.path not in PUBLIC[name]]
        assert not unclassified, f"{name}: routes neither admin nor listed as public: {unclassified}"
    assert {path for _, _, path in admin_routes()} >= {"/admin/sessions", "/tasks", "/backends", "/sessions/poll",
                                                      "/gateway/drain", "/gateways/{gateway_id}/heartbeat"}


async def _asgi(app: FastAPI, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
    """One request whose declared 50 MB body never arrives: an app that waited for it would hang here."""
    never = asyncio.Event()
    started: dict[str, Any] = {}
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        await never.wait()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            started.update(message)
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "root_path": "", "scheme": "http", "query_string": b"",
             "server": ("test", 80), "client": ("127.0.0.1", 1),
             "headers": [(b"host", b"test"), (b"content-type", b"application/json"),
                         (b"content-length", str(50 * 2**20).encode()), *headers]}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return started["status"], b"".join(chunks)


@pytest.mark.parametrize(("app_name", "method", "path"), admin_routes())
@pytest.mark.parametrize("token", [None, b"wrong", "tökén".encode(), b"\xff\x00", ADMIN.encode() + b"\x80"],
                         ids=["none", "wrong", "non-ascii", "bytes", "suffixed"])
async def test_every_admin_route_refuses_without_the_token_before_reading_the_body(
        monkeypatch: pytest.MonkeyPatch, app_name: str, method: str, path: str, token: bytes | None) -> None:
    monkeypatch.setattr(BodyGuard, "drain_seconds", 0.0)
    headers = [] if token is None else [(b"x-admin-token", token)]
    status, body = await _asgi(APPS[app_name](), method, concrete(path), headers)
    assert (status, json.loads(body)) == (401, UNAUTHORIZED), (app_name, method, path)


ADMIN_ROUTERS: dict[str, APIRouter] = {"proxy.admin": proxy_admin.router, "server.tasks": server_routes.tasks_router,
                 "server.sessions": server_routes.sessions_router, "server.gateways": server_routes.gateways_router,
                 "server.backends": server_routes.backends_router, "gateway.admin": gateway_admin_router}


@pytest.mark.parametrize("router_name", sorted(ADMIN_ROUTERS))
async def test_a_router_mounted_without_the_middleware_is_still_protected(router_name: str) -> None:
    """No BodyGuard, no handlers, no token configured: closed. With a token configured: the wrong one is refused
    and the right one gets past the dependency."""
    bare = FastAPI()
    bare.include_router(ADMIN_ROUTERS[router_name])
    routes = [(method, concrete(route.path)) for route in route_table(bare) if route.admin
              for method in sorted(route.methods)]
    assert routes and all(route.admin for route in route_table(bare) if route.path not in _DOCS)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(bare, raise_app_exceptions=False),
                                 base_url="http://bare") as client:
        for method, path in routes:
            resp = await client.request(method, path, json={}, headers={"x-admin-token": ADMIN})
            assert resp.status_code == 401, (method, path, resp.text)  # no token configured: every admin route shut
        bare.state.admin_token = TokenCheck(ADMIN)
        for method, path in routes:
            resp = await client.request(method, path, json={}, headers={"x-admin-token": "wrong"})
            assert resp.status_code == 401, (method, path, resp.text)
            resp = await client.request(method, path, json={}, headers={"x-admin-token": ADMIN})
            assert resp.status_code != 401, (method, path, resp.text)


@pytest.mark.parametrize("app_name", sorted(APPS))
async def test_refusals_share_the_envelope(app_name: str) -> None:
    """With the token: an unknown route, a wrong method and an invalid body, each in the same envelope."""
    app = APPS[app_name]()
    admin = {"x-admin-token": ADMIN}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app, raise_app_exceptions=False),
                                 base_url="http://app") as client:
        missing = await client.get("/admin/nothing-here", headers=admin)  # the proxy's catch-all is POST: 405
        assert missing.status_code in (404, 405) and set(missing.json()["error"]) == {"type", "message"}
        invalid_path = {"proxy": "/admin/upstreams", "server": "/backends", "gateway": "/sessions/poll"}[app_name]
        invalid = await client.post(invalid_path, json={"url": ["x" * 10_000]}, headers=admin)
        assert invalid.status_code == 422 and invalid.json()["error"]["type"] == "invalid_request"
        assert len(invalid.content) < 4000  # excerpts, never the whole input
        wrong_method = await client.put("/health", headers=admin)
        assert wrong_method.status_code == 405 and set(wrong_method.json()["error"]) == {"type", "message"}
        assert "GET" in wrong_method.headers["allow"]


def test_modules_export_what_they_list() -> None:
    import importlib

    for name in ["polar_gym.web", "polar_gym.serving", "polar_gym.prometheus", "polar_gym.proxy.routes",
                 "polar_gym.proxy.routes.models", "polar_gym.proxy.routes.sessions", "polar_gym.proxy.routes.admin",
                 "polar_gym.proxy.routes.common", "polar_gym.server.routes", "polar_gym.gateway.routes",
                 "polar_gym.gateway.metrics", "polar_gym.server.metrics"]:
        module = importlib.import_module(name)
        missing = [each for each in module.__all__ if not hasattr(module, each)]
        assert not missing, (name, missing)
