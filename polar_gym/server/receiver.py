"""The trainer's end of task callbacks: a tiny HTTP app the rollout server POSTs each finished task to.

Its port is open to whoever can reach it, so it trusts nothing but its secret (polar_gym.server.signing):

- a delivery is taken only for a task id the receiver expects (``attach``, ``expect`` or ``wait_for`` named it), and
  only when signed with its secret: a forged body never reaches ``on_task`` or ``wait_for``, so it can never make the
  genuine one a "duplicate";
- what can be refused from the headers is refused before a byte of the body is read (401 unsigned or stale, 404 an
  unexpected task, 415 neither JSON nor packed results); a declared Content-Length over ``max_body_bytes`` is
  refused at once and a streamed body is cut off at the cap (413, polar_gym.httpguard.BodyGuard); a JSON body whose
  first byte cannot start an object is refused at that byte, a signed body that does not decode once read (400);
- bodies delivered and not yet taken are bounded by count and bytes (``max_pending``, ``max_pending_bytes``). The
  policy: a body ``wait_for`` has not taken yet is never dropped; when the bounds are reached, bodies already handed to
  ``on_task`` are evicted oldest first (counted in ``evicted`` and logged), and when that is not enough the delivery
  is answered 503 (counted in ``refused["full"]``, logged): the server retries it with backoff.

Every refusal answers in the polar_gym.web error envelope ``{"error": {"type", "message"}}``.

``attach`` asks the server for packed callbacks (``callback_format="packed"``, polar_gym.result_codec): about 20x
fewer bytes on the wire and in the pending bounds, decoded here in a worker thread into the same JSON task view a
``json`` callback carries, so ``on_task`` and ``wait_for`` see one shape.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from polar_gym.httpguard import TokenCheck, excerpt
from polar_gym.result_codec import MEDIA_TYPE, read_frame, unpack
from polar_gym.schema import TaskRequest
from polar_gym.server.signing import MAX_SKEW, BodyVerifier, SignatureError, new_secret
from polar_gym.serving import free_port, serving
from polar_gym.web import error_response, install

__all__ = ["KEY_PREFIX", "CallbackEvicted", "CallbackReceiver"]

log = logging.getLogger(__name__)

#: a task's idempotency key is this prefix and its task id
KEY_PREFIX = "polar-task-"
_JSON_START = b"{"
_WHITESPACE = b" \t\r\n"
#: bodies over this size are parsed in a worker thread, not on the event loop
_THREAD_PARSE_BYTES = 1024 * 1024
#: a refusal first reads and drops up to this much of an unread body, for at most this long (as BodyGuard does)
_DRAIN_BYTES, _DRAIN_SECONDS = 1024 * 1024, 1.0
#: delivered keys remembered to acknowledge the server's repeats (ids only; the oldest are forgotten first)
_MAX_DELIVERED_KEYS = 1_000_000


def _packed_view(raw: bytes) -> dict[str, Any]:
    """A packed callback (polar_gym.result_codec.frame_results) as the JSON task view it stands for."""
    view, results = read_frame(raw)
    view["results"] = [unpack(blob).model_dump(mode="json") for blob in results]
    return view


async def _drain(request: Request) -> None:
    """Read and drop up to _DRAIN_BYTES of a body not read to its end (for at most _DRAIN_SECONDS) before a refusal:
    closing a socket with unread data resets it, and the sender would see a reset instead of the answer."""
    if getattr(request.state, "body_read", False):
        return
    loop = asyncio.get_running_loop()
    end, dropped = loop.time() + _DRAIN_SECONDS, 0
    while dropped <= _DRAIN_BYTES:
        try:
            message = await asyncio.wait_for(request.receive(), max(0.0, end - loop.time()))
        except TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        dropped += len(message.get("body", b""))


class CallbackEvicted(LookupError):
    """``wait_for`` of a task whose body was handed to ``on_task`` and then evicted to bound the receiver's memory."""


