"""The proxy's request path: authenticate, parse, ask the engine, journal, render. Framework-free: handlers get
bytes and return a :class:`Reply`, which the FastAPI app maps onto a response.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import logging
import os
import random
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
import pydantic

from polar_gym.known_json import KNOWN
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.base import Engine
from polar_gym.proxy.errors import (
    AuthError,
    PayloadTooLarge,
    ProxyError,
    RequestError,
    SessionMetadataError,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
    error_body,
    validation_message,
)
from polar_gym.proxy.heap import HeapTrimmer
from polar_gym.proxy.images import ImageLimits, image_refs, request_images
from polar_gym.proxy.passthrough import PassthroughCall, fill_record
from polar_gym.proxy.providers.base import Inbound, Provider, RenderContext, Route, encode_sse
from polar_gym.registry import PROVIDERS, RegistryError
from polar_gym.schema import CompletionRecord, SamplingOverride

__all__ = ["CallFailures", "ProxyService", "Reply", "SessionInfo", "SessionRegistry", "failure_cause",
           "new_admin_token", "new_call_id", "new_session_key", "session_key"]

log = logging.getLogger("polar_gym.proxy")

T = TypeVar("T")


@dataclass
class Reply:
    """What a handler answers. ``stream`` (when set) is sent as the body instead of ``body``, chunk by chunk."""

    status: int
    body: bytes
    media_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    stream: AsyncIterator[bytes] | None = None


@dataclass
class SessionInfo:
    """A served session. ``key`` is the secret its harness sends (None: the session id is the key, ad-hoc mode);
    ``attempt`` names the journal stream its calls go to (a gateway's dispatch attempt; None: the session's own)."""

    session_id: str
    model_name: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    attempt: str | None = None
    key: str | None = field(default=None, repr=False)
    #: the sampling values forced on every call (``metadata["sampling"]``, read once here); None: the harness's
    sampling: dict[str, float | int] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        """Read the session's sampling override; SessionMetadataError when it is not one (a registration's 400)."""
        raw = self.metadata.get("sampling")
        if raw is None:
            return
        try:
            values = SamplingOverride.model_validate(raw).overrides()
        except pydantic.ValidationError as exc:
            raise SessionMetadataError(f"invalid sampling override: {validation_message(exc)}") from exc
        self.sampling = values or None


def failure_cause(exc: ProxyError) -> str | None:
    """The cause of a model call that failed for infrastructure reasons, or None when the harness's own request was
    refused (a 4xx: bad JSON, unknown key, a prompt the server refuses), which is the policy's business."""
    if isinstance(exc, UpstreamTimeout):
        return "upstream_timeout"
    if isinstance(exc, UpstreamUnavailable):
        return "upstream_unreachable"
    if isinstance(exc, UpstreamError):
        return "upstream_error"
    return None


@dataclass
class CallFailures:
    """A session's model calls that failed for infrastructure reasons (see :func:`failure_cause`)."""

    by_cause: dict[str, int] = field(default_factory=dict)
    #: the last such failure, as ``cause: message`` (the message names the upstream URL)
    last_error: str = ""
    last_cause: str = ""
    #: a model call succeeded after the last failure (a blip the harness got past)
    recovered: bool = False

    @property
    def failed(self) -> int:
        return sum(self.by_cause.values())

    def summary(self) -> dict[str, Any]:
        return {"failed": self.failed, "by_cause": dict(self.by_cause), "last_error": self.last_error,
                "recovered": self.recovered}


def session_key(headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
    """The caller's key, wherever its SDK put it: Bearer, x-api-key, x-goog-api-key or ``?key=``."""
    auth = headers.get("authorization")
    if auth and auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return headers.get("x-api-key") or headers.get("x-goog-api-key") or query.get("key") or None


#: ids of calls and answers: unique, not secret, so a seeded generator instead of a getrandom call per id (two a
#: call were ~2 % of the proxy's CPU); reseeded in a forked child so two workers never share a sequence
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)


