"""Keep-alive between our HTTP clients and the servers they call (ours, vLLM's, SGLang's: all uvicorn).

uvicorn closes a connection that has been idle for ``timeout_keep_alive`` seconds (5, its default, which every one of
those servers keeps). httpx keeps an idle connection for 5 s too, so a client that calls again ~5 s after its last
call can send into a connection the server is closing at that moment, and gets ``httpx.ReadError`` (seen on a loaded
machine: a trainer polling the rollout server between training steps). Our httpx clients let an idle connection go
well before the server does.

Ground layer: imports nothing else of ours.
"""

from __future__ import annotations

import httpx

__all__ = ["CLIENT_KEEP_ALIVE_SECONDS", "SERVER_KEEP_ALIVE_SECONDS", "client_limits"]

#: how long uvicorn keeps an idle connection open (its ``timeout_keep_alive`` default)
SERVER_KEEP_ALIVE_SECONDS = 5.0
#: how long our clients keep one: well under the server's, so a call never races the server's close
CLIENT_KEEP_ALIVE_SECONDS = 2.0


def client_limits(max_connections: int | None = 100, max_keepalive_connections: int | None = 20) -> httpx.Limits:
    """httpx's connection limits (its defaults unless given) with our clients' keep-alive expiry."""
    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_keepalive_connections,
                        keepalive_expiry=CLIENT_KEEP_ALIVE_SECONDS)
