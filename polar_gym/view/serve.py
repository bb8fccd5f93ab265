"""Serving the standalone viewer until interrupted: bind, print the URL, wait."""

from __future__ import annotations

import asyncio
import sys
import urllib.parse
from pathlib import Path

from polar_gym.serving import serving
from polar_gym.view.app import create_view_app
from polar_gym.view.router import PREFIX
from polar_gym.view.source import OutDirSource

__all__ = ["serve_forever", "url_host"]


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def serve_forever(out_dir: Path, host: str, port: int, *, tokenizer: Path | None = None,
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
    if port == 0:
        from polar_gym.serving import free_port

        port = free_port(host)
    tokens = source.tokens()
    if tokens is not None:
        await asyncio.to_thread(tokens.texts, [])  # load it now: the first session opened should not wait for it
    async with serving(app, host, port):
        query = f"?token={urllib.parse.quote(token)}" if token else ""
        print(f"polar_gym viewer of {source.title}: http://{url_host(host)}:{port}{PREFIX}/{query}", flush=True)
        await asyncio.Event().wait()
