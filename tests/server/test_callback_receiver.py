"""The trainer's CallbackReceiver as an attacker on its port sees it (issue 35, point 5): a forged callback is refused
and never displaces the genuine one; an unsigned, badly signed, stale, replayed or unexpected delivery gets a 401 or
404 in the JSON error envelope; a body over the cap is refused (413) whether declared or streamed; a non-JSON body is
refused at its first byte, not read whole; a flood leaves nothing behind; and the bodies waiting to be taken are
bounded, with a policy that never drops one silently.

The HTTP tests run the receiver on a loopback port; the read-accounting ones drive its ASGI app with a receive
callable that counts the chunks the app pulled (what a socket would have had to carry)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import MutableMapping, Sequence
from typing import Any

import httpx
import orjson
import pytest

from polar_gym.schema import AgentSpec, TaskRequest
from polar_gym.server.receiver import CallbackEvicted, CallbackReceiver
from polar_gym.server.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from tests._waiting import BOUND

MIB = 1024 * 1024


def view(task_id: str, **extra: Any) -> bytes:
    """A task view as the rollout server sends it (the fields the receiver reads, plus a marker)."""
    return orjson.dumps({"task_id": task_id, "status": "COMPLETED", "results": [], **extra})


def signed(secret: str, task_id: str, body: bytes, now: float | None = None) -> dict[str, str]:
    key = f"polar-task-{task_id}"
    return {"idempotency-key": key, "content-type": "application/json", **sign(secret, key, body, now)}


def unsigned(task_id: str) -> dict[str, str]:
    return {"idempotency-key": f"polar-task-{task_id}", "content-type": "application/json"}


async def post(url: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=BOUND) as client:
        return await client.post(url, content=body, headers=headers)


def error_type(resp: httpx.Response) -> str:
    kind = resp.json()["error"]["type"]
    assert isinstance(kind, str) and resp.json()["error"]["message"]
    return kind


async def test_a_forged_callback_is_refused_and_the_genuine_one_is_delivered() -> None:
    """Today's break: a forged body under the predictable key reached wait_for and the genuine one was dropped."""
    receiver = CallbackReceiver()
    async with receiver.serve() as url:
        task = receiver.attach(TaskRequest(task_id="t1", instruction="x", agent=AgentSpec(harness="pi")))
        assert task.callback_url == url and task.callback_secret == receiver.secret
        assert receiver.secret not in repr(task)
        forged = await post(url, view("t1", forged=True), unsigned("t1"))
        assert forged.status_code == 401 and error_type(forged) == "unsigned_callback"
        wrong = await post(url, view("t1", forged=True), signed("another-secret-of-32-characters!", "t1",
                                                                 view("t1", forged=True)))
        assert wrong.status_code == 401 and error_type(wrong) == "bad_signature"
        assert receiver.received == {}
        genuine = await post(url, view("t1"), signed(receiver.secret, "t1", view("t1")))
        assert genuine.status_code == 200 and genuine.json() == {"duplicate": False, "key": "polar-task-t1"}
        assert await receiver.wait_for("t1", BOUND) == orjson.loads(view("t1"))
        again = await post(url, view("t1"), signed(receiver.secret, "t1", view("t1")))  # the server's repeat
        assert again.status_code == 200 and again.json()["duplicate"] is True
        late_forgery = await post(url, view("t1", forged=True), unsigned("t1"))
        assert late_forgery.status_code == 401
    assert receiver.refused == {"unsigned_callback": 2, "bad_signature": 1}


async def test_tampered_stale_replayed_and_unexpected_deliveries_are_refused() -> None:
    receiver = CallbackReceiver()
    receiver.expect("t1")
    receiver.expect("t2")
    async with receiver.serve() as url:
        tampered = await post(url, view("t1", reward=1.0), signed(receiver.secret, "t1", view("t1", reward=0.0)))
        assert tampered.status_code == 401 and error_type(tampered) == "bad_signature"
        stale = await post(url, view("t1"), signed(receiver.secret, "t1", view("t1"), now=time.time() - 3600))
        assert stale.status_code == 401 and error_type(stale) == "stale_signature"
        # a genuine delivery of t1 replayed under t2's key: the key is part of the MAC
        replayed = signed(receiver.secret, "t1", view("t1")) | {"idempotency-key": "polar-task-t2"}
        assert (await post(url, view("t1"), replayed)).status_code == 401
        # signed right but naming another task in its body
        mismatched = await post(url, view("t1"), signed(receiver.secret, "t2", view("t1")))
        assert mismatched.status_code == 400 and error_type(mismatched) == "invalid_callback"
        unexpected = await post(url, view("t9"), signed(receiver.secret, "t9", view("t9")))
        assert unexpected.status_code == 404 and error_type(unexpected) == "unexpected_task"
        no_key = await post(url, view("t1"), {"content-type": "application/json"})
        assert no_key.status_code == 400 and error_type(no_key) == "missing_idempotency_key"
    assert receiver.received == {} and receiver.expected == {"t1", "t2"}


