"""A whole fleet in this event loop: a rollout server and one registered gateway node (proxy + sandboxes), each on
its own loopback port. ``launcher=local``, ``python -m polar_gym.env serve`` and trainer tests run it; a Slurm
server job runs :func:`rollout_server` alone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

from polar_gym.fleet.settings import InferenceSettings
from polar_gym.gateway import build_gateway
from polar_gym.gateway.config import GatewayConfig, GatewayPools
from polar_gym.gateway.registration import ServerLink
from polar_gym.private_files import private_dir, write_secret
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.settings import build_engine
from polar_gym.runtime.base import GatewayEndpoint
from polar_gym.server import RolloutServer, Store, create_server_app
from polar_gym.serving import free_port, serving
from polar_gym.settings import ConfigError
from polar_gym.telemetry import TelemetrySettings

__all__ = ["local_fleet", "rollout_server", "write_server_info"]


@contextlib.asynccontextmanager
async def rollout_server(db: Path | str, host: str, port: int, admin_token: str,
                         heartbeat: float = 1.0, worker: str = "main") -> AsyncIterator[str]:
    """A rollout server (SQLite store at ``db``, mode 600: it holds the gateways' admin tokens; or the PostgreSQL
    URL several workers share, polar_gym.fleet.server_workers) served on ``host:port`` while the block runs; yields
    its URL."""
    if isinstance(db, Path):
        await asyncio.to_thread(private_dir, db.parent)  # the Store makes the db 0600
    store = Store(db)
    server = RolloutServer(store, heartbeat_interval=heartbeat, dead_after=max(10.0, heartbeat * 5), worker=worker)
    await server.start()
    try:
        async with serving(create_server_app(server, admin_token, manage_lifecycle=False), host, port) as url:
            yield url
    finally:
        await server.stop()
        store.close()


@contextlib.asynccontextmanager
async def local_fleet(out_dir: Path, inference: InferenceSettings, *, host: str = "127.0.0.1", gateway_port: int = 0,
                      server_port: int = 0, heartbeat: float = 1.0,
                      pools: GatewayPools | None = None,
                      telemetry: TelemetrySettings | None = None,
                      state_dir: Path | None = None,
                      hold_model_calls: bool = False) -> AsyncIterator[tuple[str, str]]:
    """A rollout server and one registered gateway node (proxy + sandboxes) in this event loop, on ``host``;
    yields the server's URL and admin token (also written to ``out_dir/server.json``). Everything is stopped and
    torn down when the block ends; ``telemetry``: the gateway's OpenTelemetry spans; ``state_dir``: where the
    server's store goes (default: out_dir); ``hold_model_calls``: model calls wait for the first weight update (a
    resumed GRPO run: the sessions the store queues again start at once, and must not sample before the trainer
    pushes its weights). The run's folders are owner-only (they hold prompts and completions).
    Raises ConfigError (keys below ``inference.``) for an engine that cannot be built."""
    for folder in (out_dir, out_dir / "capture", out_dir / "gateway"):
        await asyncio.to_thread(private_dir, folder)
    try:
        engine = build_engine(inference)
    except ConfigError as exc:
        raise exc.under("inference") from None
    if hold_model_calls:
        engine.pool.hold()
    service = ProxyService(engine, CaptureJournal(out_dir / "capture"), SessionRegistry(allow_adhoc=False),
                           max_tokens_cap=inference.max_tokens_cap)
    port = gateway_port or free_port(host)
    config = GatewayConfig(workdir=out_dir / "gateway", endpoint=GatewayEndpoint(host, port),
                           telemetry=telemetry, **dict(pools or GatewayPools()))
    gateway_token, server_token = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    node, app = build_gateway(service, config, gateway_token)
    try:
        async with (serving(app, host, port) as gateway_url,
                    rollout_server((state_dir or out_dir) / "server.sqlite", host, server_port or free_port(host),
                                   server_token, heartbeat) as server_url):
            write_server_info(out_dir, server_url, server_token)
            link = ServerLink(server_url, gateway_url, config.dispatch_capacity(), server_token=server_token,
                              gateway_token=gateway_token, health=node.health, interval=heartbeat)
            link.start()
            try:
                await asyncio.wait_for(link.registered.wait(), 60.0)
                yield server_url, server_token
            finally:  # before the server stops: a heartbeat to a stopped server was logged as a lost server
                await link.drain_and_close()
    finally:
        await node.stop("fleet stopped")
        service.journal.close()
        await engine.aclose()


def write_server_info(out_dir: Path, url: str, admin_token: str) -> Path:
    """``server.json`` (mode 600): where the run's rollout server listens and its token, for a trainer or curl."""
    return write_secret(out_dir / "server.json", json.dumps({"url": url, "admin_token": admin_token}) + "\n")
