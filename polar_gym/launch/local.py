"""``launcher=local``: a rollout server and a gateway node (the proxy plus staged sandboxes) in this process, each
served on loopback; the gateway registers with the server like a remote one, the tasks go through the server's API
and a rich live display shows the fleet while they run."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from rich.console import Console

from polar_gym.assets import tokenizer_dir
from polar_gym.gateway import GatewayConfig, build_gateway
from polar_gym.gateway.registration import ServerLink
from polar_gym.launch.config import ConfigError, InferenceSettings, LaunchJob
from polar_gym.launch.driver import RunDriver, run_job, sigterm_cancels_run
from polar_gym.launch.outputs import SessionOutcome, finish
from polar_gym.launch.preflight import ensure_upstreams, rollout_backends
from polar_gym.proxy.__main__ import build_engine, write_secret
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.base import Engine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.runtime.base import GatewayEndpoint
from polar_gym.server import RolloutServer, Store, create_server_app
from polar_gym.server.client import RolloutClient
from polar_gym.serving import free_port, serving

__all__ = ["LocalLauncher", "local_fleet", "make_engine", "rollout_server", "write_server_info"]


def make_engine(settings: InferenceSettings) -> Engine:
    """The proxy engine for the ``inference`` group (the same construction as ``python -m polar_gym.proxy``)."""
    tokenizer = Path(settings.tokenizer) if settings.tokenizer else None
    if tokenizer is None and settings.engine in ("oracle", "sglang_generate"):
        tokenizer = tokenizer_dir()
        if not (tokenizer / ".complete").exists():
            raise ConfigError(f"inference.tokenizer: the default tokenizer {tokenizer} is not built; run "
                              "`bash scripts/setup.sh` or set inference.tokenizer=DIR")
    args = argparse.Namespace(engine=settings.engine, upstream=settings.upstreams, tokenizer=tokenizer,
                              oracle_script=None, drift_every=settings.drift_every,
                              policy_version=settings.policy_version, upstream_timeout=settings.upstream_timeout,
                              await_upstreams=settings.await_upstreams,
                              upstream_model=settings.upstream_model)
    return build_engine(args)


@contextlib.asynccontextmanager
async def rollout_server(db: Path, host: str, port: int, admin_token: str,
                         heartbeat: float = 1.0) -> AsyncIterator[str]:
    """A rollout server (SQLite store at ``db``, mode 600: it holds the gateways' admin tokens) served on
    ``host:port`` while the block runs; yields its URL."""
    await asyncio.to_thread(db.parent.mkdir, parents=True, exist_ok=True)  # the Store makes the db 0600
    store = Store(db)
    server = RolloutServer(store, heartbeat_interval=heartbeat, dead_after=max(10.0, heartbeat * 5))
    await server.start()
    try:
        async with serving(create_server_app(server, admin_token, manage_lifecycle=False), host, port) as url:
            yield url
    finally:
        await server.stop()
        store.close()


def _plain(value: Any) -> Any:
    """Hydra hands nested nodes over as DictConfig / ListConfig; runtimes expect plain dicts and lists."""
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


class LocalLauncher:
    """Run a job on this machine the way a cluster runs it: a rollout server and one gateway node (proxy + staged
    sandboxes) in this process, each on its own loopback port; the gateway registers and heartbeats like a remote
    one and the tasks go through the server's API. Returns the exit code (1 if any session ended ERROR or
    CANCELLED)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, server_port: int = 0, init_workers: int = 4,
                 ready_buffer: int = 4, run_slots: int = 4, postrun_workers: int = 4, prewarm_workers: int = 2,
                 postrun_grace_seconds: float = 300.0, heartbeat_seconds: float = 1.0, progress: bool = True,
                 runtime_options: dict[str, Any] | None = None, expose_roots: list[str] | None = None) -> None:
        self.host = host
        self.port, self.server_port = port, server_port
        # runtime_options / expose_roots are the gateway's own configuration: the only place options that reach
        # the host (a container CLI, binds, limits) may come from (docs/security.md)
        self.pools = {"init_workers": init_workers, "ready_buffer": ready_buffer, "run_slots": run_slots,
                      "postrun_workers": postrun_workers, "prewarm_workers": prewarm_workers,
                      "postrun_grace_seconds": postrun_grace_seconds,
                      "runtime_options": _plain(runtime_options or {}),
                      "expose_roots": [Path(p) for p in _plain(expose_roots or [])]}
        try:  # refuse bad pool sizes now, before anything starts
            GatewayConfig(**self.pools)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ConfigError(f"launcher: {exc}") from None
        if heartbeat_seconds <= 0:
            raise ConfigError("launcher.heartbeat_seconds: must be positive")
        self.heartbeat = heartbeat_seconds
        self.progress = progress
        self.console = Console(stderr=True)

    def launch(self, job: LaunchJob) -> int:
        job.out_dir.mkdir(parents=True, exist_ok=True)
        write_secret(job.out_dir / "config.yaml", job.resolved_config)  # it may hold a key (runtime.env, ...)
        outcomes, wall = asyncio.run(self._run(job))
        return finish(self.console, job, outcomes, wall)

    async def _run(self, job: LaunchJob) -> tuple[list[SessionOutcome], float]:
        with sigterm_cancels_run():
            return await self._fleet(job)

    async def _fleet(self, job: LaunchJob) -> tuple[list[SessionOutcome], float]:
        settings = job.inference
        if not settings.await_upstreams:  # a wrong URL stops the launch before anything starts
            await ensure_upstreams(settings, settings.upstreams, self.console)
        async with local_fleet(job.out_dir, settings, host=self.host, gateway_port=self.port,
                               server_port=self.server_port, heartbeat=self.heartbeat,
                               **self.pools) as (server_url, server_token):
            self.console.print(f"rollout server {server_url} (token in {job.out_dir / 'server.json'})")
            async with RolloutClient(server_url, server_token) as client:
                if settings.await_upstreams:  # the policy may start after the fleet: wait for it (bounded)
                    await ensure_upstreams(settings, settings.upstreams, self.console,
                                           backends=functools.partial(rollout_backends, client))
                return await run_job(RunDriver(client, self.console, progress=self.progress), job)