async def test_a_flood_of_bodies_leaves_nothing_behind() -> None:
    """Today's break: 200 one-MiB bodies under made-up keys were all kept (207 MB)."""
    receiver = CallbackReceiver()
    body = b'{"task_id": "x", "pad": "' + b"a" * MIB + b'"}'
    async with receiver.serve() as url, httpx.AsyncClient(timeout=BOUND) as client:
        answers = await asyncio.gather(*(
            client.post(url, content=body, headers=unsigned(f"flood-{i}"))
            for i in range(200)))
    assert {a.status_code for a in answers} == {404}
    assert receiver.received == {} and receiver.deliveries == 200 and receiver.refused == {"unexpected_task": 200}


class Drive:
    """One POST to the receiver's ASGI app, its body in ``chunks``; counts the chunks the app pulled."""

    def __init__(self, receiver: CallbackReceiver, headers: dict[str, str], chunks: Sequence[bytes]) -> None:
        self.receiver, self.headers, self.chunks = receiver, headers, chunks
        self.pulled, self.status, self.body = 0, 0, b""

    async def __call__(self) -> Drive:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/callback", "raw_path": b"/callback", "query_string": b"",
                 "root_path": "", "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 80),
                 "headers": [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]}

        async def receive() -> dict[str, Any]:
            if self.pulled >= len(self.chunks):
                return {"type": "http.disconnect"}
            self.pulled += 1
            return {"type": "http.request", "body": self.chunks[self.pulled - 1],
                    "more_body": self.pulled < len(self.chunks)}

        async def send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
            elif message["type"] == "http.response.body":
                self.body += message.get("body", b"")

        await self.receiver.app(scope, receive, send)
        return self

    @property
    def error(self) -> str:
        kind = orjson.loads(self.body)["error"]["type"]
        assert isinstance(kind, str)
        return kind


async def test_a_64_mib_non_json_body_is_refused_at_its_first_chunk() -> None:
    """Today's break: a 64 MiB non-JSON body was read whole before it failed to parse."""
    receiver = CallbackReceiver()
    receiver.expect("t1")
    junk = b"\x00" * MIB
    headers = signed(receiver.secret, "t1", junk * 64)
    drive = await Drive(receiver, headers, [junk] * 64)()
    # the first chunk, then at most 1 MiB read and dropped so that the sender sees the answer, not a reset
    assert drive.status == 400 and drive.error == "not_json" and drive.pulled <= 3
    wrong_type = await Drive(receiver, headers | {"content-type": "text/plain"}, [junk] * 64)()
    assert wrong_type.status == 415 and wrong_type.error == "not_json" and wrong_type.pulled <= 2
    unsigned_junk = await Drive(receiver, unsigned("t1"), [junk] * 64)()
    assert unsigned_junk.status == 401 and unsigned_junk.pulled <= 2  # refused from its headers alone
    assert receiver.received == {}


async def test_a_body_over_the_cap_is_refused_declared_or_streamed() -> None:
    receiver = CallbackReceiver(max_body_bytes=4 * MIB)
    receiver.expect("t1")
    chunk = b'{"task_id": "t1", "pad": "' + b"a" * (MIB - 40) + b'",'
    headers = signed(receiver.secret, "t1", chunk * 64)
    declared = await Drive(receiver, headers | {"content-length": str(64 * MIB)}, [chunk] * 64)()
    assert declared.status == 413 and declared.error == "too_large" and declared.pulled <= 2  # at most a drain
    streamed = await Drive(receiver, headers, [chunk] * 64)()  # no content-length: cut off as it crosses the cap
    assert streamed.status == 413 and streamed.error == "too_large" and streamed.pulled <= 7
    assert receiver.received == {}
    async with receiver.serve() as url:  # over a socket too (a little over the cap: the rest is drained, not reset)
        resp = await post(url, b"{" + b" " * (4 * MIB + 100_000), headers)
    assert resp.status_code == 413 and error_type(resp) == "too_large"


