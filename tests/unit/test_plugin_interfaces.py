"""What engines and providers declare instead of being asked by their class: an engine's end-of-turn IDs and its
session hooks, a provider's error shape, response id prefix and (optional) token counting; each through the
proxy's public path."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import orjson
import pytest

from polar_gym.proxy.app import create_app
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.chat import ChatMessage, ChatRequest, ChatResult, Usage
from polar_gym.proxy.engines.base import Engine
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.errors import SessionMetadataError
from polar_gym.proxy.providers.base import Inbound, Provider, RenderContext, Route, SSEEvent
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.schema import OracleScript
from tests._fakes import ByteTokenizer

ADMIN = "admin-secret"
EOT = 99


class ScriptedEngine(Engine):
    """Answers from a list of (prompt_ids, response_ids) and records its session hooks."""

    name = "scripted"

    def __init__(self, answers: list[tuple[list[int], list[int]]], eot: tuple[int, ...] | None) -> None:
        super().__init__()
        self.answers = list(answers)
        self.eot = eot
        self.opened: list[tuple[str, dict[str, Any]]] = []
        self.closed: list[str] = []

    @property
    def end_of_turn_ids(self) -> tuple[int, ...] | None:
        return self.eot

    def open_session(self, session_id: str, metadata: Mapping[str, Any]) -> None:
        self.opened.append((session_id, dict(metadata)))

    def close_session(self, session_id: str) -> None:
        self.closed.append(session_id)

    async def complete(self, request: ChatRequest, session_id: str) -> ChatResult:
        prompt, response = self.answers.pop(0)
        return ChatResult(message=ChatMessage(role="assistant", content="ok"), prompt_ids=prompt,
                          response_ids=response, response_logprobs=[-0.5] * len(response),
                          usage=Usage(prompt_tokens=len(prompt), completion_tokens=len(response)), engine=self.name)


def client_for(service: ProxyService) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(create_app(service, ADMIN)), base_url="http://proxy")


def service_for(engine: Engine, adhoc: bool = True) -> ProxyService:
    return ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=adhoc))


async def chat(client: httpx.AsyncClient, key: str, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None = None) -> httpx.Response:
    body: dict[str, Any] = {"model": "policy", "messages": messages}
    if tools:
        body["tools"] = tools
    return await client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})


# ---------------------------------------------------------------- engines: end-of-turn IDs


def test_engines_declare_their_end_of_turn_ids():
    assert VLLMEngine().end_of_turn_ids is None  # the inference server renders: the engine cannot know them
    assert OracleEngine(ByteTokenizer()).end_of_turn_ids == (257, 258)  # its tokenizer's


@pytest.mark.parametrize(("eot", "cause"), [((EOT,), "thinking_dropped"), (None, "drift")])
async def test_the_trajectory_route_defaults_to_the_engines_end_of_turn_ids(eot, cause):
    """The second prompt re-renders the first reply without its thinking token (10): knowing that 99 ends a turn,
    the builder tells this apart from drift; without it (Qwen's IDs by default) it cannot."""
    first = ([1, 2, 3], [10, 11, 12, EOT])
    second = ([1, 2, 3, 11, 12, EOT, 5, 6], [13, EOT])
    service = service_for(ScriptedEngine([first, second], eot))
    async with client_for(service) as client:
        messages = [{"role": "user", "content": "hi"}]
        assert (await chat(client, "s1", messages)).status_code == 200
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
        assert (await chat(client, "s1", messages)).status_code == 200
        resp = await client.get("/sessions/s1/trajectory", headers={"authorization": "Bearer s1"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["diagnostics"]["breaks"] == {cause: 1}
        # an explicit builder config still wins over the engine's default
        explicit = await client.get("/sessions/s1/trajectory", params={"config": json.dumps(
            {"end_of_turn_ids": [EOT]})}, headers={"authorization": "Bearer s1"})
        assert explicit.json()["diagnostics"]["breaks"] == {"thinking_dropped": 1}


# ---------------------------------------------------------------- engines: session hooks


async def test_registration_opens_and_unregistration_closes_the_engines_session():
    engine = ScriptedEngine([], None)
    async with client_for(service_for(engine, adhoc=False)) as client:
        admin = {"x-admin-token": ADMIN}
        resp = await client.post("/admin/sessions", json={"session_id": "s1", "metadata": {"group": "g"},
                                                           "oracle": {"commands": ["ls"]}}, headers=admin)
        assert resp.status_code == 200
        assert engine.opened == [("s1", {"group": "g", "oracle": {"commands": ["ls"]}})] and engine.closed == []
        assert (await client.delete("/admin/sessions/s1", headers=admin)).json() == {"unregistered": True}
        assert engine.closed == ["s1"]


BASH = [{"type": "function", "function": {"name": "bash", "description": "run",
                                           "parameters": {"type": "object", "properties": {"command": {
                                               "type": "string"}}, "required": ["command"]}}}]


async def test_the_oracle_plays_the_script_its_session_registered_with_and_forgets_it_at_the_end():
    engine = OracleEngine(ByteTokenizer(), default_script=OracleScript(commands=["echo default"]))
    service = service_for(engine, adhoc=False)
    async with client_for(service) as client:
        admin = {"x-admin-token": ADMIN}
        resp = await client.post("/admin/sessions", json={"session_id": "s1", "oracle": {
            "commands": ["echo mine"], "final_answer": "done"}}, headers=admin)
        key = resp.json()["api_key"]
        answer = await chat(client, key, [{"role": "user", "content": "go"}], BASH)
        call = answer.json()["choices"][0]["message"]["tool_calls"][0]
        assert json.loads(call["function"]["arguments"]) == {"command": "echo mine"}
        assert "s1" in engine.scripts
        await client.delete("/admin/sessions/s1", headers=admin)
        assert "s1" not in engine.scripts  # close_session: a finished session's script does not linger


@pytest.mark.parametrize("script", [{"commands": "ls"}, {"nope": 1}, {"final_answer": 3}])
async def test_a_bad_oracle_script_is_a_400_naming_the_field_and_registers_nothing(script):
    engine = OracleEngine(ByteTokenizer())
    service = service_for(engine, adhoc=False)
    async with client_for(service) as client:
        resp = await client.post("/admin/sessions", json={"session_id": "s1", "oracle": script},
                                 headers={"x-admin-token": ADMIN})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["type"] == "invalid_request" and error["message"].startswith("invalid oracle script: ")
        assert next(iter(script)) in error["message"]  # the field at fault
        assert service.sessions.get("s1") is None and "s1" not in engine.scripts


@pytest.mark.parametrize("script", ["ls", ["ls"], {"commands": [1]}])
def test_open_session_refuses_task_metadata_whose_oracle_is_not_a_script(script):
    """A gateway hands the task's metadata over as it came; the engine refuses what is not a script (before the
    session's key is registered)."""
    engine = OracleEngine(ByteTokenizer())
    with pytest.raises(SessionMetadataError, match=r"^invalid oracle script: "):
        engine.open_session("s1", {"oracle": script})
    assert "s1" not in engine.scripts


def test_open_session_without_a_script_plays_the_default():
    engine = OracleEngine(ByteTokenizer())
    engine.open_session("s1", {"oracle": {"commands": ["a"]}})
    assert engine.scripts["s1"] == OracleScript(commands=["a"])
    engine.open_session("s1", {"group": "g"})  # registered again, without one
    assert "s1" not in engine.scripts
    engine.close_session("never-opened")  # harmless


def test_the_base_engine_hooks_do_nothing():
    engine = VLLMEngine()
    engine.open_session("s1", {"oracle": {"commands": "not even valid"}})  # not an engine that reads scripts
    engine.close_session("s1")


# ---------------------------------------------------------------- providers


class QuietProvider(Provider[None]):
    """A protocol without a token-counting call, answering errors the Google way."""

    name = "quiet"
    conversation_field = "contents"
    error_style = "google"
    id_prefix = "quiet-"

    def parse(self, body: dict[str, Any], route: Route) -> Inbound[None]:
        chat = ChatRequest(model="m", messages=[ChatMessage(role="user", content=str(body.get("text", "")))])
        return Inbound(provider=self.name, model="m", stream=False, chat=chat, render_state=None)

    def render(self, result: ChatResult, inbound: Inbound[None], ctx: RenderContext) -> dict[str, Any]:
        return {"id": ctx.response_id, "text": result.text}

    def stream(self, result: ChatResult, inbound: Inbound[None], ctx: RenderContext) -> Iterator[SSEEvent]:
        yield SSEEvent(self.render(result, inbound, ctx))


async def test_a_provider_without_token_counting_answers_in_its_own_error_shape():
    service = service_for(ScriptedEngine([([1], [2, EOT])], None))
    service.providers["quiet"] = QuietProvider()
    headers = {"authorization": "Bearer s1"}
    reply = await service.count_tokens("quiet", b'{"text": "hi"}', Route("/count"), headers)
    assert reply.status == 404
    assert orjson.loads(reply.body) == {"error": {"code": 404, "status": "NOT_FOUND", "message":
                                                  "the quiet protocol has no token counting endpoint"}}
    chat_reply = await service.count_tokens("openai_chat", b'{"model": "m", "messages": []}', Route("/c"), headers)
    assert chat_reply.status == 404 and orjson.loads(chat_reply.body)["error"]["type"] == "invalid_request_error"
    # its answers carry its own id prefix
    answer = await service.handle("quiet", b'{"text": "hi"}', Route("/quiet"), headers)
    assert answer.status == 200 and orjson.loads(answer.body)["id"].startswith("quiet-")


async def test_counting_providers_count_through_the_engine():
    service = service_for(OracleEngine(ByteTokenizer()))
    async with client_for(service) as client:
        resp = await client.post("/v1/messages/count_tokens", headers={"x-api-key": "s1"}, json={
            "model": "policy", "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 200 and resp.json()["input_tokens"] > 0


def test_providers_declare_error_style_and_id_prefix():
    service = service_for(VLLMEngine())
    declared = {name: (service.provider(name).error_style, service.provider(name).id_prefix)
                for name in ("anthropic", "openai_chat", "openai_responses", "google")}
    assert declared == {"anthropic": ("anthropic", "msg_"), "openai_chat": ("openai", "chatcmpl-"),
                        "openai_responses": ("openai", "resp_"), "google": ("google", "")}
    # an unknown provider name still gets an error body (OpenAI's shape)
    reply = service.error_reply(SessionMetadataError("x"), "no-such-provider")
    assert reply.status == 400 and orjson.loads(reply.body)["error"]["message"] == "x"
