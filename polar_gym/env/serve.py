"""``python -m polar_gym.env serve``: a long-lived rollout server plus one registered gateway node (proxy +
sandboxes) on loopback, for the NeMo Gym agent to submit sessions to when no Polar server is configured. Writes
``{"url", "admin_token", "pid"}`` to an info file (mode 600) once the gateway has registered, and stops cleanly on
SIGINT / SIGTERM or when ``parent_pid`` dies (so a killed Gym agent cannot leave it behind)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

from rich.console import Console

from polar_gym.fleet import InferenceSettings, UpstreamCheckFailed, describe_inference, ensure_upstreams, local_fleet
from polar_gym.gateway.config import GatewayPools
from polar_gym.private_files import write_secret

__all__ = ["serve"]


def _write_info(info_file: Path, url: str, token: str) -> None:
    """Atomically (rename) and privately (mode 600): the reader polls for the file and must never see half of it."""
    write_secret(info_file, json.dumps({"url": url, "admin_token": token, "pid": os.getpid()}))


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


async def _parent_gone(parent_pid: int | None) -> None:
    """Return once ``parent_pid`` no longer exists (never when None)."""
    if parent_pid is None:
        await asyncio.Event().wait()
        return
    while True:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        await asyncio.sleep(1.0)


async def serve(out_dir: Path, inference: InferenceSettings, *, info_file: Path | None = None,
                host: str = "127.0.0.1", server_port: int = 0, pools: GatewayPools | None = None,
                heartbeat: float = 1.0, parent_pid: int | None = None) -> None:
    """Run the fleet until SIGINT / SIGTERM / parent death; the info file is removed on the way out. Without
    ``await_upstreams``, every inference upstream is probed first: a bad one ends the process (exit code 3) with a
    message naming the URL and what it answered, instead of sessions that fail one by one."""
    print(describe_inference(inference, "env serve"), file=sys.stderr, flush=True)
    if not inference.await_upstreams:
        try:
            await ensure_upstreams(inference, inference.upstreams, Console(stderr=True))
        except UpstreamCheckFailed as exc:
            print(f"polar_gym.env serve: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(3) from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(_parent_gone(parent_pid))
    try:
        async with local_fleet(out_dir, inference, host=host, server_port=server_port, heartbeat=heartbeat,
                               pools=pools) as (server_url, server_token):
            if info_file is not None:
                await asyncio.to_thread(_write_info, info_file, server_url, server_token)
            print(f"polar_gym.env serve: rollout server {server_url}", flush=True)
            waiter = asyncio.create_task(stop.wait())
            await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
    finally:
        watcher.cancel()
        if info_file is not None:
            await asyncio.to_thread(_remove, info_file)
