"""Serving the standalone viewer until interrupted: bind, print the URL, wait."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from polar_gym.serving import serving
from polar_gym.view.app import create_view_app
from polar_gym.view.router import PREFIX
from polar_gym.view.source import OutDirSource

__all__ = ["serve_forever", "url_host"]


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def serve_forever(out_dir: Path, host: str, port: int, *, tokenizer: Path | None = None,
                        decode: bool = True) -> None:  # pragma: no cover - process glue (tests run the process)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving {out_dir} on {host} to anyone who can reach it, with no token: the viewer is "
              "meant for loopback (ssh -L to see it from elsewhere)", file=sys.stderr, flush=True)
    source = OutDirSource(out_dir, tokenizer=tokenizer, decode=decode)
    app = create_view_app(source, host=host)
    if port == 0:
        from polar_gym.serving import free_port

        port = free_port(host)
    tokens = source.tokens()
    if tokens is not None:
        await asyncio.to_thread(tokens.texts, [])  # load it now: the first session opened should not wait for it
    async with serving(app, host, port):
        print(f"polar_gym viewer of {source.title}: http://{url_host(host)}:{port}{PREFIX}/", flush=True)
        await asyncio.Event().wait()
