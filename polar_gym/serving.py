"""uvicorn embedded in an event loop someone else owns: the launcher, ``python -m polar_gym.env serve``, the
trainer-side callback receiver and the tests all serve their apps this way, on a port they pick.

The one module that reads or writes objects uvicorn and starlette keep private (for a model call's CPU, issue 18):
uvicorn's HTTP protocol class and per-request cycle (:class:`CoalescingHttpProtocol`, :func:`caller_gone`) and
starlette's kept request body (:func:`body_kept`, :func:`keep_body`). ``CHECKED_WITH`` names the versions they were
checked against; ``tests/unit/test_serving_contract.py`` fails when another version is installed, and pins each
behaviour relied on.

Ground layer: imports nothing else of ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http import h11_impl, httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["CHECKED_WITH", "CoalescingHttpProtocol", "EmbeddedServer", "body_kept", "caller_gone", "free_port",
           "keep_body", "serving"]

#: the versions whose private objects this module was checked against (pyproject pins both)
CHECKED_WITH = {"uvicorn": "0.54.0", "starlette": "1.10.0"}

#: a held response head and a body up to this size go out as one buffer (copied); a larger body as two buffers
_JOIN_BELOW = 256 * 1024


class _HeadHoldingTransport:
    """A connection's transport that holds a response head (uvicorn writes it alone, before the body) until the
    next write, so a whole answer leaves in one send, not two: on loopback each send runs the receiver's TCP
    path too (issue 18's profile: the two sends were 7.5 % of a model call's CPU at 64 concurrent calls). Nothing
    is reordered: a held head goes out with the next write, or at the end of this loop iteration if none comes (a
    stream's head before its first event), or before a close. Everything else is the real transport's."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._held: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if len(data) < _JOIN_BELOW:
                self._transport.write(held + bytes(data))
            else:
                self._transport.writelines((held, data))
        elif data[:5] == b"HTTP/" and bytes(data[-4:]) == b"\r\n\r\n":
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        """Send a held head now."""
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held)

    def writelines(self, list_of_data: Any) -> None:
        self.flush()
        self._transport.writelines(list_of_data)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held or b"")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, each answer's head and body written as one send
    (:class:`_HeadHoldingTransport`). For servers whose calls answer small bodies at a high rate: the proxy's
    model calls. ``uvicorn.Config(http=CoalescingHttpProtocol)``."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_HeadHoldingTransport(transport, asyncio.get_running_loop()))  # type: ignore[arg-type]


#: uvicorn's per-request cycles: ``receive`` is a bound method of one, which keeps whether its connection is gone
_UVICORN_CYCLES = (httptools_impl.RequestResponseCycle, h11_impl.RequestResponseCycle)


def caller_gone(receive: Callable[[], Any]) -> Callable[[], bool] | None:
    """Whether the caller of a request uvicorn serves has hung up, read from the flag uvicorn's protocol sets when
    the connection is lost (or the answer is complete): what ``receive`` would answer once the body is read, without
    stepping it (a waiter made and dropped, ~3 % of a model call's CPU at 64 concurrent calls). None when
    ``receive`` is not uvicorn's: ask it."""
    cycle: Any = getattr(receive, "__self__", None)
    if type(cycle) not in _UVICORN_CYCLES:
        return None
    return lambda: bool(cycle.disconnected or cycle.response_complete)


def body_kept(request: Any) -> bytes | None:
    """The body a starlette Request already read and keeps (what ``await request.body()`` gives again), b"" when
    its stream was consumed without keeping it (starlette then refuses to read it), None when it was not read."""
    if hasattr(request, "_body"):
        return bytes(request._body)
    return b"" if request._stream_consumed else None


def keep_body(request: Any, body: bytes) -> None:
    """Mark ``body``, read from the request's ``receive`` by the caller, as the request's body, as starlette does
    after ``request.body()``: a later ``request.body()`` (an error handler's) gives it instead of waiting."""
    request._stream_consumed = True
    request._body = body


class EmbeddedServer(uvicorn.Server):
    """uvicorn inside someone else's event loop: Ctrl-C stays with the owner (asyncio.run cancels the run, which
    then cancels its tasks on the rollout server) instead of stopping this server first."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that was free a moment ago (the caller binds it next)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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
