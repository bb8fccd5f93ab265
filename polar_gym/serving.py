"""uvicorn inside someone else's event loop: serve an ASGI app on a port while a block runs."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn

__all__ = ["EmbeddedServer", "free_port", "serving"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EmbeddedServer(uvicorn.Server):
    """uvicorn inside someone else's event loop: Ctrl-C stays with the owner (asyncio.run cancels the run, which
    then cancels its tasks on the rollout server) instead of stopping this server first."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serving(app: Any, host: str, port: int) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on ``host:port`` inside this event loop while the block runs; yields its URL."""
    server = EmbeddedServer(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=5))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError(f"could not listen on {host}:{port}")
            await asyncio.sleep(0.01)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        await task
