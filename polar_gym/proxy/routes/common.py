"""What the proxy's routers share: the service from ``app.state``, a Reply as a Response, a capped body read."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Send

from polar_gym.proxy.errors import PayloadTooLarge
from polar_gym.proxy.service import ProxyService, Reply
from polar_gym.serving import body_kept, caller_gone, keep_body

__all__ = ["disconnect_check", "is_plain", "proxy_service", "read_body", "send_reply", "to_response"]


def proxy_service(request: Request) -> ProxyService:
    """The app's ProxyService (``app.state.service``, set by ``create_app``)."""
    service: ProxyService = request.app.state.service
    return service


def to_response(reply: Reply) -> Response:
    if reply.stream is not None:
        return StreamingResponse(reply.stream, status_code=reply.status, media_type=reply.media_type,
                                 headers=reply.headers)
    return Response(reply.body, status_code=reply.status, media_type=reply.media_type, headers=reply.headers)


def is_plain(reply: Reply) -> bool:
    """Whether :func:`send_reply` sends ``reply`` as its Response would: whole, no headers of its own, a media type
    that takes no charset, a status that has a body."""
    return (reply.stream is None and not reply.headers and not reply.media_type.startswith("text/")
            and reply.status >= 200 and reply.status not in (204, 304))


async def send_reply(reply: Reply, send: Send) -> None:
    """A plain reply (:func:`is_plain`), sent as :func:`to_response`'s Response sends it, without building one (a
    model call's answer: the same head and body, a few microseconds less)."""
    headers = [(b"content-length", b"%d" % len(reply.body)), (b"content-type", reply.media_type.encode("latin-1"))]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing (PayloadTooLarge) to buffer more than ``limit`` bytes, declared or streamed. Read from
    the server's ``receive`` (what ``request.stream()`` does, without an async generator per call); a caller that
    hangs up while sending it raises ClientDisconnect."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit}")
    if body_kept(request) is not None:
        return await request.body()  # read already: kept (or starlette says it cannot give it again)
    chunks, size = [], 0
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            keep_body(request, body)  # kept, as request.body() keeps it
            return body


def disconnect_check(request: Request) -> Callable[[], Awaitable[bool]]:
    """Whether the caller has hung up, asked once its body is read: one step of the server's ``receive``, which
    answers at once when the connection is gone and otherwise waits (then the step is dropped). What starlette's
    ``is_disconnected`` does with an anyio cancel scope, at ~1 us instead of ~17 us a call. Under uvicorn, the flag
    its connection keeps (:func:`polar_gym.serving.caller_gone`), with no step at all."""
    gone = caller_gone(request.receive)
    if gone is not None:
        async def flagged() -> bool:
            return gone()

        return flagged

    async def disconnected() -> bool:
        step = request.receive()
        if not inspect.iscoroutine(step):
            return await request.is_disconnected()
        try:
            step.send(None)
        except StopIteration as done:
            return isinstance(done.value, dict) and done.value.get("type") == "http.disconnect"
        step.close()  # it waits: the caller is still there
        return False

    return disconnected
