"""Streaming pass-through on the real vLLM (CPU build, tiny random Qwen3, real tokenizer): the official OpenAI,
Anthropic and Google SDKs stream a token-in call while vLLM samples it (``/v1/completions`` with ``stream``), and
the journal of each streamed call equals the journal of the same call not streamed (temperature 0, same seed):
prompt ids, sampled ids, logprobs, the parsed message, the usage. What the SDK assembles from the stream is what
the non-streamed answer says. In chat mode (vLLM renders the prompt and parses the answer) vLLM's chat stream is
passed through, with the same guarantee."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import types

from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.tokenin import VLLMTokenInEngine
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.parsers.base import parser_for
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool
from tests._serving import RunningProxy, serve
from tests._vllm import VLLMServer

pytestmark = pytest.mark.engine

#: the answer streams as text at once: no think block to wait for the end of
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
SAMPLING: dict[str, Any] = {"temperature": 0, "seed": 7}


@pytest.fixture
def stream_proxy(vllm_server: VLLMServer, qwen_tokenizer: HFChatTokenizer) -> Iterator[RunningProxy]:
    client = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0),
                               limits=httpx.Limits(max_keepalive_connections=0))
    engine = VLLMTokenInEngine(qwen_tokenizer, parser_for("qwen3"), UpstreamPool([vllm_server.url]), client=client,
                               upstream_model=vllm_server.model)
    assert engine.stream_passthrough  # on by default for engines that stream
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True),
                           model_names=[vllm_server.model])
    yield from serve(service)


def record(proxy: RunningProxy, session: str) -> dict[str, Any]:
    resp = httpx.get(f"{proxy.url}/sessions/{session}/completions", headers={"authorization": f"Bearer {session}"})
    resp.raise_for_status()
    (rec,) = resp.json()["completions"]
    return dict(rec)


def assert_same_capture(proxy: RunningProxy, plain_key: str, stream_key: str) -> dict[str, Any]:
    plain, streamed = record(proxy, plain_key), record(proxy, stream_key)
    assert plain["stream"] is False and streamed["stream"] is True
    assert streamed["status"] == plain["status"] == "ok"
    for key in ("prompt_ids", "response_ids", "response_logprobs", "finish_reason", "token_faithful", "prompt_mode",
                "unparseable_tool_calls", "normalized_request"):
        assert streamed[key] == plain[key], key
    assert streamed["response"]["message"] == plain["response"]["message"]
    assert streamed["response"]["usage"] == plain["response"]["usage"]
    assert plain["response_ids"] and len(plain["response_logprobs"]) == len(plain["response_ids"])
    return streamed


def test_openai_sdk_streams_as_vllm_samples_and_captures_the_same(stream_proxy: RunningProxy) -> None:
    ask: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Count to ten."}],
                           "max_tokens": 24, **SAMPLING}
    plain = openai.OpenAI(base_url=stream_proxy.url + "/v1", api_key="st-oa-plain", max_retries=0).chat.completions\
        .create(**ask, extra_body=NO_THINKING)
    c = openai.OpenAI(base_url=stream_proxy.url + "/v1", api_key="st-oa-stream", max_retries=0)
    deltas = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**ask, extra_body=NO_THINKING,
                                                                                      stream=True) if ch.choices]
    assert "".join(deltas) == (plain.choices[0].message.content or "")
    assert sum(1 for d in deltas if d) > 1  # the text came in pieces, as vLLM sampled it
    assert_same_capture(stream_proxy, "st-oa-plain", "st-oa-stream")


def test_anthropic_sdk_stream_is_the_message_and_the_capture(stream_proxy: RunningProxy) -> None:
    ask: dict[str, Any] = {"model": "claude-x", "max_tokens": 24, "extra_body": {"temperature": 0},
                           "messages": [{"role": "user", "content": "Say something."}],
                           "thinking": {"type": "enabled", "budget_tokens": 16}}
    plain = anthropic.Anthropic(base_url=stream_proxy.url, api_key="st-an-plain", max_retries=0).messages.create(
        **ask)
    c = anthropic.Anthropic(base_url=stream_proxy.url, api_key="st-an-stream", max_retries=0)
    with c.messages.stream(**ask) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in plain.content]
    assert streamed.stop_reason == plain.stop_reason and streamed.usage.output_tokens == plain.usage.output_tokens
    assert_same_capture(stream_proxy, "st-an-plain", "st-an-stream")


def test_google_sdk_stream_is_the_answer_and_the_capture(stream_proxy: RunningProxy) -> None:
    def client(key: str) -> genai.Client:
        return genai.Client(api_key=key, http_options=types.HttpOptions(
            base_url=stream_proxy.url, api_version="v1beta", retry_options=types.HttpRetryOptions(attempts=1)))

    config = types.GenerateContentConfig(max_output_tokens=24, temperature=0, seed=7)
    plain_client, stream_client = client("st-go-plain"), client("st-go-stream")  # a dropped client closes itself
    plain = plain_client.models.generate_content(model="gemini-x", contents="Say hi", config=config)
    chunks = list(stream_client.models.generate_content_stream(model="gemini-x", contents="Say hi", config=config))
    assert "".join(ch.text or "" for ch in chunks) == (plain.text or "")
    assert chunks[-1].candidates and chunks[-1].candidates[0].finish_reason == plain.candidates[0].finish_reason
    assert_same_capture(stream_proxy, "st-go-plain", "st-go-stream")


@pytest.fixture
def chat_stream_proxy(vllm_server: VLLMServer) -> Iterator[RunningProxy]:
    """Chat mode: vLLM renders the prompt and parses the answer (its qwen3 reasoning and hermes tool parsers)."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0),
                               limits=httpx.Limits(max_keepalive_connections=0))
    engine = VLLMEngine(UpstreamPool([vllm_server.url]), client=client, upstream_model=vllm_server.model)
    assert engine.stream_passthrough
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True),
                           model_names=[vllm_server.model])
    yield from serve(service)


def test_chat_mode_streams_vllms_chat_deltas_and_captures_the_same(chat_stream_proxy: RunningProxy) -> None:
    ask: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Count to ten."}],
                           "max_tokens": 24, **SAMPLING}
    url = chat_stream_proxy.url
    plain = openai.OpenAI(base_url=url + "/v1", api_key="ch-oa-plain", max_retries=0).chat.completions.create(
        **ask, extra_body=NO_THINKING)
    c = openai.OpenAI(base_url=url + "/v1", api_key="ch-oa-stream", max_retries=0)
    deltas = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**ask, extra_body=NO_THINKING,
                                                                                      stream=True) if ch.choices]
    assert "".join(deltas) == (plain.choices[0].message.content or "")
    assert sum(1 for d in deltas if d) > 1
    assert assert_same_capture(chat_stream_proxy, "ch-oa-plain", "ch-oa-stream")["prompt_mode"] == "chat"
    think: dict[str, Any] = {"model": "claude-x", "max_tokens": 24, "extra_body": {"temperature": 0},
                             "messages": [{"role": "user", "content": "Say something."}],
                             "thinking": {"type": "enabled", "budget_tokens": 16}}
    plain_message = anthropic.Anthropic(base_url=url, api_key="ch-an-plain", max_retries=0).messages.create(**think)
    with anthropic.Anthropic(base_url=url, api_key="ch-an-stream", max_retries=0).messages.stream(**think) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in plain_message.content]
    assert_same_capture(chat_stream_proxy, "ch-an-plain", "ch-an-stream")
