"""Bad input and upstream faults: each gets a clear, provider-shaped error; the proxy stays up; nothing captured
is lost or marked successful by mistake. Also session isolation and the admin surface."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from polar_gym.proxy.app import create_app
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.errors import AuthError, RequestError, UpstreamTimeout, error_body
from polar_gym.proxy.service import ProxyService, SessionInfo, SessionRegistry
from polar_gym.proxy.upstreams import UpstreamPool
from tests._fakes import FakeVLLM
from tests._waiting import BOUND

ADMIN = "admin-secret"
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


def make(handler, *, strict: bool = False, adhoc: bool = True, max_body: int = 1 << 20):
    transport = httpx.MockTransport(handler)
    engine = VLLMEngine(UpstreamPool(["http://engine"]), client=httpx.AsyncClient(transport=transport))
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=adhoc), strict=strict,
                           max_body_bytes=max_body)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(create_app(service, ADMIN)), base_url="http://proxy")
    return service, client


def key(k: str) -> dict[str, str]:
    return {"authorization": f"Bearer {k}"}


async def post(client, body, k="s1", path="/v1/chat/completions"):
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return await client.post(path, content=content, headers={**key(k), "content-type": "application/json"})


@pytest.mark.parametrize(("body", "needle"), [
    (b"{not json", "malformed JSON"),
    (b"[1, 2]", "JSON object"),
    ({"model": "policy", "messages": "hi"}, "messages"),
    ({"model": "policy", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"model": "policy", "messages": [{"role": "user", "content": [{"type": "video", "v": 1}]}]}, "video"),
    ({"model": "policy", "messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "n": 3}, "n"),
])
async def test_bad_requests_are_openai_shaped_400s(body, needle):
    fake = FakeVLLM()
    _, client = make(fake.handler)
    resp = await post(client, body)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and needle in err["message"]
    assert fake.requests == []  # nothing reached the engine
    assert (await post(client, CHAT)).status_code == 200  # and the proxy is still serving


async def test_unknown_fields_are_logged_by_default_and_rejected_when_strict(caplog):
    _, lenient = make(FakeVLLM().handler)
    with caplog.at_level("INFO", logger="polar_gym.proxy"):
        assert (await post(lenient, {**CHAT, "frobnicate": 1})).status_code == 200
    assert "frobnicate" in caplog.text
    _, strict = make(FakeVLLM().handler, strict=True)
    resp = await post(strict, {**CHAT, "frobnicate": 1})
    assert resp.status_code == 400 and "frobnicate" in resp.json()["error"]["message"]
    assert (await post(strict, {**CHAT, "user": "known-and-ignored"})).status_code == 200


async def test_oversized_body_is_413():
    _, client = make(FakeVLLM().handler, max_body=1000)
    resp = await post(client, {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]})
    assert resp.status_code == 413 and "exceeds" in resp.json()["error"]["message"]

    async def chunked():  # no content-length: refused while streaming in, not after buffering it all
        for _ in range(100):
            yield b"x" * 100
    resp = await client.post("/v1/messages", content=chunked(), headers=key("s"))
    assert resp.status_code == 413 and resp.json()["error"]["type"] == "request_too_large"


def failing(exc: Exception):
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc
    return handler


@pytest.mark.parametrize(("handler", "status", "needle"), [
    (failing(httpx.ConnectError("refused")), 503, "unreachable"),
    (failing(httpx.ReadTimeout("slow")), 504, "timed out"),
    (FakeVLLM(garbage=b"<html>oops</html>").handler, 502, "unusable"),
    (FakeVLLM(garbage=b'{"choices": []}').handler, 502, "unusable"),
    (FakeVLLM(status=500).handler, 502, "500"),
])
async def test_engine_faults_are_recorded_as_errors(handler, status, needle):
    service, client = make(handler)
    resp = await post(client, CHAT, k="faulty")
    assert resp.status_code == status
    assert needle in resp.json()["error"]["message"]
    records = await service.journal.records("faulty")
    assert len(records) == 1
    assert records[0].status == "error" and not records[0].token_faithful
    assert records[0].request == CHAT and records[0].response_ids == []


async def test_a_fault_does_not_touch_earlier_captures():
    fake = FakeVLLM(reply="first")
    service, client = make(fake.handler)
    assert (await post(client, CHAT, k="mixed")).status_code == 200
    fake.garbage = b"garbage"
    assert (await post(client, CHAT, k="mixed")).status_code == 502
    fake.garbage = None
    assert (await post(client, CHAT, k="mixed")).status_code == 200
    records = await service.journal.records("mixed")
    assert [r.status for r in records] == ["ok", "error", "ok"]
    assert records[0].response_ids == fake.tokenizer.encode("first") + [257]


async def test_captured_tokens_are_the_engines():
    fake = FakeVLLM(reply="tokens")
    service, client = make(fake.handler)
    resp = await post(client, CHAT, k="tok")
    answer = fake.answer(fake.requests[0])
    (rec,) = await service.journal.records("tok")
    assert rec.prompt_ids == answer["prompt_token_ids"]
    assert rec.response_ids == answer["choices"][0]["token_ids"]
    assert rec.response_logprobs == [c["logprob"] for c in answer["choices"][0]["logprobs"]["content"]]
    assert fake.requests[0]["return_token_ids"] is True and fake.requests[0]["stream"] is False
    assert resp.json()["choices"][0]["message"]["content"] == "tokens"


async def test_registered_only_sessions_and_isolation():
    _, client = make(FakeVLLM().handler, adhoc=False)
    resp = await post(client, CHAT, k="nobody")
    assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 401  # no key at all
    reg = await client.post("/admin/sessions", json={"session_id": "alice"}, headers={"x-admin-token": ADMIN})
    assert reg.status_code == 200
    secret = reg.json()["api_key"]  # a fresh secret, not the session id
    assert len(secret) >= 22 and secret != "alice"
    assert (await post(client, CHAT, k="alice")).status_code == 401
    assert (await post(client, CHAT, k=secret)).status_code == 200
    # alice's completions: readable with her key or the admin token, not with another key
    assert (await client.get("/sessions/alice/completions", headers=key(secret))).status_code == 200
    assert (await client.get("/sessions/alice/completions", headers=key("alice"))).status_code == 401
    assert (await client.get("/sessions/alice/completions", headers=key("mallory"))).status_code == 401
    got = await client.get("/sessions/alice/completions", headers={"x-admin-token": ADMIN})
    assert len(got.json()["completions"]) == 1


async def test_admin_endpoints_need_the_token():
    _, client = make(FakeVLLM().handler)
    for method, path in [("GET", "/admin/upstreams"), ("POST", "/admin/pause"), ("POST", "/admin/resume")]:
        resp = await client.request(method, path, json={}, headers={"x-admin-token": "wrong"})
        assert resp.status_code == 401, path
    added = await client.post("/admin/upstreams", json={"url": "http://engine2/"}, headers={"x-admin-token": ADMIN})
    assert added.json() == {"added": "http://engine2"}
    listed = (await client.get("/admin/upstreams", headers={"x-admin-token": ADMIN})).json()
    assert [s["url"] for s in listed["servers"]] == ["http://engine", "http://engine2"]


async def test_pause_holds_requests_and_resume_stamps_the_new_policy_version():
    service, client = make(FakeVLLM().handler)
    admin = {"x-admin-token": ADMIN}
    assert (await client.post("/admin/pause", headers=admin)).json()["paused"] is True
    pending = asyncio.create_task(post(client, CHAT, k="paused"))
    await asyncio.sleep(0.1)  # (a chance to fail early; a slow machine only makes this check weaker)
    assert not pending.done()  # waiting, not failing
    await client.post("/admin/resume", json={"policy_version": 7}, headers=admin)
    resp = await asyncio.wait_for(pending, BOUND)
    assert resp.status_code == 200
    (rec,) = await service.journal.records("paused")
    assert rec.policy_version == 7


def test_error_bodies_per_provider():
    status, body = error_body(AuthError("no key"), "anthropic")
    assert status == 401 and body == {"type": "error", "error": {"type": "authentication_error", "message": "no key"}}
    status, body = error_body(UpstreamTimeout("slow"), "google")
    assert status == 504 and body["error"]["status"] == "DEADLINE_EXCEEDED"
    status, body = error_body(RequestError("bad"), "openai")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_session_registry():
    reg = SessionRegistry(allow_adhoc=False)
    reg.register(SessionInfo("a", model_name="policy"))
    assert reg.resolve("a").model_name == "policy"
    with pytest.raises(AuthError):
        reg.resolve("b")
    with pytest.raises(AuthError):
        reg.resolve(None)


async def test_connectivity_probe_and_unknown_routes():
    _, client = make(FakeVLLM().handler)
    assert (await client.head("/")).status_code == 200  # Claude Code probes HEAD / first
    resp = await client.post("/v2/teleport", json={"x": 1}, headers=key("s"))
    assert resp.status_code == 404 and "no provider protocol" in resp.json()["error"]["message"]
    detected = await client.post("/custom/prefix/v1/chat/completions", json=CHAT, headers=key("s"))
    assert detected.status_code == 200


async def test_a_bug_in_translation_is_a_provider_shaped_500(monkeypatch):
    service, client = make(FakeVLLM().handler)

    def broken(*args, **kwargs):
        raise KeyError("oops")

    monkeypatch.setattr(service.provider("anthropic"), "parse", broken)
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    resp = await client.post("/v1/messages", json=body, headers=key("s"))
    assert resp.status_code == 500
    assert resp.json()["type"] == "error" and "internal proxy error" in resp.json()["error"]["message"]
    assert (await post(client, CHAT)).status_code == 200


async def test_max_tokens_cap_clamps_what_the_engine_is_asked():
    fake = FakeVLLM()
    service, client = make(fake.handler)
    service.max_tokens_cap = 16
    assert (await post(client, {**CHAT, "max_tokens": 32000}, k="cap")).status_code == 200
    assert (await post(client, CHAT, k="cap")).status_code == 200
    assert (await post(client, {**CHAT, "max_tokens": 4}, k="cap")).status_code == 200
    assert [r["max_tokens"] for r in fake.requests] == [16, 16, 4]
    records = await service.journal.records("cap")
    assert records[0].normalizations == ["max_tokens 32000 capped at 16"] and records[2].normalizations == []


async def test_admin_surface_refuses_hostile_input():
    """Issue 11, fault 6 on the proxy's admin routes: bad URLs, malformed tokens, oversized or unauthenticated
    bodies and bad scripts are 4xx in the API's error shape; a 422 quotes excerpts, never the whole input."""
    service, client = make(FakeVLLM().handler)
    admin = {"x-admin-token": ADMIN}
    for url in ["not a url", "ftp://engine/v1", "http://", "http:///v1", "http://a b", "http://h:0/", "x" * 5000]:
        resp = await client.post("/admin/upstreams", json={"url": url}, headers=admin)
        assert resp.status_code == 422, (url, resp.text[:200])  # on main: 200, and the pool held "not a url"
        assert len(resp.content) < 2000
    assert [s.url for s in service.engine.pool.servers()] == ["http://engine"]
    for token in ["tökén".encode(), b"\xff", ADMIN.encode() + b"\xe9"]:  # on main: 500 (compare_digest on str)
        resp = await client.get("/admin/upstreams", headers={"x-admin-token": token})
        assert resp.status_code == 401, token
        assert (await client.get("/sessions/s1/completions", headers={"x-admin-token": token})).status_code == 401
    bad_script = await client.post("/admin/sessions", json={"session_id": "s9", "oracle": {"nope": 1}}, headers=admin)
    assert bad_script.status_code in (200, 400)  # the vLLM engine ignores oracle scripts
    deep: dict = {"leaf": 1}
    for _ in range(100):
        deep = {"a": deep}
    nested = await client.post("/admin/sessions", json={"session_id": "s8", "metadata": deep}, headers=admin)
    assert nested.status_code == 400 and service.sessions.get("s8") is None
    huge = await client.post("/admin/sessions", json={"session_id": "s" * 600_000}, headers=admin)
    assert huge.status_code == 422 and len(huge.content) < 4000

    consumed = {"chunks": 0}

    async def body(chunks: int):
        for _ in range(chunks):
            consumed["chunks"] += 1
            yield b" " * 65536

    # no token: refused before the body is read (the app never pulls a chunk beyond the bounded drain)
    resp = await client.post("/admin/upstreams", content=body(1000), headers={"content-type": "application/json"})
    assert resp.status_code == 401 and consumed["chunks"] <= 20
    # with the token, an admin body is capped
    app = create_app(service, ADMIN, max_admin_body_bytes=100_000)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy") as small:
        consumed["chunks"] = 0
        resp = await small.post("/admin/upstreams", content=body(1000), headers=admin)
        assert resp.status_code == 413 and consumed["chunks"] <= 20, resp.text
        assert resp.json()["error"]["message"]
        ok = await small.post("/admin/upstreams", json={"url": "http://engine3:8000/v1"}, headers=admin)
        assert ok.status_code == 200
    bad_query = await client.get("/sessions/s1/trajectory", params={"config": "[" * 20_000}, headers=admin)
    assert bad_query.status_code in (400, 422)


