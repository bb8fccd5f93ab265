"""Model calls skip starlette's middleware stack and FastAPI's routing (``ModelCallShortcut``) and still answer
exactly as the routed endpoints do; paths the admin guard covers never take the shortcut; a harness that hangs up
mid-body is not an error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette

from polar_gym.proxy.app import create_app
from polar_gym.proxy.routes import models
from polar_gym.proxy.routes.models import ModelCallShortcut
from tests._serving import oracle_service

HEADERS = {"authorization": "Bearer s1", "x-goog-api-key": "s1", "content-type": "application/json"}
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
GOOGLE = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}


async def test_model_calls_take_the_shortcut_and_answer_as_the_routed_endpoints(tmp_path: Path, monkeypatch):
    service = oracle_service(tmp_path)
    app = create_app(service, "admin")
    assert isinstance(app.model_calls, ModelCallShortcut)
    routed: list[str] = []
    original = models.model_reply
    stacked: list[str] = []  # calls that went through starlette's middleware stack
    original_stack = Starlette.__call__

    async def counted(request: Any, provider: str, route: Any) -> Any:
        routed.append(provider)
        return await original(request, provider, route)

    async def through_stack(self: Starlette, scope: Any, receive: Any, send: Any) -> None:
        stacked.append(scope["path"])
        await original_stack(self, scope, receive, send)

    monkeypatch.setattr(models, "model_reply", counted)
    monkeypatch.setattr(Starlette, "__call__", through_stack)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy") as client:
        chat = await client.post("/v1/chat/completions", content=orjson.dumps(CHAT), headers=HEADERS)
        google = await client.post("/v1beta/models/policy:generateContent", content=orjson.dumps(GOOGLE),
                                   headers=HEADERS)
        unknown = await client.post("/v1beta/models/policy:nonsense", content=orjson.dumps(GOOGLE), headers=HEADERS)
        health = await client.get("/health")
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    assert google.status_code == 200 and google.json()["candidates"][0]["content"]["role"] == "model"
    assert unknown.status_code == 404 and unknown.json()["error"]["status"] == "NOT_FOUND"  # Google's own shape
    assert health.status_code == 200
    assert routed == ["openai_chat", "google", "google"]
    assert stacked == ["/health"]  # model calls, even refused ones, never enter the middleware stack
    assert [r.provider for r in await service.journal.records("s1")] == ["openai_chat", "google"]
    service.journal.close()


async def test_a_path_the_admin_guard_covers_never_takes_the_shortcut(tmp_path: Path):
    """``/admin/models/x:generateContent`` looks like a Google model path; it stays behind the admin token."""
    service = oracle_service(tmp_path)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(service, "admin")),
                                 base_url="http://proxy") as client:
        resp = await client.post("/admin/models/policy:generateContent", content=orjson.dumps(GOOGLE),
                                 headers=HEADERS)
    assert resp.status_code == 401 and resp.json()["error"]["type"] == "unauthorized"
    assert await service.journal.records("s1") == []
    service.journal.close()


async def test_a_harness_that_hangs_up_mid_body_gets_no_answer_and_nothing_is_journaled(tmp_path: Path):
    service = oracle_service(tmp_path)
    app = create_app(service, "admin")
    sent: list[dict[str, Any]] = []
    messages = iter([{"type": "http.request", "body": b'{"model": "pol', "more_body": True},
                     {"type": "http.disconnect"}])

    async def receive() -> dict[str, Any]:
        return next(messages)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": [(k.encode(), v.encode()) for k, v in HEADERS.items()],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    await app(scope, receive, send)
    assert sent == []
    assert await service.journal.records("s1") == []
    service.journal.close()


def test_the_disconnect_check_answers_at_once_and_leaves_nothing_waiting():
    """A model call asks once whether its caller hung up: the answer comes without waiting for one, and the step
    of ``receive`` it took leaves no waiter behind (a leak per call otherwise)."""
    import asyncio

    from starlette.requests import Request

    from polar_gym.proxy.routes.common import disconnect_check

    async def run() -> list[bool]:
        gone = asyncio.Event()

        async def receive() -> dict[str, str]:
            await gone.wait()
            return {"type": "http.disconnect"}

        check = disconnect_check(Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive))
        answers = [await check(), await check()]
        assert not gone._waiters  # type: ignore[attr-defined]
        gone.set()
        return [*answers, await check()]

    assert asyncio.run(run()) == [False, False, True]


def _request(chunks: list[dict[str, Any]], headers: list[tuple[bytes, bytes]] | None = None) -> Any:
    from starlette.requests import Request

    messages = iter(chunks)

    async def receive() -> dict[str, Any]:
        return next(messages)

    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers or []}, receive)


async def test_a_body_read_from_receive_is_what_starlette_reads():
    """``read_body`` reads the server's messages itself: every chunk joined, a hang-up mid-body raised as starlette
    raises it, the limit enforced while streaming and when declared, a body read before given again."""
    import pytest
    from starlette.requests import ClientDisconnect

    from polar_gym.proxy.errors import PayloadTooLarge
    from polar_gym.proxy.routes.common import read_body

    parts = [{"type": "http.request", "body": b'{"a":', "more_body": True},
             {"type": "http.request", "body": b"", "more_body": True},
             {"type": "http.request", "body": b"1}"}]
    assert await read_body(_request(parts), 100) == b'{"a":1}'
    assert await _request(parts).body() == b'{"a":1}'  # starlette's own reading agrees
    assert await read_body(_request([{"type": "http.request", "body": b"x" * 7}]), 100) == b"x" * 7
    with pytest.raises(ClientDisconnect):
        await read_body(_request([parts[0], {"type": "http.disconnect"}]), 100)
    with pytest.raises(PayloadTooLarge, match="exceeds the limit of 6 bytes"):
        await read_body(_request(parts), 6)
    with pytest.raises(PayloadTooLarge, match="of 7 bytes exceeds"):
        await read_body(_request(parts, [(b"content-length", b"7")]), 6)
    read_before = _request(parts)
    assert await read_before.body() == b'{"a":1}'
    assert await read_body(read_before, 100) == b'{"a":1}'
    twice = _request(parts)
    assert await read_body(twice, 100) == b'{"a":1}'
    assert await read_body(twice, 100) == b'{"a":1}'  # kept, as starlette keeps what it read


async def test_a_plain_reply_is_sent_as_its_starlette_response_would_be():
    """``send_reply`` skips building a Response only for replies it sends byte for byte the same."""
    from polar_gym.proxy.routes.common import is_plain, send_reply, to_response
    from polar_gym.proxy.service import Reply

    async def sent_by(sender: Any) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            messages.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.disconnect"}

        await sender(send, receive)
        return messages

    plain = [Reply(200, b'{"ok":1}'), Reply(429, b""), Reply(500, b"{}", "application/problem+json")]
    for reply in plain:
        assert is_plain(reply)
        ours = await sent_by(lambda send, receive, r=reply: send_reply(r, send))
        theirs = await sent_by(lambda send, receive, r=reply: to_response(r)({"type": "http"}, receive, send))
        assert ours == theirs

    async def events() -> Any:
        yield b"data: 1\n\n"

    for other in [Reply(200, b"x", "text/event-stream"), Reply(200, b"{}", headers={"retry-after": "1"}),
                  Reply(204, b""), Reply(200, b"", stream=events())]:
        assert not is_plain(other)


async def test_the_admin_guard_is_asked_once_per_model_path_and_its_answers_stay_bounded():
    """The guard's answer for a model path is kept (it does not change once the app is built), for the fixed routes
    and for Google's paths, which a caller picks: past the bound, a new path is asked every time, never kept."""
    from polar_gym.proxy.routes.models import _GUARDED_PATHS, ModelCallShortcut

    asked: list[str] = []

    def guarded(method: str, path: str) -> bool:
        asked.append(path)
        return True  # guarded: the shortcut leaves the call to the app

    shortcut = ModelCallShortcut(guarded)

    async def handled(path: str) -> bool:
        scope = {"type": "http", "method": "POST", "path": path, "headers": []}
        return await shortcut.handled(None, scope, None, None)  # type: ignore[arg-type]

    for _ in range(3):
        assert not await handled("/v1/messages")
        assert not await handled("/v1beta/models/policy:generateContent")
    assert asked == ["/v1/messages", "/v1beta/models/policy:generateContent"]
    assert not await handled("/v1/not-a-model-route") and len(asked) == 2  # not a model path: never asked
    paths = [f"/v1beta/models/m{n}:generateContent" for n in range(_GUARDED_PATHS + 10)]
    for path in paths:
        assert not await handled(path)
    assert len(shortcut._guarded) == _GUARDED_PATHS
    assert not await handled(paths[-1]) and asked[-2:] == [paths[-1], paths[-1]]  # not kept: asked again
