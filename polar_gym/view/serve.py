"""Serving the standalone viewer until interrupted: bind, print the URL, wait.

The port: ``DEFAULT_PORT`` when it is free, else any free port (a second viewer on the same machine just gets
another port, and its URL says which); a port the user named that is taken is :class:`PortTaken`, which the
command line reports in one line (exit 2) instead of uvicorn's traceback.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import sys
import urllib.parse
from pathlib import Path

from polar_gym.serving import free_port, serving
from polar_gym.view.app import create_view_app
from polar_gym.view.router import PREFIX
from polar_gym.view.source import OutDirSource

__all__ = ["DEFAULT_PORT", "PortTaken", "choose_port", "serve_forever", "url_host"]

DEFAULT_PORT = 8765


class PortTaken(OSError):
    """The port the user asked for is in use."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(errno.EADDRINUSE, f"port {port} on {host} is taken (another viewer?): give another --port, "
                                           "or leave --port out to pick a free one")
        self.host, self.port = host, port


def _free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now, with the SO_REUSEADDR uvicorn binds with (a port in TIME_WAIT is
    free, one another process listens on is not)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
        return True


def choose_port(host: str, port: int | None) -> int:
    """The port to serve on: ``port`` if given (0: any free one; taken: PortTaken), else DEFAULT_PORT if it is
    free, else any free port."""
    if port == 0 or (port is None and not _free(host, DEFAULT_PORT)):
        return free_port(host.strip("[]"))
    if port is None:
        return DEFAULT_PORT
    if not _free(host, port):
        raise PortTaken(host, port)
    return port


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def serve_forever(out_dir: Path, host: str, port: int | None, *, tokenizer: Path | None = None,
                        decode: bool = True, token: str | None = None
                        ) -> None:  # pragma: no cover - process glue (tests run the process)
    if token is None:
        where = "on this machine" if host in ("127.0.0.1", "localhost", "::1") else f"that can reach {host}"
        print(f"warning: serving {out_dir} with no token: every user {where} can read the run", file=sys.stderr,
              flush=True)
    elif host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving {out_dir} on {host} over plain HTTP: the token crosses the network in clear (ssh -L "
              "to a loopback viewer is safer)", file=sys.stderr, flush=True)
    source = OutDirSource(out_dir, tokenizer=tokenizer, decode=decode)
    app = create_view_app(source, host=host, token=token)
    port = choose_port(host, port)
    tokens = source.tokens()
    if tokens is not None:
        await asyncio.to_thread(tokens.texts, [])  # load it now: the first session opened should not wait for it
    async with serving(app, host, port):
        query = f"?token={urllib.parse.quote(token)}" if token else ""
        print(f"polar_gym viewer of {source.title}: http://{url_host(host)}:{port}{PREFIX}/{query}", flush=True)
        await asyncio.Event().wait()
