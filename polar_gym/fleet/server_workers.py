"""Several rollout server workers on one node, for a fleet whose one server event loop is the limit: a private
PostgreSQL store (polar_gym.server.postgres_local) in the run's state folder, the first worker in this event loop
(what the launcher's driver talks to) and the others as processes (``python -m polar_gym.server --worker wK``).
Each worker watches and dispatches to the gateways that register with it; gateways are given every worker's URL,
their own first, and move to the next when theirs stops answering."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from polar_gym.fleet.local import rollout_server
from polar_gym.private_files import private_dir
from polar_gym.server.postgres_local import PrivatePostgres

__all__ = ["postgres_folder", "rollout_servers", "server_order"]

log = logging.getLogger(__name__)

#: how long a worker process gets to answer its /health, and to stop on SIGTERM
START_TIMEOUT, STOP_TIMEOUT = 60.0, 20.0


def postgres_folder(db: Path) -> Path:
    """Where a run whose SQLite store would be ``db`` keeps its PostgreSQL store instead (several workers)."""
    return db.parent / "postgres"


def server_order(urls: list[str], index: int) -> str:
    """The ``--server-url`` of gateway ``index``: every worker, starting with its own (they take turns)."""
    at = index % len(urls)
    return ",".join(urls[at:] + urls[:at])


@contextlib.asynccontextmanager
async def rollout_servers(db: Path, host: str, ports: list[int], admin_token: str,
                          heartbeat: float = 1.0) -> AsyncIterator[str]:
    """One rollout server worker per port while the block runs; yields the store they share (``db`` itself for one
    worker on SQLite, else the PostgreSQL URL, which holds no password: only this user reaches its socket)."""
    if len(ports) == 1:
        async with rollout_server(db, host, ports[0], admin_token, heartbeat):
            yield str(db)
        return
    await asyncio.to_thread(private_dir, db.parent)
    postgres = PrivatePostgres(postgres_folder(db))
    url = await asyncio.to_thread(postgres.start)
    workers: list[subprocess.Popen[bytes]] = []
    try:
        for number, port in enumerate(ports[1:], start=2):
            workers.append(_start_worker(url, host, port, f"w{number}", admin_token, heartbeat,
                                         db.parent / f"server-w{number}.log"))
        async with rollout_server(url, host, ports[0], admin_token, heartbeat, worker="w1"):
            await _answering(workers, ports[1:])
            yield url
    finally:
        await asyncio.to_thread(_stop_all, workers)
        await asyncio.to_thread(postgres.stop)


def _start_worker(url: str, host: str, port: int, name: str, admin_token: str, heartbeat: float,
                  log_path: Path) -> subprocess.Popen[bytes]:
    """The store's URL and the token go by the environment, never the command line (other users read that)."""
    env = {**os.environ, "POLAR_DB": url, "POLAR_ADMIN_TOKEN": admin_token}
    argv = [sys.executable, "-m", "polar_gym.server", "--host", host, "--port", str(port), "--worker", name,
            "--heartbeat", str(heartbeat), "--dead-after", str(max(10.0, heartbeat * 5)), "--log-level", "warning"]
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        return subprocess.Popen(argv, env=env, stdout=fd, stderr=fd, stdin=subprocess.DEVNULL, cwd=log_path.parent)
    finally:
        os.close(fd)


async def _answering(workers: list[subprocess.Popen[bytes]], ports: list[int]) -> None:
    """Wait until every worker answers /health; a worker that exits first is an error naming its log."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_TIMEOUT
    async with httpx.AsyncClient(timeout=2.0) as http:
        for proc, port in zip(workers, ports, strict=True):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"rollout server worker on port {port} exited ({proc.returncode}); see its "
                                       "server-w*.log beside the store")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                        break
                if loop.time() > deadline:
                    raise RuntimeError(f"rollout server worker on port {port} did not answer in {START_TIMEOUT:.0f} s")
                await asyncio.sleep(0.2)


def _stop_all(workers: list[subprocess.Popen[bytes]]) -> None:
    for proc in workers:
        if proc.poll() is None:
            proc.terminate()
    for proc in workers:
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            log.warning("rollout server worker %d did not stop on SIGTERM: killed", proc.pid)
            proc.kill()
            proc.wait()
