"""Streaming pass-through with capture: a harness's streamed call is streamed as the engine samples it, and
journaled exactly as the same call not streamed would be.

One task (:meth:`PassthroughCall.run`) reads the engine's pieces, renders them into the provider's events and
queues the bytes; the response reads the queue. The stream opens as soon as the engine has taken the prompt (its
answer's head: the opening events need no token of it), except that an opening that says how long the prompt is
(Anthropic's) waits for the prompt's IDs when only the engine knows them (chat mode); the call's record is
built when the call ends, off the first byte's path. The task runs to the end whatever the harness does, so a
harness that hangs up mid-stream still gets its call journaled (``delivered: false``), and an engine that fails
mid-stream leaves a record of what it had sampled (prompt, tokens, logprobs) with the error, which the harness gets
as its protocol's stream error event. A failure before the engine takes the call (an error status, a server that cannot
be reached) is answered with a plain error status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from polar_gym.proxy.chat import ChatResult
from polar_gym.proxy.engines.base import Engine, StreamDelta, StreamStart
from polar_gym.proxy.errors import ProxyError, UpstreamError
from polar_gym.proxy.images import RequestImage, image_refs
from polar_gym.proxy.providers.anthropic.stream import MessagesStream
from polar_gym.proxy.providers.base import Inbound, Provider, RenderContext, SSEEvent, encode_sse
from polar_gym.proxy.providers.google.stream import GenerateContentStream
from polar_gym.proxy.providers.openai_chat.stream import ChatStream
from polar_gym.proxy.providers.openai_responses.stream import ResponsesStream
from polar_gym.proxy.providers.stream import StreamRenderer, SynthesizedStream
from polar_gym.schema import CompletionRecord

__all__ = ["PassthroughCall", "fill_record", "stream_renderer"]

log = logging.getLogger("polar_gym.proxy")

_RENDERERS: dict[str, type[StreamRenderer]] = {
    "anthropic": MessagesStream, "openai_chat": ChatStream, "openai_responses": ResponsesStream,
    "google": GenerateContentStream,
}


def stream_renderer(provider: Provider[Any], inbound: Inbound[Any], ctx: RenderContext) -> StreamRenderer:
    """The provider's pass-through renderer; a provider without one gets its synthesized stream at the end."""
    cls = _RENDERERS.get(provider.name)
    return cls(inbound, ctx) if cls is not None else SynthesizedStream(provider, inbound, ctx)


def fill_record(record: CompletionRecord, result: ChatResult, response_id: str, images: list[RequestImage],
                image_token_id: int | None) -> None:
    """What a finished call puts on its record, streamed through or not; ``images``: the request's, placed in the
    prompt by the model's ``image_token_id`` when it is known."""
    refs, note = image_refs(images, result.prompt_ids, image_token_id)
    notes = [*record.normalizations, note] if note is not None else list(record.normalizations)
    values: dict[str, Any] = {
        "response": {"id": response_id, "message": result.message.model_dump(exclude_none=True),
                     "usage": result.usage.model_dump()},
        "prompt_ids": result.prompt_ids, "response_ids": result.response_ids,
        "response_logprobs": result.response_logprobs, "finish_reason": result.finish_reason,
        "token_faithful": result.token_faithful, "prompt_mode": result.raw.get("prompt_mode"),
        "unparseable_tool_calls": int(result.raw.get("unparseable_tool_calls", 0)),
        "malformed_tool_call_spans": list(result.raw.get("malformed_tool_call_spans") or ()),
        "server": result.server, "policy_version": result.policy_version,
        "upstream_seconds": float(result.raw.get("upstream_seconds", 0.0)),
    }
    if images:
        values["images"] = refs
    if result.version_spans is not None:  # a generation cut by weight updates, sampled by several versions
        values["version_spans"] = result.version_spans
    if result.raw.get("new_chain"):  # token_in rendered the whole prompt: say why (a new chain starts)
        notes.append(f"token_in_new_chain:{result.raw['new_chain']}")
    if notes != record.normalizations:
        values["normalizations"] = notes
    record.set_fields(values)


def _encode(events: list[SSEEvent]) -> bytes:
    return b"".join(encode_sse(e) for e in events)


#: the end of a stream in the queue
_END = b""


