"""``python -m polar_gym.env serve``: a long-lived rollout server plus one registered gateway node (proxy +
sandboxes) on loopback, for the NeMo Gym agent to submit sessions to when no Polar server is configured. Writes
``{"url", "admin_token", "pid"}`` to an info file (mode 600) once the gateway has registered, and stops cleanly on
SIGINT / SIGTERM or when ``parent_pid`` dies (so a killed Gym agent cannot leave it behind)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
from pathlib import Path

from polar_gym.gateway import GatewayConfig, build_gateway
from polar_gym.gateway.registration import ServerLink
from polar_gym.launch.config import InferenceSettings
from polar_gym.launch.local import _free_port, make_engine, rollout_server, serving, write_server_info
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.runtime.base import GatewayEndpoint

__all__ = ["serve"]


def _write_info(info_file: Path, url: str, token: str) -> None:
    """Atomically (rename) and privately (mode 600): the reader polls for the file and must never see half of it."""
    tmp = info_file.with_suffix(".tmp")
    tmp.touch(mode=0o600)
    tmp.write_text(json.dumps({"url": url, "admin_token": token, "pid": os.getpid()}))
    tmp.replace(info_file)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


async def _parent_gone(parent_pid: int | None) -> None:
    """Return once ``parent_pid`` no longer exists (never when None)."""
    if parent_pid is None:
        await asyncio.Event().wait()
    while True:
        try:
            os.kill(parent_pid, 0)  # type: ignore[arg-type]
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        await asyncio.sleep(1.0)


async def serve(out_dir: Path, inference: InferenceSettings, *, info_file: Path | None = None,
                host: str = "127.0.0.1", server_port: int = 0, run_slots: int = 4, heartbeat: float = 1.0,
                parent_pid: int | None = None) -> None:
    """Run the fleet until SIGINT / SIGTERM / parent death; the info file is removed on the way out."""
    await asyncio.to_thread(out_dir.mkdir, parents=True, exist_ok=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    engine = make_engine(inference)
    service = ProxyService(engine, CaptureJournal(out_dir / "capture"), SessionRegistry(allow_adhoc=False),
                           max_tokens_cap=inference.max_tokens_cap)
    port = _free_port(host)
    config = GatewayConfig(workdir=out_dir / "gateway", endpoint=GatewayEndpoint(host, port), run_slots=run_slots,
                           ready_buffer=run_slots, init_workers=run_slots, postrun_workers=run_slots)
    gateway_token, server_token = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    node, app = build_gateway(service, config, gateway_token)
    link: ServerLink | None = None
    heartbeats: asyncio.Task[None] | None = None
    watcher = asyncio.create_task(_parent_gone(parent_pid))
    try:
        async with (serving(app, host, port) as gateway_url,
                    rollout_server(out_dir / "server.sqlite", host, server_port or _free_port(host), server_token,
                                   heartbeat) as server_url):
            write_server_info(out_dir, server_url, server_token)
            link = ServerLink(server_url, gateway_url, config.run_slots, server_token=server_token,
                              gateway_token=gateway_token, health=node.health, interval=heartbeat)
            heartbeats = asyncio.create_task(link.run())
            await asyncio.wait_for(link.registered.wait(), 60.0)
            if info_file is not None:
                await asyncio.to_thread(_write_info, info_file, server_url, server_token)
            print(f"polar_gym.env serve: rollout server {server_url}, gateway {gateway_url}", flush=True)
            waiter = asyncio.create_task(stop.wait())
            await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
    finally:
        watcher.cancel()
        if heartbeats is not None:
            heartbeats.cancel()
            await asyncio.gather(heartbeats, return_exceptions=True)
        if link is not None:
            await link.drain_and_close()
        await node.stop("polar_gym.env serve stopped")
        service.journal.close()
        await engine.aclose()
        if info_file is not None:
            await asyncio.to_thread(_remove, info_file)