class _Refused(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


class CallbackReceiver:
    """A FastAPI app receiving signed task callbacks (see the module docstring). Each task's body is handed to
    ``on_task`` once and kept for ``wait_for``; the server's repeats are acknowledged (200) and dropped.

    ``secret``: the shared secret (default: a fresh random one; it never leaves this process except in the
    TaskRequests ``attach`` stamps). ``received`` holds the bodies not yet taken by ``wait_for``, by idempotency key;
    ``deliveries`` counts every POST, ``refused`` the refusals by kind, ``evicted`` the bodies dropped to stay in
    bounds."""

    def __init__(self, on_task: Callable[[dict[str, Any]], Awaitable[None] | None] | None = None, *,
                 secret: str | None = None, max_body_bytes: int = 128 * 1024 * 1024, max_pending: int = 1024,
                 max_pending_bytes: int = 1024 * 1024 * 1024, max_skew: float = MAX_SKEW) -> None:
        if secret is not None and len(secret) < 16:
            raise ValueError("a callback secret has at least 16 characters")
        if min(max_body_bytes, max_pending, max_pending_bytes) < 1 or max_skew <= 0:
            raise ValueError("max_body_bytes, max_pending, max_pending_bytes and max_skew must be positive")
        if max_pending_bytes < max_body_bytes:
            raise ValueError("max_pending_bytes must hold at least one body of max_body_bytes")
        self.on_task = on_task
        self.secret = secret or new_secret()
        self.max_body_bytes, self.max_pending, self.max_pending_bytes = max_body_bytes, max_pending, max_pending_bytes
        self.max_skew = max_skew
        #: the callback_url ``serve`` yielded (``attach`` stamps it)
        self.url: str | None = None
        self.expected: set[str] = set()
        self.received: dict[str, dict[str, Any]] = {}
        self.deliveries = 0
        self.refused: collections.Counter[str] = collections.Counter()
        self.evicted = 0
        self.arrived = asyncio.Event()
        self._sizes: dict[str, int] = {}  # pending key -> its body's bytes
        self._pending_bytes = 0
        self._handled: dict[str, None] = {}  # pending keys handed to on_task, oldest first (evictable)
        self._delivered: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._gone: set[str] = set()  # evicted keys (wait_for raises CallbackEvicted)
        self._busy: set[str] = set()  # keys whose delivery is being handled right now
        self._changed = asyncio.Condition()
        self.app = FastAPI(title="polar_gym callback receiver", docs_url=None, redoc_url=None, openapi_url=None)
        self.app.post("/callback")(self._receive)
        install(self.app, TokenCheck(None), needs_token=lambda method, path: False,
                limit=lambda method, path: self.max_body_bytes)

    # -- the trainer's side ----------------------------------------------------------------------------------

    def expect(self, task_id: str) -> None:
        """Accept the callback of ``task_id`` (signed with this receiver's secret) from now on."""
        self.expected.add(task_id)

    def attach(self, task: TaskRequest, callback_url: str | None = None) -> TaskRequest:
        """``task`` calling back here: its callback_url (default: the one ``serve`` yielded) and this receiver's
        secret set, and its task id expected. Use it before submitting, so that an early callback is taken."""
        url = callback_url or self.url
        if url is None:
            raise RuntimeError("no callback_url: call attach inside `async with receiver.serve()` or pass one")
        self.expect(task.task_id)
        return task.model_copy(update={"callback_url": url, "callback_secret": self.secret,
                                       "callback_format": "packed"})

    async def wait_for(self, task_id: str, timeout: float = 3600.0) -> dict[str, Any]:
        """The callback body of ``task_id`` (a task view with every SessionResult) once it arrived; the receiver
        lets go of it (each body is taken once). CallbackEvicted when it was handed to ``on_task`` and evicted."""
        key = KEY_PREFIX + task_id
        if key not in self.received and key not in self._delivered:
            self.expect(task_id)
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(
                lambda: key in self.received or key in self._gone or key in self._delivered), timeout)
        if key in self.received:
            self._handled.pop(key, None)
            self._pending_bytes -= self._sizes.pop(key, 0)
            return self.received.pop(key)
        raise CallbackEvicted(f"the callback of task {task_id!r} was handed to on_task and then evicted (more than "
                              f"{self.max_pending} bodies or {self.max_pending_bytes} bytes pending)"
                              if key in self._gone else f"the callback of task {task_id!r} was already taken")

    @contextlib.asynccontextmanager
    async def serve(self, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None) -> AsyncIterator[str]:
        """Serve the receiver on ``host:port`` in this event loop while the block runs; yields the callback_url
        (``attach`` puts it and the secret in TaskRequests; ``advertise`` is the host the rollout server uses to
        reach this process)."""
        port = port or free_port(host)
        async with serving(self.app, host, port):
            self.url = f"http://{advertise or host}:{port}/callback"
            try:
                yield self.url
            finally:
                self.url = None

    # -- the server's side -----------------------------------------------------------------------------------

    async def _receive(self, request: Request) -> JSONResponse:
        self.deliveries += 1
        try:
            return await self._take(request)
        except _Refused as exc:
            self.refused[exc.kind] += 1
            await _drain(request)
            answer = error_response(exc.status, exc.kind, exc.message)
            if exc.status in (409, 503):
                answer.headers["retry-after"] = "1"
            return answer

    def _task_key(self, request: Request) -> tuple[str, str, bool]:
        key = request.headers.get("idempotency-key")
        if not key:
            raise _Refused(400, "missing_idempotency_key", "missing idempotency-key header")
        if not key.startswith(KEY_PREFIX) or len(key) == len(KEY_PREFIX):
            raise _Refused(400, "invalid_idempotency_key", f"the idempotency-key is {KEY_PREFIX}<task id>")
        task_id = key[len(KEY_PREFIX):]
        if task_id not in self.expected and key not in self._delivered and key not in self.received:
            raise _Refused(404, "unexpected_task", "this receiver does not expect a callback for that task")
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type not in ("application/json", MEDIA_TYPE):
            raise _Refused(415, "not_json", f"a callback body is JSON (content-type: application/json) or packed "
                                            f"results ({MEDIA_TYPE})")
        return key, task_id, content_type == MEDIA_TYPE

    async def _read(self, request: Request, verifier: BodyVerifier, packed: bool) -> bytes:
        """The body, read chunk by chunk into the MAC: refused at its first byte when that cannot start a JSON
        object (BodyGuard cuts it at the size cap)."""
        chunks: list[bytes] = []
        started = packed
        async for chunk in request.stream():
            if not started and chunk.lstrip(_WHITESPACE):
                if not chunk.lstrip(_WHITESPACE).startswith(_JSON_START):
                    raise _Refused(400, "not_json", "the callback body is not a JSON object")
                started = True
            verifier.update(chunk)
            chunks.append(chunk)
        request.state.body_read = True
        if not started or not chunks:
            raise _Refused(400, "not_json", "the callback body is empty")
        return b"".join(chunks)

    async def _take(self, request: Request) -> JSONResponse:
        key, task_id, packed = self._task_key(request)
        try:
            verifier = BodyVerifier(self.secret, request.headers, key, max_skew=self.max_skew)
        except SignatureError as exc:
            raise _Refused(401, exc.kind, str(exc)) from exc
        raw = await self._read(request, verifier, packed)
        try:
            verifier.verify()
        except SignatureError as exc:
            log.warning("refused a callback for task %r: %s", task_id, exc)
            raise _Refused(401, exc.kind, str(exc)) from exc
        if key in self._delivered or key in self.received:
            return JSONResponse({"duplicate": True, "key": key})
        if key in self._busy:
            raise _Refused(409, "in_progress", "this task's callback is being handled; retry later")
        try:
            body = await asyncio.to_thread(_packed_view, raw) if packed else \
                await asyncio.to_thread(orjson.loads, raw) if len(raw) > _THREAD_PARSE_BYTES else orjson.loads(raw)
        except ValueError as exc:
            raise _Refused(400, "invalid_callback", f"the callback body cannot be read: {excerpt(exc, 200)}") from exc
        if not isinstance(body, dict) or body.get("task_id") != task_id:
            raise _Refused(400, "invalid_callback", "the body is not the view of the task its idempotency-key names")
        self._make_room(len(raw), task_id)
        self._busy.add(key)
        try:
            if self.on_task is not None:
                out = self.on_task(body)
                if isinstance(out, Awaitable):
                    await out
        except StarletteHTTPException:
            raise  # the handler's own answer (in the error envelope); the server retries
        except Exception as exc:  # the server retries: the delivery is not recorded
            log.exception("callback receiver: on_task failed for task %r", task_id)
            raise _Refused(500, "handler_failed", f"on_task raised {exc.__class__.__name__}; retry later") from exc
        finally:
            self._busy.discard(key)
        # recorded only once handled: a failing handler gets the retry
        self.received[key], self._sizes[key] = body, len(raw)
        self._pending_bytes += len(raw)
        if self.on_task is not None:
            self._handled[key] = None
        self.expected.discard(task_id)
        self._delivered[key] = None
        while len(self._delivered) > _MAX_DELIVERED_KEYS:
            self._gone.discard(self._delivered.popitem(last=False)[0])
        self.arrived.set()
        async with self._changed:
            self._changed.notify_all()
        return JSONResponse({"duplicate": False, "key": key})

    def _make_room(self, size: int, task_id: str) -> None:
        """Evict bodies already handed to on_task (oldest first) until one more of ``size`` bytes fits; 503 when
        only bodies nobody has taken yet are left."""
        def full() -> bool:
            return len(self.received) + 1 > self.max_pending or self._pending_bytes + size > self.max_pending_bytes

        while full() and self._handled:
            old = next(iter(self._handled))
            del self._handled[old]
            self.received.pop(old, None)
            self._pending_bytes -= self._sizes.pop(old, 0)
            self._gone.add(old)
            self.evicted += 1
            log.warning("callback receiver: evicted the body of %r (handed to on_task, not taken by wait_for) to "
                        "stay within %d bodies / %d bytes", old, self.max_pending, self.max_pending_bytes)
        if full():
            log.warning("callback receiver: refused task %r's callback for now (503): %d bodies (%d bytes) wait "
                        "for wait_for; the server retries it", task_id, len(self.received), self._pending_bytes)
            raise _Refused(503, "full", f"{len(self.received)} callbacks wait to be taken by wait_for "
                                        f"(at most {self.max_pending} bodies, {self.max_pending_bytes} bytes)")