@contextlib.asynccontextmanager
async def local_fleet(out_dir: Path, inference: InferenceSettings, *, host: str = "127.0.0.1", gateway_port: int = 0,
                      server_port: int = 0, heartbeat: float = 1.0,
                      **pools: Any) -> AsyncIterator[tuple[str, str]]:
    """A rollout server and one registered gateway node (proxy + sandboxes) in this event loop, on ``host``;
    yields the server's URL and admin token (also written to ``out_dir/server.json``). Everything is stopped and
    torn down when the block ends. Used by launcher=local, ``python -m polar_gym.env serve`` and trainer tests."""
    await asyncio.to_thread(out_dir.mkdir, parents=True, exist_ok=True)
    engine = make_engine(inference)
    service = ProxyService(engine, CaptureJournal(out_dir / "capture"), SessionRegistry(allow_adhoc=False),
                           max_tokens_cap=inference.max_tokens_cap)
    port = gateway_port or free_port(host)
    config = GatewayConfig(workdir=out_dir / "gateway", endpoint=GatewayEndpoint(host, port), **pools)
    gateway_token, server_token = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    node, app = build_gateway(service, config, gateway_token)
    link: ServerLink | None = None
    try:
        async with (serving(app, host, port) as gateway_url,
                    rollout_server(out_dir / "server.sqlite", host, server_port or free_port(host), server_token,
                                   heartbeat) as server_url):
            write_server_info(out_dir, server_url, server_token)
            link = ServerLink(server_url, gateway_url, config.run_slots, server_token=server_token,
                              gateway_token=gateway_token, health=node.health, interval=heartbeat)
            link.start()
            await asyncio.wait_for(link.registered.wait(), 60.0)
            yield server_url, server_token
    finally:
        if link is not None:
            await link.drain_and_close()
        await node.stop("fleet stopped")
        service.journal.close()
        await engine.aclose()


def write_server_info(out_dir: Path, url: str, admin_token: str) -> Path:
    """``server.json`` (mode 600): where the run's rollout server listens and its token, for a trainer or curl."""
    return write_secret(out_dir / "server.json", json.dumps({"url": url, "admin_token": admin_token}) + "\n")
