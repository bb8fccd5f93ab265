"""A session's sampling override (``metadata.sampling``, issue 36): a trainer measures greedy success through an
unmodified harness, so every model call of such a session reaches the engine with the override's values in place of
the harness's, whichever front end the harness speaks and whether it streams; the capture record says what the
engine got (``normalized_request``, a note) beside what the harness sent (``request``); a session without one is
forwarded as before; a bad override is refused at submit (422) and at a proxy registration (400)."""

from __future__ import annotations

from typing import Any, cast

import httpx
import pydantic
import pytest

from polar_gym.proxy.app import create_app
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.chat import ChatMessage, ChatRequest
from polar_gym.proxy.engines.openai import OpenAIEngine
from polar_gym.proxy.engines.sglang import SGLangEngine, sampling_params
from polar_gym.proxy.engines.token_prompts import completions_body
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.errors import SessionMetadataError
from polar_gym.proxy.service import ProxyService, SessionInfo, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.schema import SamplingOverride, TaskMetadata, TaskRequest
from polar_gym.server.app import create_server_app
from polar_gym.server.core import RolloutServer
from tests._fakes import FakeVLLM
from tests.unit.test_stream_passthrough import proxy as token_in_proxy

ADMIN = "admin-secret"
GREEDY = {"temperature": 0.0, "top_k": 1, "seed": 7}
HI = [{"role": "user", "content": "hi"}]
#: one call per front end, each asking temperature 0.7 (pi's would ask nothing: the engine's 1.0)
CALLS: dict[str, tuple[str, dict[str, Any]]] = {
    "openai_chat": ("/v1/chat/completions", {"model": "policy", "messages": HI, "temperature": 0.7}),
    "anthropic": ("/v1/messages", {"model": "claude-x", "max_tokens": 32, "messages": HI, "temperature": 0.7}),
    "openai_responses": ("/v1/responses", {"model": "gpt-x", "input": "hi", "temperature": 0.7}),
    "google": ("/v1beta/models/gemini-x:generateContent",
               {"contents": [{"role": "user", "parts": [{"text": "hi"}]}], "generationConfig": {"temperature": 0.7}}),
}


def served(metadata: dict[str, Any] | None) -> tuple[ProxyService, FakeVLLM, httpx.AsyncClient]:
    """A proxy on a fake vLLM serving one registered session ``s`` (key ``k``) with ``metadata``."""
    fake = FakeVLLM()
    engine = VLLMEngine(UpstreamPool(["http://engine"]), client=httpx.AsyncClient(transport=fake.transport()))
    service = ProxyService(engine, CaptureJournal(), SessionRegistry())
    service.sessions.register(SessionInfo("s", "policy", metadata or {}, key="k"))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(create_app(service, ADMIN)), base_url="http://proxy")
    return service, fake, client


def gateway_metadata(**sampling: Any) -> dict[str, Any]:
    """Metadata as the gateway registers it: the task's TaskMetadata dumped (unset fields as None)."""
    return TaskMetadata.model_validate({"group_id": "g", "sampling": sampling}).model_dump()


@pytest.mark.parametrize("provider", list(CALLS))
async def test_every_front_end_forwards_the_override_in_place_of_the_harness_values(provider: str) -> None:
    path, body = CALLS[provider]
    service, fake, client = served(gateway_metadata(**GREEDY))
    resp = await client.post(path, json=body, headers={"authorization": "Bearer k", "x-api-key": "k"})
    assert resp.status_code == 200, resp.text
    sent = fake.requests[-1]
    assert (sent["temperature"], sent["top_k"], sent["seed"]) == (0.0, 1, 7)
    assert "top_p" not in sent  # a field the override leaves None keeps the harness's (none here)
    (record,) = await service.completions("s")
    assert record.normalized_request["temperature"] == 0.0 and record.normalized_request["top_k"] == 1
    assert record.normalizations[-1] == "sampling override: temperature 0.7 -> 0.0, top_k unset -> 1, seed unset -> 7"
    assert record.request == body  # what the harness sent, as it sent it
    await client.aclose()


@pytest.mark.parametrize("provider", ["openai_chat", "anthropic"])
async def test_a_session_without_an_override_is_forwarded_as_the_harness_asked(provider: str) -> None:
    path, body = CALLS[provider]
    for metadata in (None, gateway_metadata()):  # no sampling; or the gateway's dump with sampling None
        service, fake, client = served(metadata if metadata is None else {**metadata, "sampling": None})
        resp = await client.post(path, json=body, headers={"authorization": "Bearer k", "x-api-key": "k"})
        assert resp.status_code == 200, resp.text
        sent = fake.requests[-1]
        assert sent["temperature"] == 0.7 and "top_k" not in sent and "seed" not in sent
        (record,) = await service.completions("s")
        assert not any(n.startswith("sampling override") for n in record.normalizations)
        await client.aclose()


async def test_an_override_equal_to_the_harness_values_changes_nothing_and_notes_nothing() -> None:
    service, fake, client = served(gateway_metadata(temperature=0.7))
    path, body = CALLS["openai_chat"]
    assert (await client.post(path, json=body, headers={"authorization": "Bearer k"})).status_code == 200
    assert fake.requests[-1]["temperature"] == 0.7
    (record,) = await service.completions("s")
    assert not any(n.startswith("sampling override") for n in record.normalizations)
    await client.aclose()