def test_token_check_and_url_rules():
    from polar_gym.httpguard import TokenCheck, check_upstream_url, json_depth, safe_validation_errors

    check = TokenCheck("sekret")
    assert "sekret" not in repr(vars(check))  # only a hash is kept
    assert check.matches("sekret") and check.matches(b"sekret") and not check.matches("sekret\u00e9")
    assert not check.matches(b"\xff") and not TokenCheck(None).matches("") and not TokenCheck("").configured
    assert check.admits([(b"Authorization", b"Bearer sekret")]) and not check.admits([(b"x-admin-token", b"")])
    assert check_upstream_url("https://[::1]:8000/v1") and check_upstream_url("http://node-7.cluster:30000")
    for bad in ["http://h:99999", "javascript:alert(1)", "http://exa mple", "http://bad!host/"]:
        with pytest.raises(ValueError):
            check_upstream_url(bad)
    deep: object = 1
    for _ in range(1000):
        deep = [deep]
    assert json_depth(deep, 64) == 65 and json_depth({"a": [1, {"b": 2}]}) == 3
    errors = safe_validation_errors([{"type": "t", "loc": ("body", "x"), "msg": "m", "input": "y" * 10**6}] * 50)
    assert len(errors) == 21 and len(str(errors)) < 10_000


async def test_no_input_makes_an_admin_or_session_route_fail_with_a_500():
    """Every route of the proxy app x hostile query values, bad tokens and hostile bodies: never a 500."""
    from polar_gym.web import route_table

    service, client = make(FakeVLLM().handler)
    service.sessions.register(SessionInfo("s1"))
    app = client._transport.app
    routes = [(m, r.path) for r in route_table(app) for m in r.methods if m != "HEAD"]
    assert ("POST", "/admin/sessions") in routes and ("GET", "/sessions/{session_id}/trajectory") in routes
    deep = b"[" * 3000 + b"]" * 3000
    bodies = [b"", b"{", b"[]", b"null", b"\xff\xfe", deep, orjson.dumps({"url": "not a url"}),
              orjson.dumps({"session_id": "s2", "oracle": {"nope": 1}}), orjson.dumps({"policy_version": [1]})]
    tokens = [None, b"", b"wrong", "tökén".encode(), b"\xff\x00", ADMIN.encode() + b"\x80", ADMIN.encode()]
    values = ["-1", "nan", "inf", str(10**30), "x", "", "[" * 2000, "http://h/v1"]
    for method, path in routes:
        url = path.replace("{session_id}", "s1").replace("{version}", "v1beta").replace("{rest:path}", "m:generate")
        url = url.replace("{path:path}", "anything")
        cases = [({}, token, b"{}") for token in tokens] + [({}, ADMIN.encode(), body) for body in bodies]
        cases += [({key: value}, ADMIN.encode(), b"{}") for key in ("wait", "config", "builder", "key")
                  for value in values]
        for query, token, body in cases:
            headers = {"content-type": "application/json", **key("s1")}
            if token is not None:
                headers["x-admin-token"] = token
            resp = await client.request(method, url, params=query, headers=headers,
                                        content=body if method in ("POST", "DELETE") else None)
            assert resp.status_code < 500 or resp.status_code in (502, 503, 504), \
                (method, url, query, token, body[:60], resp.status_code, resp.text[:300])


@pytest.mark.parametrize(("path", "shape"), [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic"),
                                             ("/v1beta/models/m:generateContent", "google")])
async def test_a_model_call_without_a_served_key_is_refused_before_its_body_is_read(path, shape):
    """A caller with no served key (a revoked one, a guess) must not make the proxy buffer its body: the 401 comes
    after at most the first chunk, in the caller's own error shape."""
    fake = FakeVLLM()
    _, client = make(fake.handler, adhoc=False, max_body=64 << 20)
    sent = 0

    async def body():
        nonlocal sent
        for _ in range(512):  # 32 MiB if it were all read
            sent += 1
            yield b"x" * 65536

    resp = await client.post(path, content=body(), headers={**key("not-a-served-key"),
                                                             "content-type": "application/json"})
    assert resp.status_code == 401
    doc = resp.json()
    if shape == "anthropic":
        assert doc["type"] == "error" and doc["error"]["type"] == "authentication_error"
    elif shape == "google":
        assert doc["error"]["code"] == 401
    else:
        assert "error" in doc and "message" in doc["error"]
    assert sent <= 2, f"{sent} chunks of the body were read before the key was checked"
    assert fake.requests == []