async def test_pending_bodies_are_bounded_and_none_is_dropped_silently() -> None:
    """Without on_task nothing is evicted: past the bound a delivery is answered 503 (the server retries) until
    wait_for takes one; with on_task, the oldest body already handed to it is evicted, counted and named."""
    receiver = CallbackReceiver(max_pending=2)
    for task_id in ("a", "b", "c"):
        receiver.expect(task_id)
    async with receiver.serve() as url:
        for task_id in ("a", "b"):
            assert (await post(url, view(task_id), signed(receiver.secret, task_id, view(task_id)))).status_code \
                == 200
        full = await post(url, view("c"), signed(receiver.secret, "c", view("c")))
        assert full.status_code == 503 and error_type(full) == "full" and full.headers["retry-after"]
        assert (await receiver.wait_for("a", BOUND))["task_id"] == "a"
        retried = await post(url, view("c"), signed(receiver.secret, "c", view("c")))
        assert retried.status_code == 200 and sorted(receiver.received) == ["polar-task-b", "polar-task-c"]
    assert receiver.evicted == 0 and receiver.refused == {"full": 1}

    handed: list[str] = []
    receiver = CallbackReceiver(lambda body: handed.append(body["task_id"]), max_pending=2)
    for task_id in ("a", "b", "c"):
        receiver.expect(task_id)
    async with receiver.serve() as url:
        for task_id in ("a", "b", "c"):
            assert (await post(url, view(task_id), signed(receiver.secret, task_id, view(task_id)))).status_code \
                == 200
    assert handed == ["a", "b", "c"] and receiver.evicted == 1
    assert sorted(receiver.received) == ["polar-task-b", "polar-task-c"]
    with pytest.raises(CallbackEvicted, match="'a' was handed to on_task and then evicted"):
        await receiver.wait_for("a", BOUND)
    assert (await receiver.wait_for("c", BOUND))["task_id"] == "c"


async def test_a_failing_handler_gets_the_retry() -> None:
    calls: list[str] = []

    def flaky(body: dict[str, Any]) -> None:
        calls.append(body["task_id"])
        if len(calls) == 1:
            raise RuntimeError("not ready")

    receiver = CallbackReceiver(flaky)
    receiver.expect("t1")
    async with receiver.serve() as url:
        first = await post(url, view("t1"), signed(receiver.secret, "t1", view("t1")))
        assert first.status_code == 500 and error_type(first) == "handler_failed"
        second = await post(url, view("t1"), signed(receiver.secret, "t1", view("t1")))
        assert second.status_code == 200 and second.json()["duplicate"] is False
    assert calls == ["t1", "t1"] and list(receiver.received) == ["polar-task-t1"]


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        CallbackReceiver(secret="short")
    with pytest.raises(ValueError, match="max_pending_bytes"):
        CallbackReceiver(max_body_bytes=2 * MIB, max_pending_bytes=MIB)
    receiver = CallbackReceiver()
    assert len(receiver.secret) >= 32 and receiver.secret != CallbackReceiver().secret
    with pytest.raises(RuntimeError, match="serve"):
        receiver.attach(TaskRequest(task_id="t", instruction="x", agent=AgentSpec(harness="pi")))
    headers = sign(receiver.secret, "polar-task-t", b"{}", now=0)
    assert headers[TIMESTAMP_HEADER] == "0" and headers[SIGNATURE_HEADER].startswith("v1=")


async def test_a_packed_callback_reaches_on_task_as_the_json_view() -> None:
    """attach asks for packed callbacks; the receiver hands on_task and wait_for the JSON view they stand for, and
    a signed packed body that does not decode is refused (400), never handed on."""
    from polar_gym.result_codec import MEDIA_TYPE, frame_results, pack
    from tests.server.test_result_codec import growing_session

    seen: list[dict[str, Any]] = []
    receiver = CallbackReceiver(seen.append)
    result = growing_session(turns=4).model_copy(update={"task_id": "t1"})
    body = frame_results([pack(result)], {"task_id": "t1", "status": "COMPLETED"})
    async with receiver.serve() as url:
        task = receiver.attach(TaskRequest(task_id="t1", instruction="x", agent=AgentSpec(harness="pi")))
        assert task.callback_format == "packed"
        receiver.expect("t2")
        garbled = body[:-10] + b"\0" * 10
        bad = await post(url, garbled, signed(receiver.secret, "t2", garbled) | {"content-type": MEDIA_TYPE})
        assert bad.status_code == 400 and error_type(bad) == "invalid_callback"
        ok = await post(url, body, signed(receiver.secret, "t1", body) | {"content-type": MEDIA_TYPE})
        assert ok.status_code == 200, ok.text
        got = await receiver.wait_for("t1", BOUND)
    expected = {"task_id": "t1", "status": "COMPLETED", "results": [result.model_dump(mode="json")]}
    assert seen == [expected] and got == expected
    assert receiver.refused == {"invalid_callback": 1}