async def test_a_streamed_call_passed_through_is_forwarded_with_the_override() -> None:
    service, fake, client = served(gateway_metadata(temperature=0.0))
    assert service.engine.stream_passthrough
    path, body = CALLS["anthropic"]
    resp = await client.post(path, json={**body, "stream": True}, headers={"x-api-key": "k"})
    assert resp.status_code == 200 and "message_stop" in resp.text
    assert fake.requests[-1]["stream"] is True and fake.requests[-1]["temperature"] == 0.0
    (record,) = await service.completions("s")
    assert record.stream and record.normalized_request["temperature"] == 0.0
    await client.aclose()


async def test_the_token_in_engine_samples_with_the_override_streamed_or_not(tok: HFChatTokenizer) -> None:
    service, client = token_in_proxy(tok, ["one", "two"])
    service.sessions.register(SessionInfo("s", "m", gateway_metadata(temperature=0.0, top_p=0.5), key="k"))
    fake = cast(Any, service.engine).client._transport.handler
    for stream in (False, True):
        ask = {"model": "m", "messages": HI, "temperature": 1.0, "stream": stream}
        assert (await client.post("/v1/chat/completions", json=ask, headers={"authorization": "Bearer k"})
                ).status_code == 200
        assert (fake.sent[-1]["temperature"], fake.sent[-1]["top_p"]) == (0.0, 0.5)
    assert [r.normalized_request["temperature"] for r in await service.completions("s")] == [0.0, 0.0]
    await client.aclose()


def test_every_engine_body_carries_the_overridden_values() -> None:
    """vLLM and SGLang chat, vLLM's and SGLang's token-in bodies, and a plain OpenAI server all read the one
    normalized request, so the override reaches each."""
    asked = ChatRequest(model="m", messages=[ChatMessage(role="user", content="hi")], temperature=1.0, top_p=0.9)
    asked.dump()  # a dump made before the override must not leak the old values
    greedy, note = asked.with_sampling(SamplingOverride(temperature=0, top_k=1).overrides())
    assert note == "sampling override: temperature 1.0 -> 0.0, top_k unset -> 1"
    for body in (VLLMEngine().build(greedy), SGLangEngine().build(greedy), OpenAIEngine().build(greedy),
                 completions_body(greedy, [1, 2], [3])):
        assert (body["temperature"], body["top_p"], body["top_k"]) == (0.0, 0.9, 1)
    assert sampling_params(greedy) == {"temperature": 0.0, "top_p": 0.9, "top_k": 1}
    assert asked.temperature == 1.0 and asked.dump()["temperature"] == 1.0  # the harness's request is untouched


@pytest.mark.parametrize("bad", [{"temperature": -0.1}, {"temperature": 2.5}, {"temperature": float("nan")},
                                 {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 0}, {"top_k": -2}, {"seed": 2**63},
                                 {"seed": 1.5}, {"min_p": 0.1}, {"temperature": "hot"}])
def test_a_bad_override_is_refused_at_submit_and_at_registration(bad: dict[str, Any]) -> None:
    with pytest.raises(pydantic.ValidationError):
        SamplingOverride.model_validate(bad)
    with pytest.raises(SessionMetadataError, match="invalid sampling override"):
        SessionInfo("s", metadata={"sampling": bad})


def test_good_overrides_keep_only_the_fields_set() -> None:
    assert SamplingOverride(temperature=0).overrides() == {"temperature": 0.0}
    assert SamplingOverride(top_k=-1, top_p=1, seed=-(2**63)).overrides() == {"top_p": 1.0, "top_k": -1,
                                                                               "seed": -(2**63)}
    assert SessionInfo("s", metadata={"sampling": {}}).sampling is None  # an empty override is none
    assert SessionInfo("s", metadata=gateway_metadata(temperature=0)).sampling == {"temperature": 0.0}


async def test_the_rollout_server_answers_a_bad_override_422_before_storing_anything() -> None:
    class Untouchable:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"a refused task reached the server ({name})")

    app = create_server_app(cast(RolloutServer, Untouchable()), ADMIN, manage_lifecycle=False)
    task = TaskRequest(task_id="t", instruction="x", agent={"harness": "pi"},  # type: ignore[arg-type]
                       metadata=TaskMetadata(sampling=SamplingOverride(temperature=0.0))).model_dump(mode="json")
    task["metadata"]["sampling"] = {"temperature": 3.0}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://server") as client:
        resp = await client.post("/tasks", json=task, headers={"x-admin-token": ADMIN})
    assert resp.status_code == 422
    (error,) = resp.json()["error"]["message"]
    assert error["loc"] == ["body", "metadata", "sampling", "temperature"]


async def test_a_proxy_registration_with_a_bad_override_is_a_400_and_serves_no_key() -> None:
    service, _, client = served(None)
    resp = await client.post("/admin/sessions", headers={"x-admin-token": ADMIN},
                             json={"session_id": "t", "metadata": {"sampling": {"top_k": 0}}})
    assert resp.status_code == 400 and "invalid sampling override" in resp.text
    assert service.sessions.count() == 1  # only "s"
    ok = await client.post("/admin/sessions", headers={"x-admin-token": ADMIN},
                           json={"session_id": "t", "metadata": {"sampling": {"temperature": 0}}})
    assert ok.status_code == 200
    path, body = CALLS["openai_chat"]
    fake = cast(Any, service.engine).client._transport.handler.__self__
    assert (await client.post(path, json=body, headers={"authorization": f"Bearer {ok.json()['api_key']}"})
            ).status_code == 200
    assert fake.requests[-1]["temperature"] == 0.0
    await client.aclose()
