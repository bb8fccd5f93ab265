"""The one hot call of an HTTP engine, through aiohttp: POST a JSON body to an inference server and read its answer,
whole or as it streams. Cold paths (weight updates, model listings, probes) use httpx.

Why aiohttp: on the traffic harnesses send (growing sessions, streamed), its cost per call is within a few percent
of the hand-written HTTP/1.1 client it replaced (``proxy/http1.py``, issue 18), and below httpx's
(docs/benchmarks.md#bench_traffic has the figures). A well-kept library is worth that much.

One ``aiohttp.ClientSession`` per event loop (a session belongs to the loop it was made on; tests and the trainer
bridges run engines on several loops), with kept-alive connections. Errors are the proxy's own
(:class:`~polar_gym.proxy.errors.UpstreamTimeout`, :class:`~polar_gym.proxy.errors.UpstreamUnavailable`), named by
server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from polar_gym.proxy.errors import UpstreamTimeout, UpstreamUnavailable

__all__ = ["UpstreamAnswer", "UpstreamClient", "UpstreamHead"]

#: a kept-alive connection the server closed as it was reused (its idle timeout): the call is sent again on a new
#: one, at most this many times in all (a server that refuses connections is not asked again)
_ATTEMPTS = 3
_STALE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


@dataclass
class UpstreamAnswer:
    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


@dataclass
class UpstreamHead:
    """A streamed answer's status and media type (its body is read as it arrives)."""

    status_code: int
    content_type: str


def _server(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


@contextlib.contextmanager
def _translated(url: str, timeout: float) -> Iterator[None]:
    """aiohttp's failures as the proxy's errors, naming the server."""
    try:
        yield
    except TimeoutError as exc:
        raise UpstreamTimeout(f"upstream {_server(url)} timed out after {timeout:g} s") from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise UpstreamUnavailable(f"upstream {_server(url)} unreachable: {exc.__class__.__name__}: {exc}") from exc


class UpstreamClient:
    """POST bytes, get (status, body), or the body as it streams. ``headers`` go with every request; ``timeout``
    bounds a whole call (a streamed one: each read), ``connect_timeout`` a new connection."""

    def __init__(self, timeout: float = 600.0, connect_timeout: float = 10.0, max_connections: int = 1024,
                 headers: Mapping[str, str] | None = None) -> None:
        self.timeout, self.connect_timeout, self.max_connections = timeout, connect_timeout, max_connections
        self.headers = {"content-type": "application/json", **(headers or {})}
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            for old in [old for old in self._sessions if old.is_closed()]:
                del self._sessions[old]  # a finished loop's session: its connections went with it
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0)
            session = self._sessions[loop] = aiohttp.ClientSession(
                connector=connector, headers=self.headers, skip_auto_headers=("User-Agent",),
                timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=self.connect_timeout))
        return session

    async def post(self, url: str, body: bytes) -> UpstreamAnswer:
        with _translated(url, self.timeout):
            for attempt in range(_ATTEMPTS):
                try:
                    async with self._session().post(url, data=body) as resp:
                        return UpstreamAnswer(resp.status, await resp.read())
                except _STALE as exc:
                    if isinstance(exc, aiohttp.ClientConnectorError) or attempt == _ATTEMPTS - 1:
                        raise
        raise AssertionError("unreachable")

    @contextlib.asynccontextmanager
    async def stream(self, url: str, body: bytes) -> AsyncIterator[tuple[UpstreamHead, AsyncIterator[bytes]]]:
        """POST ``body`` and read the answer as it arrives: its head, then its body a chunk as the server sent it.
        Each read may take ``timeout``. The connection is kept for the next call only when the body was read to
        its end."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout, sock_read=self.timeout)
        with _translated(url, self.timeout):
            for attempt in range(_ATTEMPTS):
                try:
                    resp = await self._session().post(url, data=body, timeout=timeout)
                    break
                except _STALE as exc:
                    if isinstance(exc, aiohttp.ClientConnectorError) or attempt == _ATTEMPTS - 1:
                        raise
            async with resp:
                async def pieces() -> AsyncIterator[bytes]:
                    with _translated(url, self.timeout):
                        async for piece, _ in resp.content.iter_chunks():
                            yield piece

                yield UpstreamHead(resp.status, resp.headers.get("content-type", "")), pieces()

    async def aclose(self) -> None:
        """Close the session of the running loop (those of loops that ended closed with them)."""
        with contextlib.suppress(RuntimeError):
            session = self._sessions.pop(asyncio.get_running_loop(), None)
            if session is not None:
                await session.close()
