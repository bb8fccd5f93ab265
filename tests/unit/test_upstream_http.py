"""The engines' hot upstream client (polar_gym.proxy.upstream_http, aiohttp) against real sockets: keep-alive reuse,
chunked and Content-Length answers, a server that drops idle connections, failures mapped onto the proxy's errors,
timeouts that cancel only their own call, one client on several event loops, and streamed answers read as they
arrive."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import orjson
import pytest

from polar_gym.proxy.chat import ChatRequest, ChatResult
from polar_gym.proxy.engines.base import StreamDelta, StreamStart
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.errors import RequestError, UpstreamError, UpstreamTimeout, UpstreamUnavailable
from polar_gym.proxy.upstream_http import UpstreamClient
from polar_gym.proxy.upstreams import UpstreamPool

Handler = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]


class _Server:
    """A raw HTTP/1.1 server on a real socket: ``handler`` answers each request (given the body) and says whether
    to keep the connection; ``accepted`` counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.accepted = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> _Server:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        self.accepted += 1
        handler = self.handler
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                body = await reader.readexactly(length)
                if not await handler(body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _answer(writer: asyncio.StreamWriter, body: bytes, status: int = 200, extra: bytes = b"") -> None:
    writer.write(b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
                 % (status, len(body), extra, body))


async def test_keeps_one_connection_alive_across_calls() -> None:
    async def echo(body: bytes, writer: asyncio.StreamWriter) -> bool:
        _answer(writer, body)
        return True

    client = UpstreamClient()
    async with _Server(echo) as server:
        for n in range(5):
            answer = await client.post(server.url + "/v1/chat/completions", orjson.dumps({"n": n}))
            assert (answer.status_code, orjson.loads(answer.content)) == (200, {"n": n})
        assert server.accepted == 1
        await client.aclose()


async def test_reads_chunked_answers_and_error_statuses() -> None:
    async def chunked(body: bytes, writer: asyncio.StreamWriter) -> bool:
        if body == b"bad":
            _answer(writer, b'{"error": "no"}', status=400)
            return True
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n")
        return True

    client = UpstreamClient()
    async with _Server(chunked) as server:
        assert (await client.post(server.url + "/x", b"a")).content == b"hello world"
        refused = await client.post(server.url + "/x", b"bad")
        assert (refused.status_code, refused.text) == (400, '{"error": "no"}')
        assert (await client.post(server.url + "/x", b"b")).content == b"hello world"
        assert server.accepted == 1
        await client.aclose()


async def test_a_dropped_keepalive_connection_is_replaced_and_connection_close_honoured() -> None:
    async def once(body: bytes, writer: asyncio.StreamWriter) -> bool:
        _answer(writer, body, extra=b"connection: close\r\n" if body == b"close" else b"")
        return False  # the server drops every connection after one answer, like an idle timeout would

    client = UpstreamClient()
    async with _Server(once) as server:
        for body in (b"one", b"two", b"close", b"three"):
            assert (await client.post(server.url + "/x", body)).content == body
        assert server.accepted == 4
        await client.aclose()


async def test_timeouts_and_refused_connections_are_the_proxys_errors() -> None:
    async def silent(body: bytes, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(30)
        return False

    client = UpstreamClient(timeout=0.2)
    async with _Server(silent) as server:
        with pytest.raises(UpstreamTimeout):
            await client.post(server.url + "/x", b"{}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    with pytest.raises(UpstreamUnavailable):
        await client.post(f"http://127.0.0.1:{closed_port}/x", b"{}")
    await client.aclose()


async def test_a_timed_out_call_leaves_its_task_uncancelled_and_other_calls_answered() -> None:
    """The slow calls time out, the quick ones beside them are answered, and a task whose call timed out goes on
    with no cancellation left pending."""
    async def slow_on_demand(body: bytes, writer: asyncio.StreamWriter) -> bool:
        if body == b"slow":
            await asyncio.sleep(30)
        _answer(writer, body)
        return True

    client = UpstreamClient(timeout=0.3)
    async with _Server(slow_on_demand) as server:
        async def one(body: bytes) -> str:
            try:
                answer = await client.post(server.url + "/x", body)
            except UpstreamTimeout as exc:
                await asyncio.sleep(0)  # nothing pending: this step is not cancelled
                task = asyncio.current_task()
                assert task is not None and task.cancelling() == 0
                return f"timeout: {exc}"
            return answer.content.decode()

        got = await asyncio.gather(*(one(b"slow" if n % 3 == 0 else b"q%d" % n) for n in range(9)))
        assert got[1:3] == ["q1", "q2"] and all(got[n] == f"q{n}" for n in range(9) if n % 3)
        assert all(got[n].startswith("timeout: upstream http://127.0.0.1:") for n in (0, 3, 6))
        assert "timed out after 0.3 s" in got[0]
        await client.aclose()


async def test_a_call_cancelled_from_outside_is_cancelled_not_timed_out() -> None:
    """A caller's own cancellation passes through as a cancellation, and the client serves the next call."""
    accepted = asyncio.Event()

    async def silent_once(body: bytes, writer: asyncio.StreamWriter) -> bool:
        if body == b"silent":
            accepted.set()
            await asyncio.sleep(30)
        _answer(writer, body)
        return True

    client = UpstreamClient(timeout=30)
    async with _Server(silent_once) as server:
        call = asyncio.create_task(client.post(server.url + "/x", b"silent"))
        await asyncio.wait_for(accepted.wait(), 60)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert (await client.post(server.url + "/x", b"next")).content == b"next"
    await client.aclose()


def test_one_client_times_out_on_each_event_loop_it_is_used_from() -> None:
    """A client made once and used from one ``asyncio.run`` after another (an engine made outside any loop) keeps
    its timeout on each: a loop's session never outlives its loop."""
    client = UpstreamClient(timeout=0.2)

    async def timed_out() -> bool:
        async def silent(body: bytes, writer: asyncio.StreamWriter) -> bool:
            await asyncio.sleep(30)
            return False

        async with _Server(silent) as server:
            try:
                await client.post(server.url + "/x", b"{}")
            except UpstreamTimeout:
                return True
            finally:
                await client.aclose()
        return False

    assert asyncio.run(timed_out()) and asyncio.run(timed_out())


async def test_an_engine_without_an_injected_client_posts_through_it() -> None:
    """The vLLM engine's model call goes through the hot client: a vLLM-shaped answer becomes a result, a
    malformed one an upstream error."""
    answers = [orjson.dumps({"choices": [{"message": {"role": "assistant", "content": "hi"}, "token_ids": [7, 8],
                                          "finish_reason": "stop", "logprobs": {"content": [
                                              {"logprob": -0.5}, {"logprob": -0.25}]}}],
                             "prompt_token_ids": [1, 2, 3]}), b"not json"]
    sent: list[dict[str, object]] = []

    async def vllm(body: bytes, writer: asyncio.StreamWriter) -> bool:
        sent.append(orjson.loads(body))
        _answer(writer, answers[len(sent) - 1])
        return True

    async with _Server(vllm) as server:
        engine = VLLMEngine(UpstreamPool([server.url]))
        assert engine.fast is not None
        request = ChatRequest.model_validate({"model": "policy", "messages": [{"role": "user", "content": "x"}]})
        result = await engine.complete(request, "s1")
        assert (result.prompt_ids, result.response_ids, result.response_logprobs) == ([1, 2, 3], [7, 8],
                                                                                       [-0.5, -0.25])
        assert sent[0]["return_token_ids"] is True
        with pytest.raises(UpstreamError):
            await engine.complete(request, "s1")
        await engine.aclose()


async def test_headers_given_go_with_every_request() -> None:
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            heads.append(head)
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            _answer(writer, b"{}")
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/messages"
    client = UpstreamClient(headers={"authorization": "Bearer k", "x-api-key": "k"})
    for _ in range(2):
        assert (await client.post(url, b"{}")).status_code == 200
    assert len(heads) == 2
    for head in heads:
        lines = head.split(b"\r\n")
        assert lines[0] == b"POST /v1/messages HTTP/1.1"
        assert {b"authorization: bearer k", b"x-api-key: k"} <= {line.lower() for line in lines}
    await client.aclose()
    server.close()
    await server.wait_closed()


async def test_a_streamed_answer_arrives_piece_by_piece_and_its_connection_is_kept() -> None:
    """The head first (the server has taken the call), then each chunk as the server sends it; a stream read to
    its end leaves the connection for the next call, one left half-read is closed."""
    sent = asyncio.Event()
    calls = 0

    async def sse(body: bytes, writer: asyncio.StreamWriter) -> bool:
        nonlocal calls
        calls += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await sent.wait()
        for event in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            if calls == 2:
                await asyncio.sleep(30)  # the rest never comes: the caller goes away mid-answer
        writer.write(b"0\r\n\r\n")
        return True

    client = UpstreamClient()
    async with _Server(sse) as server:
        async with client.stream(server.url + "/v1/completions", b"{}") as (head, pieces):
            assert (head.status_code, head.content_type) == (200, "text/event-stream")  # before any token
            sent.set()
            assert [piece async for piece in pieces] == [b"data: 1\n\n", b"data: 2\n\n"]
        async with client.stream(server.url + "/v1/completions", b"{}") as (head, pieces):
            assert await anext(pieces) == b"data: 1\n\n"  # then the caller goes away
        assert server.accepted == 1
        async with client.stream(server.url + "/v1/completions", b"{}") as (head, pieces):
            assert len([piece async for piece in pieces]) == 2
        assert server.accepted == 2  # the half-read connection was not reused
        await client.aclose()


async def test_an_engine_streams_through_the_hot_client() -> None:
    """vLLM's chat stream through the engine's own (hot) client: the stream opens at the first chunk, passes the
    deltas, ends in the whole answer; an error status raises before anything is yielded."""
    chunks = [{"prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                           "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": "hi"}, "token_ids": [7], "finish_reason": None,
                            "logprobs": {"content": [{"logprob": -0.5}]}}]},
              {"choices": [{"index": 0, "delta": {"content": "!"}, "token_ids": [8], "finish_reason": "stop",
                            "logprobs": {"content": [{"logprob": -0.25}]}}]}]
    calls: list[dict[str, object]] = []

    async def vllm(body: bytes, writer: asyncio.StreamWriter) -> bool:
        calls.append(orjson.loads(body))
        if len(calls) == 2:
            _answer(writer, b'{"error": "prompt too long"}', status=400)
            return True
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for event in [b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        writer.write(b"0\r\n\r\n")
        return True

    async with _Server(vllm) as server:
        engine = VLLMEngine(UpstreamPool([server.url]))
        request = ChatRequest.model_validate({"model": "policy", "messages": [{"role": "user", "content": "x"}]})
        pieces = [piece async for piece in engine.stream(request, "s1")]
        assert [p.prompt_ids for p in pieces if isinstance(p, StreamStart)] == [None, [1, 2, 3]]  # taken; IDs
        assert [p.content for p in pieces if isinstance(p, StreamDelta)] == ["hi", "!"]
        result = pieces[-1]
        assert isinstance(result, ChatResult) and result.text == "hi!" and result.response_ids == [7, 8]
        assert result.response_logprobs == [-0.5, -0.25] and calls[0]["stream"] is True
        with pytest.raises(RequestError, match="prompt too long"):
            _ = [piece async for piece in engine.stream(request, "s1")]
        assert server.accepted == 1
        await engine.aclose()
