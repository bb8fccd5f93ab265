"""Bounded input for every HTTP API of ours (rollout server, gateway session API, proxy admin routes): the token is
checked before a byte of the body is read, bodies are capped while they stream in, JSON depth is bounded, error
bodies quote only a short excerpt of the input, and upstream URLs are validated.

Why one ASGI middleware and not per-route code: FastAPI reads and parses a route's body *before* its dependencies
run, so a token check in a dependency or a handler comes after a 50 MB body was buffered and parsed. The middleware
sits in front of routing, sees only the method, path and headers, and answers 401/413 itself.

Layer 1: imports nothing else of ours, so the server, the gateway and the proxy can all use it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "MAX_JSON_DEPTH",
    "BodyGuard",
    "Reject",
    "TokenCheck",
    "check_upstream_url",
    "excerpt",
    "json_depth",
    "safe_validation_errors",
]

#: JSON nesting accepted at intake; stored documents are re-read with pydantic's JSON parser, whose own limit is
#: a little above 200 levels, so anything accepted here can always be read back.
MAX_JSON_DEPTH = 64

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
#: (status, kind, message) -> (body bytes, content type): renders a refusal in the API's own error shape
Reject = Callable[[int, str, str], tuple[bytes, str]]


class TokenCheck:
    """Verifies an admin token without keeping it: only its SHA-256 is held, and any header bytes (non-ASCII
    included) compare in constant time instead of raising."""

    def __init__(self, token: str | None) -> None:
        self._digest = hashlib.sha256(token.encode()).digest() if token else None

    @property
    def configured(self) -> bool:
        return self._digest is not None

    def matches(self, given: str | bytes | None) -> bool:
        if self._digest is None or not given:
            return False
        raw = given if isinstance(given, bytes) else given.encode("utf-8", "surrogateescape")
        return hmac.compare_digest(hashlib.sha256(raw).digest(), self._digest)

    def admits(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """``x-admin-token``, or ``authorization: Bearer`` (the raw ASGI header pairs)."""
        for name, value in headers:
            name = name.lower()
            if name == b"x-admin-token" and self.matches(value):
                return True
            if name == b"authorization" and value[:7].lower() == b"bearer " and self.matches(value[7:]):
                return True
        return False


class _TooLarge(Exception):
    pass


class BodyGuard:
    """ASGI middleware. For each HTTP request: ``needs_token(method, path)`` says whether the admin token is checked
    up front (401 before the body is read); ``limit(method, path)`` is the body cap in bytes (None: this route
    enforces its own); ``reject`` renders a refusal (polar_gym.web: in the one error envelope). A declared
    Content-Length over the cap is refused at once; a streamed body is counted and refused (413) when it crosses the
    cap, whatever the route did with the partial read.

    Before a refusal, up to ``drain_bytes`` of the unread body are read and dropped (for at most ``drain_seconds``):
    closing a socket with unread data resets it, and the client would see a reset instead of the 401/413."""

    drain_bytes = 1024 * 1024
    drain_seconds = 1.0

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], *, token: TokenCheck,
                 needs_token: Callable[[str, str], bool], limit: Callable[[str, str], int | None],
                 reject: Reject) -> None:
        self.app, self.token, self.needs_token, self.limit, self.reject = app, token, needs_token, limit, reject

    async def _drain(self, receive: Receive) -> None:
        loop = asyncio.get_running_loop()
        end, dropped = loop.time() + self.drain_seconds, 0
        while dropped <= self.drain_bytes:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, end - loop.time()))
            except TimeoutError:
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            dropped += len(message.get("body", b""))

    async def _refuse(self, send: Send, status: int, kind: str, message: str,
                      receive: Receive | None = None) -> None:
        if receive is not None:
            await self._drain(receive)
        body, media = self.reject(status, kind, message)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", media.encode()), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        if self.needs_token(method, path) and not self.token.admits(scope.get("headers", ())):
            await self._refuse(send, 401, "unauthorized", "this endpoint needs the admin token (x-admin-token header)",
                               receive)
            return
        cap = self.limit(method, path)
        if cap is None:
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name.lower() == b"content-length":
                if not value.strip().isdigit():
                    await self._refuse(send, 400, "invalid_request", "malformed content-length header")
                    return
                if int(value) > cap:
                    await self._refuse(send, 413, "too_large", f"request body exceeds the limit of {cap} bytes",
                                       receive)
                    return
        state = {"read": 0, "over": False, "started": False}

        async def counted() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                state["read"] += len(message.get("body", b""))
                if state["read"] > cap:
                    state["over"] = True
                    raise _TooLarge
            return message

        async def guarded_send(message: Message) -> None:
            if state["over"]:
                return  # the route's own answer to the cut-off read is replaced by the 413 below
            state["started"] = True
            await send(message)

        try:
            await self.app(scope, counted, guarded_send)
        except _TooLarge:
            pass
        except Exception:
            if not state["over"]:
                raise
        if state["over"] and not state["started"]:
            await self._refuse(send, 413, "too_large", f"request body exceeds the limit of {cap} bytes", receive)


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), counted without recursion; stops at ``limit + 1``."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        elif not isinstance(item, list | tuple):
            continue
        depth += 1
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth) for child in item)
    return deepest


def excerpt(value: Any, size: int = 120) -> str:
    """A short quotable form of some input: error bodies never echo a whole request."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= size else f"{text[:size]}... ({len(text)} characters)"


def safe_validation_errors(errors: Iterable[dict[str, Any]], most: int = 20) -> list[dict[str, Any]]:
    """Pydantic/FastAPI validation errors with each ``input`` cut to an excerpt and at most ``most`` entries."""
    out: list[dict[str, Any]] = []
    for i, err in enumerate(errors):
        if i >= most:
            out.append({"type": "truncated", "msg": "more errors left out"})
            break
        entry = {"type": str(err.get("type", "")), "loc": [excerpt(x, 60) if isinstance(x, str) else x
                                                           for x in list(err.get("loc", ()))[:MAX_JSON_DEPTH]],
                 "msg": excerpt(str(err.get("msg", "")), 300)}
        if "input" in err:
            entry["input"] = excerpt(err["input"])
        out.append(entry)
    return out


def check_upstream_url(url: str) -> str:
    """An upstream (LLM backend, gateway) URL: http or https with a host, nothing else; returns it unchanged.
    Raises ValueError with a short reason."""
    if not isinstance(url, str) or len(url) > 2048:
        raise ValueError("an upstream URL is a string of at most 2048 characters")
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a malformed port
    except ValueError as exc:
        raise ValueError(f"not a URL: {excerpt(url, 80)!r} ({exc})") from exc
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"an upstream URL is http:// or https://, got {excerpt(url, 80)!r}")
    host = parts.hostname or ""
    if not host or any(c.isspace() for c in url):
        raise ValueError(f"an upstream URL needs a host and no spaces, got {excerpt(url, 80)!r}")
    if port == 0:
        raise ValueError("an upstream URL needs a non-zero port")
    if not _is_hostname(host):
        raise ValueError(f"not a host name or IP address: {excerpt(host, 80)!r}")
    return url


def _is_hostname(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    return all(0 < len(label) <= 63 and all(c.isalnum() or c in "-_" for c in label) for label in labels)
