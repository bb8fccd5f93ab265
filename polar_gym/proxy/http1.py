"""A lean HTTP/1.1 client for the one hot call of an HTTP engine: POST a JSON body to an inference server, read its
whole answer. httpx with httpcore and anyio cost about a third of the proxy's CPU per call (issue 18's profile: URL
and cookie handling, a readability check of every pooled connection under anyio locks on every request); this keeps
idle keep-alive connections per server in a deque and speaks just enough HTTP/1.1 (Content-Length and chunked
answers) on asyncio streams. Cold paths (weight updates, model listings) keep using httpx.

Errors are the proxy's own (:class:`~polar_gym.proxy.errors.UpstreamTimeout`,
:class:`~polar_gym.proxy.errors.UpstreamUnavailable`), named by server.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from polar_gym.proxy.errors import UpstreamTimeout, UpstreamUnavailable

__all__ = ["LeanHttpClient", "UpstreamAnswer", "UpstreamHead"]

#: kept connections are checked for ones their server closed every this many calls
_SWEEP_EVERY = 1024
#: the stream buffer (an answer head may be this long; bodies of any length are read)
_READ_LIMIT = 1024 * 1024


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


class _Connection:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def usable(self) -> bool:
        return not (self.reader.at_eof() or self.writer.transport.is_closing())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class _Deadlines:
    """The timeouts of a client's concurrent calls on one loop, kept by one timer: each call notes its deadline,
    and a sweep every ``tick`` seconds while calls are in flight cancels those past theirs; the call turns that
    cancellation into its timeout, as ``asyncio.timeout`` does. ``asyncio.timeout`` makes and cancels a timer per
    call (~2 % of a model call's CPU at 64 concurrent calls, issue 18); a call here ends at most ``tick`` after its
    deadline (a timeout's eighth, at most a second)."""

    __slots__ = ("_calls", "_expired", "_timer", "loop", "seconds", "tick")

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        self.loop, self.seconds = loop, seconds
        self.tick = max(min(1.0, seconds / 8), 0.001)
        self._calls: dict[asyncio.Task[Any], float] = {}
        self._expired: set[asyncio.Task[Any]] = set()
        self._timer: asyncio.TimerHandle | None = None

    def enter(self) -> tuple[asyncio.Task[Any], int]:
        """The calling task's deadline starts now: (the task, its cancellation count before it)."""
        task = asyncio.current_task(self.loop)
        if task is None:
            raise RuntimeError("an upstream call must run in a task")
        self._calls[task] = self.loop.time() + self.seconds
        if self._timer is None:
            self._timer = self.loop.call_later(self.tick, self._sweep)
        return task, task.cancelling()

    def expired(self, task: asyncio.Task[Any], cancelling: int) -> bool:
        """Whether the cancellation ``task`` caught is this timeout's (not also someone else's), taking it back."""
        if task not in self._expired:
            return False
        return task.uncancel() <= cancelling  # the task leaves the expired set as it leaves (``leave``)

    def leave(self, task: asyncio.Task[Any]) -> None:
        self._calls.pop(task, None)
        self._expired.discard(task)

    def _sweep(self) -> None:
        now = self.loop.time()
        for task, deadline in list(self._calls.items()):
            if deadline <= now and task not in self._expired:
                self._expired.add(task)
                task.cancel()
        self._timer = self.loop.call_later(self.tick, self._sweep) if self._calls else None


class _Stale(Exception):
    """A kept-alive connection the server had closed: nothing of an answer arrived, so the call is sent again."""


class LeanHttpClient:
    """POST bytes, get (status, body). ``max_idle`` connections per server are kept alive for the next call;
    ``headers`` go with every request."""

    def __init__(self, timeout: float = 600.0, connect_timeout: float = 10.0, max_idle: int = 256,
                 headers: Mapping[str, str] | None = None) -> None:
        lines = [f"{name}: {value}" for name, value in (headers or {}).items()]
        if any(ch in line for line in lines for ch in "\r\n\0"):
            raise ValueError("a header name or value holds a line break")
        self._extra = "".join(line + "\r\n" for line in lines).encode("latin-1")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self._idle: dict[tuple[str, int], collections.deque[_Connection]] = {}
        self._targets: dict[str, tuple[str, int, str, bytes]] = {}
        self._releases = 0
        #: the calls in flight on the loop that made the last one (a new loop or timeout: a new one; the old one's
        #: timer stops with its last call)
        self._deadlines: _Deadlines | None = None

    def _target(self, url: str) -> tuple[str, int, str, bytes]:
        """(host, port, server name, request-target) of ``url``, parsed once per URL."""
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"LeanHttpClient speaks plain http only, not {url!r}")
            port = parts.port or 80
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            host_header = parts.hostname if port == 80 else f"{parts.hostname}:{port}"
            target = (parts.hostname, port, f"{parts.scheme}://{parts.netloc}", b"POST " + path.encode() +
                      b" HTTP/1.1\r\nhost: " + host_header.encode() +
                      b"\r\n" + self._extra + b"content-type: application/json\r\naccept: */*\r\ncontent-length: ")
            if len(self._targets) < 1024:
                self._targets[url] = target
        return target

    async def post(self, url: str, body: bytes) -> UpstreamAnswer:
        host, port, server, head = self._target(url)
        request = (head + str(len(body)).encode() + b"\r\n\r\n", body)  # sent together, the body not copied
        loop = asyncio.get_running_loop()
        deadlines = self._deadlines
        if deadlines is None or deadlines.loop is not loop or deadlines.seconds != self.timeout:
            deadlines = self._deadlines = _Deadlines(loop, self.timeout)
        task, cancelling = deadlines.enter()
        try:
            for _ in range(3):
                conn, reused = await self._acquire(host, port, server)
                try:
                    answer, keep = await self._exchange(conn, request, reused)
                except _Stale:
                    conn.close()
                    continue
                except BaseException:
                    conn.close()
                    raise
                if keep:
                    self._release(host, port, conn)
                else:
                    conn.close()
                return answer
            raise UpstreamUnavailable(f"upstream {server} closed the connection before answering")
        except asyncio.CancelledError as exc:
            if deadlines.expired(task, cancelling):
                raise UpstreamTimeout(f"upstream {server} timed out after {self.timeout:g} s") from exc
            raise
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            raise UpstreamUnavailable(f"upstream {server} unreachable: {exc.__class__.__name__}: {exc}") from exc
        finally:
            deadlines.leave(task)

    @contextlib.asynccontextmanager
    async def stream(self, url: str, body: bytes) -> AsyncIterator[tuple[UpstreamHead, AsyncIterator[bytes]]]:
        """POST ``body`` and read the answer as it arrives: its head, then its body piece by piece (a chunk of a
        chunked answer as the server sent it). Each read may take ``timeout``; the connection is kept for the next
        call only when the body was read to its end."""
        host, port, server, head = self._target(url)
        request = (head + str(len(body)).encode() + b"\r\n\r\n", body)  # sent together, the body not copied
        conn: _Connection | None = None
        with _translated(server, self.timeout):
            for _ in range(3):
                conn, reused = await self._acquire(host, port, server)
                try:
                    async with asyncio.timeout(self.timeout):
                        status, length, chunked, close, media = await _send_for_head(conn, request, reused)
                    break
                except _Stale:
                    conn.close()
                    conn = None
                except BaseException:
                    conn.close()
                    raise
            else:
                raise UpstreamUnavailable(f"upstream {server} closed the connection before answering")
        assert conn is not None
        whole = False

        async def pieces() -> AsyncIterator[bytes]:
            nonlocal whole
            assert conn is not None
            reader, timeout = conn.reader, self.timeout
            with _translated(server, timeout):
                if chunked:
                    while True:
                        async with asyncio.timeout(timeout):
                            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip(), 16)
                            if size == 0:
                                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, blank line
                                    pass
                                break
                            piece = await reader.readexactly(size)
                            await reader.readexactly(2)
                        yield piece
                elif length >= 0:
                    left = length
                    while left > 0:
                        async with asyncio.timeout(timeout):
                            piece = await reader.read(min(left, _READ_LIMIT))
                        if not piece:
                            raise asyncio.IncompleteReadError(b"", left)
                        left -= len(piece)
                        yield piece
                else:  # no length: the body runs to the end of the connection
                    while True:
                        async with asyncio.timeout(timeout):
                            piece = await reader.read(_READ_LIMIT)
                        if not piece:
                            break
                        yield piece
            whole = True

        try:
            yield UpstreamHead(status, media), pieces()
        finally:
            if whole and not close:
                self._release(host, port, conn)
            else:
                conn.close()

    async def _acquire(self, host: str, port: int, server: str) -> tuple[_Connection, bool]:
        idle = self._idle.get((host, port))
        while idle:
            conn = idle.pop()
            if conn.usable():
                return conn, True
            conn.close()
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(host, port, limit=_READ_LIMIT)
        except TimeoutError as exc:
            raise UpstreamUnavailable(f"upstream {server} unreachable: connect timed out") from exc
        return _Connection(reader, writer), False

    def _release(self, host: str, port: int, conn: _Connection) -> None:
        idle = self._idle.setdefault((host, port), collections.deque())
        if len(idle) >= self.max_idle:
            conn.close()
        else:
            idle.append(conn)
        self._releases += 1
        if self._releases % _SWEEP_EVERY == 0:
            self.sweep()

    def sweep(self) -> int:
        """Close kept connections their server has closed (a server that left the pool is never asked again, so
        its half-closed sockets would otherwise stay open); the number closed."""
        closed = 0
        for target, idle in list(self._idle.items()):
            alive = [conn for conn in idle if conn.usable()]
            for conn in idle:
                if not conn.usable():
                    conn.close()
                    closed += 1
            if alive:
                self._idle[target] = collections.deque(alive)
            else:
                del self._idle[target]
        return closed

    @staticmethod
    async def _exchange(conn: _Connection, request: tuple[bytes, bytes], reused: bool
                        ) -> tuple[UpstreamAnswer, bool]:
        """Send ``request`` and read one answer: (answer, whether the connection may be kept)."""
        status, length, chunked, close, _ = await _send_for_head(conn, request, reused)
        if chunked:
            content = await _read_chunked(conn.reader)
        elif length >= 0:
            content = await conn.reader.readexactly(length)
        else:  # no length: the body runs to the end of the connection
            content, close = await conn.reader.read(), True
        return UpstreamAnswer(status, content), not close

    async def aclose(self) -> None:
        closing = [conn for idle in self._idle.values() for conn in idle]
        self._idle.clear()
        for conn in closing:
            conn.close()
        for conn in closing:
            with contextlib.suppress(Exception):
                await conn.writer.wait_closed()


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, then the blank line
                pass
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


