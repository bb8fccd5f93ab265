"""The gateway's HTTP app: the proxy's app (model APIs, captures, /admin/*) with the session API of
polar_gym.gateway.routes in front of its catch-all route, so harnesses, the rollout server and trainers talk to
one server. Admin routes check the token before reading their body and cap it (polar_gym.web through the proxy's
app)."""

from __future__ import annotations

from fastapi import FastAPI

from polar_gym.gateway.config import GatewayConfig
from polar_gym.gateway.node import GatewayNode
from polar_gym.gateway.routes import admin_router, metrics_router, sessions_router
from polar_gym.gateway.sandbox import SandboxStages
from polar_gym.gateway.telemetry import GatewayTelemetry
from polar_gym.proxy.app import create_app
from polar_gym.proxy.service import ProxyService
from polar_gym.runtime.relay import is_relay_peer

__all__ = ["build_gateway", "create_gateway_app"]


def create_gateway_app(node: GatewayNode, service: ProxyService, admin_token: str | None) -> FastAPI:
    """The proxy's app with the session API in front of its catch-all route. A connection from a sandbox (through
    its relay, polar_gym.runtime.relay) gets the model routes only: health, metrics and the schema are the
    operator's, who reads them from the host on the same port."""
    app = create_app(service, admin_token, routers=[admin_router, sessions_router, metrics_router],
                     title="polar_gym gateway")
    app.sandbox_peer = is_relay_peer
    app.state.node = node
    return app


def build_gateway(service: ProxyService, config: GatewayConfig, admin_token: str | None) -> tuple[GatewayNode, FastAPI]:
    """A node with the real stage functions, and its app. The service must serve registered keys only."""
    if service.sessions.allow_adhoc:
        raise ValueError("a gateway serves registered sessions only: use SessionRegistry(allow_adhoc=False)")
    telemetry = None
    if config.telemetry is not None and config.telemetry.enabled:  # spans of sessions, stages and model calls
        telemetry = GatewayTelemetry(config.telemetry, service.journal.records)
    node = GatewayNode(SandboxStages(service, config), config, telemetry)
    return node, create_gateway_app(node, service, admin_token)