@dataclass
class PassthroughCall:
    """One streamed model call. ``new_record`` builds its record (called once, when the call ends, so the first
    byte never waits for it; stamped with ``started_at``, when the call came in); ``journal`` appends the record;
    ``finished`` is told how the call ended (the error, or None), its result, and the failure's cause when it was a
    bug rather than the upstream's."""

    engine: Engine
    provider: Provider[Any]
    inbound: Inbound[Any]
    new_record: Callable[[], CompletionRecord]
    session_id: str
    journal: Callable[[CompletionRecord], Awaitable[None]]
    finished: Callable[[ProxyError | None, ChatResult | None, str | None], None]
    disconnected: Callable[[], Awaitable[bool]] | None = None
    queue: asyncio.Queue[bytes | ProxyError] = field(default_factory=asyncio.Queue)
    client_gone: bool = False
    started_at: float = field(default_factory=time.time)
    _record: CompletionRecord | None = None

    @property
    def record(self) -> CompletionRecord:
        """The call's record, built on first use."""
        if self._record is None:
            self._record = self.new_record()
            self._record.started_at = self.started_at
        return self._record

    async def run(self) -> None:
        """Sample, render and journal the call (never raises: a failure is journaled and queued)."""
        try:
            await self._run()
        except Exception as exc:  # a bug of ours past the engine (building the record): the client still hears
            log.exception("a streamed %s call failed inside the proxy", self.provider.name)
            self.queue.put_nowait(ProxyError(f"internal proxy error: {exc.__class__.__name__}: {exc}"))

    async def _run(self) -> None:
        t0 = time.perf_counter()
        ctx = RenderContext(response_id=self.provider.id_prefix + uuid.uuid4().hex[:24], created=int(self.started_at))
        renderer = stream_renderer(self.provider, self.inbound, ctx)
        prompt_ids: list[int] = []
        sampled: list[int] = []
        logprobs: list[float] = []
        result: ChatResult | None = None
        opened = False
        try:
            async with contextlib.aclosing(self.engine.stream(self.inbound.chat, self.session_id)) as pieces:
                async for piece in pieces:
                    if isinstance(piece, StreamStart):
                        prompt_ids = piece.prompt_ids if piece.prompt_ids is not None else prompt_ids
                        if not opened and (piece.prompt_ids is not None or not renderer.needs_prompt_tokens):
                            opened = True
                            # a protocol with nothing to open with (Gemini) opens with its keep-alive: the
                            # harness hears from the call as soon as the engine has it
                            self._send(renderer.start(len(prompt_ids)) or self.provider.keepalive)
                    elif isinstance(piece, StreamDelta):
                        sampled += piece.token_ids
                        logprobs += piece.logprobs
                        self._send(renderer.delta(piece.reasoning, piece.content))
                    else:
                        result = piece
            if result is None:
                raise UpstreamError(f"engine {self.engine.name} ended its stream without an answer")
        except ProxyError as exc:
            await self._failed(exc, exc, prompt_ids, sampled, logprobs, t0)
            return
        except Exception as exc:  # an engine bug must not lose the call or take the proxy down
            log.exception("engine %s failed mid-stream", self.engine.name)
            failure = UpstreamError(f"engine {self.engine.name} failed: {exc.__class__.__name__}: {exc}")
            await self._failed(failure, exc, prompt_ids, sampled, logprobs, t0, "engine_error")
            return
        record = self.record
        fill_record(record, result, ctx.response_id, self.inbound.images, self.engine.image_token_id)
        record.total_seconds = time.perf_counter() - t0
        try:
            events: list[SSEEvent] | None = renderer.finish(result)
        except Exception:  # a renderer bug: the sample is still journaled, the harness gets a stream error
            log.exception("rendering the end of a %s stream failed", self.provider.name)
            events = None
        if self.disconnected is not None:
            record.delivered = events is not None and not (self.client_gone or await self.disconnected())
        await self.journal(record)
        self.finished(None, result, None)
        if events is None:
            self.queue.put_nowait(ProxyError("internal proxy error: the stream could not be rendered"))
            return
        self._send(events)
        self.queue.put_nowait(_END)

    async def _failed(self, exc: ProxyError, cause: BaseException, prompt_ids: list[int], sampled: list[int],
                      logprobs: list[float], t0: float, failure: str | None = None) -> None:
        """Journal what was sampled before the failure, with the error, and queue the error for the client."""
        record = self.record
        record.status = "error"
        record.error = (f"{exc.__class__.__name__}: {exc.message}" if cause is exc
                        else f"{cause.__class__.__name__}: {cause}")
        record.token_faithful = False
        record.prompt_ids, record.response_ids = prompt_ids, sampled
        record.response_logprobs = logprobs if len(logprobs) == len(sampled) else []
        record.total_seconds = time.perf_counter() - t0
        await self.journal(record)
        self.finished(exc, None, failure)
        self.queue.put_nowait(exc)

    def _send(self, events: list[SSEEvent] | bytes) -> None:
        if events and not self.client_gone:
            self.queue.put_nowait(events if isinstance(events, bytes) else _encode(events))

    async def first(self, timeout: float | None) -> bytes | ProxyError | None:
        """The first thing to send (None: nothing within ``timeout``, the engine is still prefilling)."""
        try:
            async with asyncio.timeout(timeout):
                return await self.queue.get()
        except TimeoutError:
            return None

    async def chunks(self, first: bytes | None, keepalive_interval: float) -> AsyncIterator[bytes]:
        """The response body: ``first``, then what the task queues, keep-alives while it is quiet, and the
        provider's stream error event if the engine fails."""
        try:
            if first == _END:  # the whole answer rendered to nothing (a renderer with nothing to say)
                return
            yield first or self.provider.keepalive
            while True:
                try:
                    async with asyncio.timeout(keepalive_interval):
                        item = await self.queue.get()
                except TimeoutError:
                    yield self.provider.keepalive
                    continue
                ready = [item]
                while isinstance(ready[-1], bytes) and ready[-1] != _END and not self.queue.empty():
                    ready.append(self.queue.get_nowait())  # what queued up meanwhile goes out in one write
                last = ready[-1]
                body = b"".join(r for r in ready if isinstance(r, bytes))
                if isinstance(last, ProxyError):
                    body += encode_sse(self.provider.stream_error(last))
                if body:
                    yield body
                if isinstance(last, ProxyError) or last == _END:
                    return
        finally:
            self.client_gone = True  # the harness hung up, or the stream ended: nothing more is queued