def new_call_id() -> str:
    """32 hex digits (a uuid4's length) naming a completion or an answer."""
    return f"{_ids.getrandbits(128):032x}"


def new_session_key() -> str:
    """A session key: 256 random bits, URL-safe (what a harness sends as its API key)."""
    return secrets.token_urlsafe(32)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class SessionRegistry:
    """Which keys are served, and by which session.

    A gateway registers each session with a fresh secret key (:func:`new_session_key`) for exactly its RUNNING
    stage and unregisters it after: the key then gets a 401, and the session's captures need the admin token.
    Keys are looked up by their SHA-256 and compared with :func:`hmac.compare_digest`, so the lookup's timing does
    not depend on how much of a guess is right.

    Ad-hoc mode (the standalone proxy without ``--registered-only``): a key that is not registered opens, or
    continues, a session of that name, so there the key IS the session name and anyone who knows it can use it.
    Nobody says when an ad-hoc session ends, so it ends when it goes quiet: one unused for ``idle_seconds`` (None:
    never) is forgotten, as are the least recently used beyond ``max_adhoc``; ``on_expire`` (else ``on_forget``)
    is told, so the service drops what it keeps per session and closes its journal files (flat memory and file
    descriptors over any number of sessions), and a session ``in_use`` (a call in flight) is not, even beyond
    ``max_adhoc``: its record is still to be written. Their journals stay on disk; a forgotten session that calls
    again is opened again.
    """

    def __init__(self, allow_adhoc: bool = False, *, max_adhoc: int = 256,
                 on_forget: Callable[[str], None] | None = None, idle_seconds: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.allow_adhoc = allow_adhoc
        self.max_adhoc = max_adhoc
        self.on_forget = on_forget
        #: told of an ad-hoc session forgotten for being idle or beyond ``max_adhoc`` (None: ``on_forget`` is)
        self.on_expire: Callable[[str], None] | None = None
        #: whether a session has a call in flight (such a session is never expired)
        self.in_use: Callable[[str], bool] | None = None
        self.idle_seconds = idle_seconds
        self.clock = clock
        self._sessions: dict[str, SessionInfo] = {}
        self._by_key: dict[bytes, str] = {}
        self._adhoc: collections.OrderedDict[str, SessionInfo] = collections.OrderedDict()
        self._last_used: dict[str, float] = {}  # ad-hoc session -> when it was last resolved

    def register(self, info: SessionInfo) -> SessionInfo:
        """Serve ``info`` under its key (the session id when it has none). Registering a session again replaces
        its key: the old one stops working."""
        self.unregister(info.session_id, forget=False)
        key = info.key if info.key is not None else info.session_id
        self._sessions[info.session_id] = info
        self._by_key[_digest(key)] = info.session_id
        return info

    def unregister(self, session_id: str, *, forget: bool = True) -> bool:
        """Revoke the session's key. True if it was served."""
        info = self._sessions.pop(session_id, None) or self._adhoc.pop(session_id, None)
        self._last_used.pop(session_id, None)
        if info is None:
            return False
        key = info.key if info.key is not None else info.session_id
        if self._by_key.get(_digest(key)) == session_id:
            del self._by_key[_digest(key)]
        if forget and self.on_forget is not None:
            self.on_forget(session_id)
        return True

    def get(self, session_id: str) -> SessionInfo | None:
        return self._sessions.get(session_id) or self._adhoc.get(session_id)

    def ids(self) -> list[str]:
        return sorted({*self._sessions, *self._adhoc})

    def count(self) -> int:
        """Sessions served now (registered and ad-hoc)."""
        return len(self._sessions) + len(self._adhoc)

    def _lookup(self, key: str) -> SessionInfo | None:
        digest = _digest(key)
        session_id = self._by_key.get(digest)
        info = self._sessions.get(session_id) if session_id is not None else None
        if info is None:
            return None
        expected = info.key if info.key is not None else info.session_id
        return info if hmac.compare_digest(_digest(expected), digest) else None

    def resolve(self, key: str | None) -> SessionInfo:
        """The session ``key`` is served as; AuthError (a 401 in the caller's protocol) when none."""
        if not key:
            raise AuthError("missing API key")
        info = self._lookup(key)
        if info is not None:
            return info
        if not self.allow_adhoc or key in self._sessions:
            raise AuthError("invalid API key: it belongs to no running session")
        now = self.clock()
        info = self._adhoc.get(key)
        if info is None:
            info = self._adhoc[key] = SessionInfo(session_id=key)
        else:
            self._adhoc.move_to_end(key)
        self._last_used[key] = now
        self.expire(now)
        return info

    def expire(self, now: float | None = None) -> list[str]:
        """Forget the ad-hoc sessions idle for ``idle_seconds`` and the least recently used beyond ``max_adhoc``
        (oldest first; O(1) when there are none); the ids forgotten."""
        now = self.clock() if now is None else now
        cutoff = now - self.idle_seconds if self.idle_seconds is not None else None
        expired: list[str] = []
        for _ in range(len(self._adhoc)):
            session_id = next(iter(self._adhoc))
            over = len(self._adhoc) > self.max_adhoc
            if not over and (cutoff is None or self._last_used.get(session_id, now) > cutoff):
                break
            if self.in_use is not None and self.in_use(session_id):
                self._adhoc.move_to_end(session_id)  # busy: looked at again once it has been idle as long
                self._last_used[session_id] = now
                continue
            self._adhoc.popitem(last=False)
            self._last_used.pop(session_id, None)
            expired.append(session_id)
            hook = self.on_expire or self.on_forget
            if hook is not None:
                hook(session_id)
        return expired

    def may_read(self, key: str | None, session_id: str) -> bool:
        """Whether ``key`` may read ``session_id``'s captures: its own live key; in ad-hoc mode also the session's
        name, unless the session is registered with a key of its own."""
        if not key:
            return False
        info = self._lookup(key)
        if info is not None:
            return hmac.compare_digest(info.session_id.encode(), session_id.encode())
        return (self.allow_adhoc and session_id not in self._sessions
                and hmac.compare_digest(_digest(key), _digest(session_id)))


class ProxyService:
    def __init__(self, engine: Engine, journal: CaptureJournal | None = None,
                 sessions: SessionRegistry | None = None, *, strict: bool = False,
                 max_body_bytes: int = 32 * 1024 * 1024, model_names: list[str] | None = None,
                 keepalive_after: float | None = 5.0, keepalive_interval: float = 10.0,
                 max_tokens_cap: int | None = None, image_limits: ImageLimits | None = None) -> None:
        self.engine = engine
        self.journal = journal if journal is not None else CaptureJournal()
        self.sessions = sessions if sessions is not None else SessionRegistry(allow_adhoc=True)
        if self.sessions.on_forget is None:
            self.sessions.on_forget = self.forget
        self.strict = strict
        self.max_body_bytes = max_body_bytes
        self.image_limits = image_limits if image_limits is not None else ImageLimits()
        self.model_names = model_names or ["policy"]
        #: the most tokens any call may sample, whatever the harness asks (harnesses ask for 32K; rollouts need less)
        self.max_tokens_cap = max_tokens_cap
        self.keepalive_after = keepalive_after
        self.keepalive_interval = keepalive_interval
        self.providers: dict[str, Provider[Any]] = {}
        self._background: set[asyncio.Future[Reply]] = set()
        self._streams: set[asyncio.Future[None]] = set()  # streamed calls being passed through
        self._inflight: dict[str, int] = {}  # model calls per session not yet journaled (see wait_idle)
        self._idle: dict[str, asyncio.Event] = {}
        #: model_calls_timed / model_call_ms: answered calls, their time (self-sizing pools read the engine's load)
        self.stats = {"requests": 0, "errors": 0, "prompt_tokens": 0, "response_tokens": 0, "model_calls_timed": 0,
                      "model_call_ms": 0}
        #: per session, model calls that failed for infrastructure reasons; a gateway takes them when it builds the
        #: session's result (bounded: the oldest entries go first in a standalone proxy nobody takes them from)
        self.call_failures: collections.OrderedDict[str, CallFailures] = collections.OrderedDict()
        self.max_tracked_failures = 10_000
        if self.sessions.on_expire is None:
            self.sessions.on_expire = self.forget_expired
        if self.sessions.in_use is None:
            self.sessions.in_use = self._inflight.__contains__
        #: (provider, ignored fields) combinations already logged: a harness sends the same ones on every call
        self._logged_ignored: set[tuple[str, tuple[str, ...]]] = set()
        self.heap = HeapTrimmer()

    def provider(self, name: str) -> Provider[Any]:
        provider = self.providers.get(name)
        if provider is None:
            cls = PROVIDERS.get(name)
            if not (isinstance(cls, type) and issubclass(cls, Provider)):
                raise RegistryError(f"provider {name!r} is not a Provider")
            provider = self.providers[name] = cls()
        return provider

    def error_reply(self, exc: ProxyError, provider: str) -> Reply:
        """``exc`` in the error shape of ``provider`` (OpenAI's when no such provider exists)."""
        try:
            status, body = self.provider(provider).error_body(exc)
        except RegistryError:
            status, body = error_body(exc, "openai")
        return Reply(status, orjson.dumps(body))

    def _read_body(self, raw: bytes, session_id: str) -> tuple[Any, bool]:
        """The parsed body, and whether it is known to serialize (orjson) back to ``raw``."""
        if len(raw) > self.max_body_bytes:
            raise PayloadTooLarge(f"request body of {len(raw)} bytes exceeds the limit of {self.max_body_bytes}")
        try:
            # the tools, system prompt and conversation the session sent last time are not parsed again
            return KNOWN.loads_checked(raw, session_id)
        except orjson.JSONDecodeError as exc:
            raise RequestError(f"malformed JSON body: {exc}") from exc

    def _parse(self, provider: Provider[Any], body: Any, route: Route) -> Inbound[Any]:
        if not isinstance(body, dict):
            raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
        inbound = provider.parse(body, route)
        if inbound.ignored_fields:
            if self.strict:
                raise RequestError(f"unknown fields: {', '.join(inbound.ignored_fields)}")
            seen = (provider.name, tuple(inbound.ignored_fields))
            if seen not in self._logged_ignored and len(self._logged_ignored) < 1024:
                self._logged_ignored.add(seen)  # once per combination, not a log line per call
                log.info("%s request: ignoring unknown fields %s", provider.name, inbound.ignored_fields)
        inbound.images = request_images(inbound.chat, self.image_limits)
        cap = self.max_tokens_cap
        if cap is not None and (inbound.chat.max_tokens is None or inbound.chat.max_tokens > cap):
            inbound.normalizations.append(f"max_tokens {inbound.chat.max_tokens} capped at {cap}")
            inbound.chat = inbound.chat.model_copy(update={"max_tokens": cap})  # validated already: no re-parse
        return inbound

    async def handle(self, provider_name: str, raw: bytes, route: Route, headers: Mapping[str, str],
                     disconnected: Callable[[], Awaitable[bool]] | None = None) -> Reply:
        """One model call, start to finish. Every failure becomes a provider-shaped error reply. ``disconnected``
        tells whether the caller has hung up (journaled as the record's ``delivered``)."""
        self.stats["requests"] += 1
        try:
            provider = self.provider(provider_name)
            info = self.sessions.resolve(session_key(headers, route.query))
            body, as_orjson_writes = self._read_body(raw, info.session_id)
            inbound = self._parse(provider, body, route)
            if info.sampling is not None:  # a trainer's forced sampling (greedy evaluation): every front end
                inbound.chat, note = inbound.chat.with_sampling(info.sampling)
                if note is not None:
                    inbound.normalizations.append(note)
            if inbound.stream and not inbound.stream_json_array and self.engine.stream_passthrough:
                return await self._stream_through(provider, inbound, body, info, route, disconnected, raw,
                                                  as_orjson_writes)
            work = self._counted(info.session_id, self._complete(provider, inbound, body, info, route, disconnected,
                                                                 raw, as_orjson_writes))
            if inbound.stream and self.keepalive_after is not None and not inbound.stream_json_array:
                return await self._stream_with_keepalive(provider, work)
            return await work
        except ProxyError as exc:
            self.stats["errors"] += 1
            return self.error_reply(exc, provider_name)
        except Exception as exc:  # a bug of ours: still answer in the caller's shape, and keep serving
            log.exception("%s request failed inside the proxy", provider_name)
            self.stats["errors"] += 1
            return self.error_reply(ProxyError(f"internal proxy error: {exc.__class__.__name__}: {exc}"), provider_name)

    def _timed_call(self, seconds: float | None) -> None:
        self.stats["model_calls_timed"] += 1
        self.stats["model_call_ms"] += round((seconds or 0.0) * 1000)

    async def _counted(self, session_id: str, work: Awaitable[T]) -> T:
        """Count the call as in flight until it is journaled, even when it finishes after the harness hung up."""
        self._inflight[session_id] = self._inflight.get(session_id, 0) + 1
        try:
            return await work
        finally:
            self._inflight[session_id] -= 1
            if self._inflight[session_id] <= 0:
                del self._inflight[session_id]
                idle = self._idle.pop(session_id, None)
                if idle is not None:
                    idle.set()

    def _note_call(self, session_id: str, exc: ProxyError | None, cause: str | None = None) -> None:
        """Count a finished model call: infrastructure failures by cause, and whether a success came after them."""
        entry = self.call_failures.get(session_id)
        if exc is None:
            if entry is not None:
                entry.recovered = True
            return
        cause = cause or failure_cause(exc)
        if cause is None:
            return
        if entry is None:
            entry = self.call_failures[session_id] = CallFailures()
            while len(self.call_failures) > self.max_tracked_failures:
                self.call_failures.popitem(last=False)
        entry.by_cause[cause] = entry.by_cause.get(cause, 0) + 1
        entry.last_cause, entry.last_error, entry.recovered = cause, f"{cause}: {exc.message}", False

    def take_call_failures(self, session_id: str) -> CallFailures | None:
        """The session's infrastructure failures (None: there were none), forgotten here once taken."""
        return self.call_failures.pop(session_id, None)

    async def wait_idle(self, session_id: str, timeout: float | None = None) -> bool:
        """Wait until no model call of the session is in flight, so its journal is complete (a gateway calls this
        after the harness ends and before building). False when calls are still running at ``timeout``."""
        if not self._inflight.get(session_id):
            return True
        idle = self._idle.setdefault(session_id, asyncio.Event())
        try:
            async with asyncio.timeout(timeout):
                await idle.wait()
        except TimeoutError:
            return False
        return True

    async def _stream_with_keepalive(self, provider: Provider[Any], work: Coroutine[Any, Any, Reply]) -> Reply:
        """A stream whose engine call is slow starts answering anyway: SSE comments keep the harness's idle timer
        from firing while the one upstream call runs. A fast call (the usual case) is answered all at once, so its
        errors still get a proper HTTP status; a late error is sent as the provider's in-stream error event."""
        task: asyncio.Future[Reply] = asyncio.ensure_future(work)
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.keepalive_after)
        except TimeoutError:
            pass
        self._background.add(task)  # the call completes and is journaled even if the harness hangs up
        task.add_done_callback(self._background.discard)

        async def chunks() -> AsyncIterator[bytes]:
            while True:
                try:
                    reply = await asyncio.wait_for(asyncio.shield(task), self.keepalive_interval)
                except TimeoutError:
                    yield provider.keepalive
                    continue
                except ProxyError as exc:
                    self.stats["errors"] += 1
                    yield encode_sse(provider.stream_error(exc))
                    return
                yield reply.body
                return

        return Reply(200, b"", "text/event-stream", {"cache-control": "no-cache"}, stream=chunks())

    async def _stream_through(self, provider: Provider[Any], inbound: Inbound[Any], body: dict[str, Any],
                              info: SessionInfo, route: Route,
                              disconnected: Callable[[], Awaitable[bool]] | None, received: bytes,
                              received_is_orjson: bool = False) -> Reply:
        """A streamed call passed through as the engine samples (:mod:`polar_gym.proxy.passthrough`): answered
        once the engine has taken the call (or refused it, as a plain error reply), or after ``keepalive_after``
        with keep-alives until it has. The record is built when the call ends, off the first byte's path."""
        session_id = info.session_id

        async def journal(record: CompletionRecord) -> None:
            if record.status != "error":
                self._timed_call(record.total_seconds)
            await self.journal.append(record, info.attempt, received=received, received_is_orjson=received_is_orjson)

        def finished(exc: ProxyError | None, result: Any, cause: str | None) -> None:
            self._note_call(session_id, exc, cause)
            if exc is not None:
                self.stats["errors"] += 1
            if result is not None:
                self.stats["prompt_tokens"] += len(result.prompt_ids)
                self.stats["response_tokens"] += len(result.response_ids)

        call = PassthroughCall(self.engine, provider, inbound,
                               lambda: self._new_record(provider, inbound, body, info, route),
                               session_id, journal, finished, disconnected)
        task = asyncio.ensure_future(self._counted(session_id, call.run()))
        self._streams.add(task)  # runs to the end (and is journaled) even if the harness hangs up
        task.add_done_callback(self._streams.discard)
        first = await call.first(self.keepalive_after)
        if isinstance(first, ProxyError):  # journaled and counted by the call
            return self.error_reply(first, provider.name)
        return Reply(200, b"", "text/event-stream", {"cache-control": "no-cache"},
                     stream=call.chunks(first, self.keepalive_interval))

    def _new_record(self, provider: Provider[Any], inbound: Inbound[Any], body: dict[str, Any], info: SessionInfo,
                    route: Route) -> CompletionRecord:
        return CompletionRecord(
            completion_id=new_call_id(), session_id=info.session_id, index=-1, provider=provider.name,
            engine=self.engine.name, model=inbound.model, stream=inbound.stream,
            side_request=info.model_name is not None and inbound.model != info.model_name,
            path=route.path + ("?" + "&".join(f"{k}={v}" for k, v in route.query.items()) if route.query else ""),
            request=body, normalized_request=inbound.chat.dump(),
            normalizations=inbound.normalizations, started_at=time.time(),
            token_faithful=self.engine.token_faithful, images=image_refs(inbound.images, [], None)[0],
        )

    async def _complete(self, provider: Provider[Any], inbound: Inbound[Any], body: dict[str, Any],
                        info: SessionInfo, route: Route, disconnected: Callable[[], Awaitable[bool]] | None = None,
                        received: bytes | None = None, received_is_orjson: bool = False) -> Reply:
        t0 = time.perf_counter()
        record = self._new_record(provider, inbound, body, info, route)
        try:
            result = await self.engine.complete(inbound.chat, info.session_id)
        except ProxyError as exc:
            record.status, record.error = "error", f"{exc.__class__.__name__}: {exc.message}"
            record.token_faithful = False
            record.total_seconds = time.perf_counter() - t0
            await self.journal.append(record, info.attempt, received=received, received_is_orjson=received_is_orjson)
            self._note_call(info.session_id, exc)
            raise
        except Exception as exc:  # an engine bug must not take the proxy down or vanish from the journal
            log.exception("engine %s failed", self.engine.name)
            record.status, record.error = "error", f"{exc.__class__.__name__}: {exc}"
            record.token_faithful = False
            await self.journal.append(record, info.attempt, received=received, received_is_orjson=received_is_orjson)
            failure = UpstreamError(f"engine {self.engine.name} failed: {exc.__class__.__name__}: {exc}")
            self._note_call(info.session_id, failure, "engine_error")
            raise failure from exc
        ctx = RenderContext(response_id=provider.id_prefix + new_call_id()[:24], created=int(record.started_at))
        if inbound.stream and inbound.stream_json_array:
            # Google's streamGenerateContent without alt=sse: the same chunks, as one JSON array.
            events = provider.stream(result, inbound, ctx)
            reply = Reply(200, orjson.dumps([e.data for e in events]))
        elif inbound.stream:
            events = provider.stream(result, inbound, ctx)
            reply = Reply(200, b"".join(encode_sse(e) for e in events), "text/event-stream",
                          {"cache-control": "no-cache"})
        else:
            reply = Reply(200, orjson.dumps(KNOWN.as_fragments(provider.render(result, inbound, ctx))))
        fill_record(record, result, ctx.response_id, inbound.images, self.engine.image_token_id)
        record.total_seconds = time.perf_counter() - t0
        self._timed_call(record.total_seconds)
        if disconnected is not None:  # a harness that hung up (timed out) never reads this answer
            record.delivered = not await disconnected()
        await self.journal.append(record, info.attempt, received=received, received_is_orjson=received_is_orjson)
        self._note_call(info.session_id, None)
        self.stats["prompt_tokens"] += len(result.prompt_ids)
        self.stats["response_tokens"] += len(result.response_ids)
        return reply

    async def count_tokens(self, provider_name: str, raw: bytes, route: Route, headers: Mapping[str, str]) -> Reply:
        try:
            provider = self.provider(provider_name)
            info = self.sessions.resolve(session_key(headers, route.query))
            body, _ = self._read_body(raw, info.session_id)
            if not isinstance(body, dict):
                raise RequestError("request body must be a JSON object")
            inbound = provider.parse_count(body, route)  # UnsupportedRoute when the protocol has no such call
            count = await self.engine.count_tokens(inbound.chat, info.session_id)
            return Reply(200, orjson.dumps(provider.render_count(count)))
        except ProxyError as exc:
            return self.error_reply(exc, provider_name)

    async def completions(self, session_id: str, attempt: str | None = None) -> list[CompletionRecord]:
        """The session's captures: of ``attempt``, else of its latest attempt (or its own stream)."""
        return await self.journal.records(session_id, attempt)

    def forget_expired(self, session_id: str) -> None:
        """An ad-hoc session went idle (or aged out): drop everything kept for it in memory, its journal stream's
        encoder state and failure counts included (nobody takes those in a standalone proxy). Its journal stays on
        disk and reopens if the session calls again."""
        self.forget(session_id)
        self.journal.release(session_id)
        self.call_failures.pop(session_id, None)

    def forget(self, session_id: str) -> None:
        """Drop what the service keeps per session once the session is over (its key is revoked or an ad-hoc
        session aged out): the engine pool's sticky server and what the engine keeps for it (an oracle script).
        The journal stays on disk."""
        self.engine.pool.forget(session_id)
        self.engine.close_session(session_id)
        KNOWN.forget(session_id)
        self.heap.released()  # what it kept goes back to the OS, not only to the allocator
        if not self._inflight.get(session_id):
            self._idle.pop(session_id, None)


def new_admin_token() -> str:
    return secrets.token_urlsafe(24)
