"""A served answer's head and body leave in one send (``CoalescingHttpProtocol``): nothing reordered, nothing held
past the loop iteration that wrote it, a close or an abort never loses or resends a held head; and a real uvicorn
server with the protocol answers whole and streamed calls as uvicorn's own does."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from polar_gym.serving import (
    _JOIN_BELOW,
    CoalescingHttpProtocol,
    EmbeddedServer,
    _HeadHoldingTransport,
    caller_gone,
    free_port,
)

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"


class RecordingTransport:
    """What the real transport was asked to do, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.buffered = 7

    def write(self, data: bytes) -> None:
        self.calls.append(("write", bytes(data)))

    def writelines(self, data: Any) -> None:
        self.calls.append(("writelines", [bytes(d) for d in data]))

    def write_eof(self) -> None:
        self.calls.append(("write_eof", None))

    def close(self) -> None:
        self.calls.append(("close", None))

    def abort(self) -> None:
        self.calls.append(("abort", None))

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return False


async def settle() -> None:
    """Let the callbacks scheduled so far run (a held head's flush is one)."""
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_head_and_its_body_go_out_as_one_write() -> None:
    real = RecordingTransport()
    transport = _HeadHoldingTransport(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(HEAD)
    assert real.calls == []  # held
    assert transport.get_write_buffer_size() == 7 + len(HEAD)  # the held head counts as buffered
    transport.write(b"hello")
    assert real.calls == [("write", HEAD + b"hello")]
    await settle()
    assert real.calls == [("write", HEAD + b"hello")]  # the scheduled flush finds nothing held: nothing sent twice
    transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")  # the connection's next answer, held again
    transport.write(b"")
    assert real.calls[-1] == ("write", b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")


async def test_a_large_body_follows_its_head_without_a_copy() -> None:
    real = RecordingTransport()
    transport = _HeadHoldingTransport(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    body = b"x" * _JOIN_BELOW
    transport.write(HEAD)
    transport.write(memoryview(body))
    assert real.calls == [("writelines", [HEAD, body])]


async def test_a_head_with_no_body_yet_leaves_by_the_end_of_the_loop_iteration() -> None:
    """A stream's head goes out before its first event, however long that takes."""
    real = RecordingTransport()
    transport = _HeadHoldingTransport(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(HEAD)
    await settle()
    assert real.calls == [("write", HEAD)]
    transport.write(b"5\r\nhello\r\n")  # the stream's events pass straight through
    assert real.calls == [("write", HEAD), ("write", b"5\r\nhello\r\n")]


@pytest.mark.parametrize("data", [b"5\r\nhello\r\n", b"HTTP/1.1 but not a head", b"data: HTTP/\r\n\r\n"])
async def test_writes_that_are_not_a_head_are_never_held(data: bytes) -> None:
    real = RecordingTransport()
    transport = _HeadHoldingTransport(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(data)
    assert real.calls == [("write", data)]


async def test_close_writelines_and_write_eof_send_a_held_head_first_and_abort_drops_it() -> None:
    loop = asyncio.get_running_loop()
    for action, expected in [("close", ("close", None)), ("write_eof", ("write_eof", None)),
                             ("writelines", ("writelines", [b"a", b"b"]))]:
        real = RecordingTransport()
        transport = _HeadHoldingTransport(real, loop)  # type: ignore[arg-type]
        transport.write(HEAD)
        getattr(transport, action)(*([[b"a", b"b"]] if action == "writelines" else []))
        assert real.calls == [("write", HEAD), expected], action
        await settle()
        assert len(real.calls) == 2, action  # the scheduled flush sends nothing again
    real = RecordingTransport()
    transport = _HeadHoldingTransport(real, loop)  # type: ignore[arg-type]
    transport.write(HEAD)
    transport.abort()
    await settle()
    assert real.calls == [("abort", None)]
    assert transport.is_closing() is False  # everything else is the real transport's


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await _app.release.wait()  # type: ignore[attr-defined]
        await send({"type": "http.response.body", "body": b"late", "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    body = b"y" * int(scope["query_string"] or b"3")
    await send({"type": "http.response.start", "status": 201,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


async def test_a_real_server_with_the_protocol_answers_whole_and_streamed_calls() -> None:
    """Whole answers of every size arrive intact over kept-alive connections; a stream's head arrives before its
    first event is even written (the client holds the headers while the app still waits)."""
    import uvicorn

    _app.release = asyncio.Event()  # type: ignore[attr-defined]
    port = free_port()
    server = EmbeddedServer(uvicorn.Config(_app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                           http=CoalescingHttpProtocol))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done()
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            for size in (0, 1, 3, 5000, _JOIN_BELOW + 10):
                for _ in range(2):  # the second over the kept-alive connection
                    answer = await client.post(f"/?{size}", content=b"{}")
                    assert answer.status_code == 201 and answer.content == b"y" * size
            async with client.stream("POST", "/stream", content=b"{}") as streamed:
                assert streamed.status_code == 200  # the head is here while the app still waits
                _app.release.set()  # type: ignore[attr-defined]
                assert await streamed.aread() == b"late"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # one call, its bytes in order
        writer.write(b"POST /?4 HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
        received = await asyncio.wait_for(reader.read(), 30)  # to the end: the server closes
        writer.close()
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 201 ") and body == b"yyyy"
    finally:
        server.should_exit = True
        await task


@pytest.mark.parametrize("http", ["httptools", "h11", CoalescingHttpProtocol])
async def test_a_caller_that_hangs_up_is_seen_from_the_connection_flag(http: Any) -> None:
    """``caller_gone`` reads uvicorn's own flag: False while the caller waits for its answer, True once it hung up
    (as ``receive`` would say), on each of uvicorn's HTTP protocols; a ``receive`` that is not uvicorn's gets None."""
    import uvicorn

    from tests._waiting import until

    seen: list[bool] = []
    gone_checks: list[Any] = []
    answered = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        gone = caller_gone(receive)
        assert gone is not None
        gone_checks.append(gone)
        seen.append(gone())
        await answered.wait()  # the caller hangs up meanwhile
        seen.append(gone())
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def not_uvicorns() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    assert caller_gone(not_uvicorns) is None
    port = free_port()
    server = EmbeddedServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                           http=http))
    task = asyncio.create_task(server.serve())
    try:
        await until(lambda: server.started or task.done(), what="the server to start")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        await until(lambda: seen, what="the app to read the body")
        assert seen == [False]  # still there
        writer.close()
        await writer.wait_closed()
        await until(lambda: gone_checks[0](), what="the flag to say the caller is gone")
        answered.set()
        await until(lambda: len(seen) == 2, what="the app to ask again")
        assert seen == [False, True]
        del reader
    finally:
        server.should_exit = True
        await task