@contextlib.contextmanager
def _translated(server: str, timeout: float) -> Iterator[None]:
    """A streamed call's transport failures as the proxy's errors, named by server."""
    try:
        yield
    except TimeoutError as exc:
        raise UpstreamTimeout(f"upstream {server} timed out after {timeout:g} s") from exc
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        raise UpstreamUnavailable(f"upstream {server} unreachable: {exc.__class__.__name__}: {exc}") from exc


async def _send_for_head(conn: _Connection, request: tuple[bytes, bytes], reused: bool
                         ) -> tuple[int, int, bool, bool, str]:
    """Send ``request`` (its head, its body) and read the answer's head: (status, content length or -1, chunked,
    close, media type)."""
    conn.writer.writelines(request)
    try:
        await conn.writer.drain()
        head = await conn.reader.readuntil(b"\r\n\r\n")
    except (ConnectionError, asyncio.IncompleteReadError) as exc:
        if reused and (not isinstance(exc, asyncio.IncompleteReadError) or not exc.partial):
            raise _Stale from exc
        raise
    lines = head[:-4].split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    status = int(rest[:3])
    length, chunked, close, media = -1, False, version == b"HTTP/1.0", ""
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif name == b"connection":
            close = close or b"close" in value.lower()
        elif name == b"content-type":
            media = value.strip().decode("latin-1")
    if status in (204, 304) or 100 <= status < 200:
        length = 0
    return status, length, chunked, close, media
