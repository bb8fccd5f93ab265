"""vLLM CPU samples a malformed tool call: the tiny model, steered by vLLM's own structured outputs (a regex over
the reply that the engine adds to its upstream body, as tests/engine/_engine_kit.py's ToolSteeredEngine does; the
grammar only masks logits, vLLM samples every token), writes a ``<tool_call>`` block whose JSON is cut short, in an
agent loop through the official OpenAI SDK in token-in mode, plain and streamed. The harness gets
the block as text, the record holds the tokens vLLM sampled for it, and under each policy the trace gets the reward,
mask and flag the policy promises."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from polar_gym.merge import MALFORMED_POLICIES
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.chat import ChatRequest
from polar_gym.proxy.engines.tokenin import VLLMTokenInEngine
from polar_gym.proxy.parsers.base import parser_for
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.schema import CompletionRecord, CompletionSession
from tests._serving import RunningProxy, serve
from tests._vllm import VLLMServer
from tests.engine._engine_kit import SteeredCalls, regex_steered
from tests.merge._malformed import check_policy

pytestmark = pytest.mark.engine

GOOD = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
BAD = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"\n</tool_call>'
BASH = {"type": "function", "function": {"name": "bash", "description": "run a shell command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


class ScriptedReplies(SteeredCalls, VLLMTokenInEngine):
    """Asks vLLM to sample the conversation's N-th reply as ``REPLIES[N]`` (N: tool results so far)."""

    def steer(self, request: ChatRequest) -> ChatRequest:
        done = sum(1 for m in request.messages if m.role == "tool")
        return regex_steered(request, re.escape(REPLIES[done]))


REPLIES = [GOOD, BAD]


@pytest.fixture(scope="module")
def proxy(vllm_server: VLLMServer, qwen_tokenizer: HFChatTokenizer) -> Iterator[RunningProxy]:
    """The proxy on the shared vLLM; its engine keeps no connection open (a pooled socket left for the garbage
    collector fails whichever test is running when it is collected)."""
    engine = ScriptedReplies(qwen_tokenizer, parser_for("qwen3"), UpstreamPool([vllm_server.url]),
                               client=httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0),
                                                        limits=httpx.Limits(max_keepalive_connections=0)),
                               upstream_model=vllm_server.model)
    yield from serve(ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True),
                                  model_names=[vllm_server.model]))


def agent_loop(proxy: RunningProxy, vllm_server: VLLMServer, session_id: str, stream: bool) -> CompletionSession:
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=session_id, max_retries=0)

    def call(messages: list[dict]) -> dict:
        kw = {"model": vllm_server.model, "messages": messages, "tools": [BASH], "max_tokens": 64,
              "temperature": 0, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
        if not stream:
            return client.chat.completions.create(**kw).choices[0].message.model_dump(exclude_none=True)
        content, calls = "", {}
        for chunk in client.chat.completions.create(**kw, stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            content += (delta.content or "") if delta else ""
            for c in (delta.tool_calls or []) if delta else []:
                calls.setdefault(c.index, c)
        message: dict = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [c.model_dump(exclude_none=True) for c in calls.values()]
        return message

    messages: list[dict] = [{"role": "user", "content": "list the files"}]
    first = call(messages)
    assert first.get("tool_calls") and first["tool_calls"][0]["function"]["name"] == "bash", first
    messages += [first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "calc.py"}]
    second = call(messages)
    assert not second.get("tool_calls") and BAD in second["content"], "the harness sees the block as text"
    records = [CompletionRecord.model_validate(r) for r in proxy.completions(session_id)]
    return CompletionSession(session_id=session_id, completions=records)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_vllm_samples_a_malformed_call_and_each_policy_does_what_it_says(
        proxy: RunningProxy, vllm_server: VLLMServer, qwen_tokenizer: HFChatTokenizer, stream: bool) -> None:
    session = agent_loop(proxy, vllm_server, f"vllm-malformed-{stream}", stream)
    good, bad = sorted(session.completions, key=lambda r: r.index)
    assert good.unparseable_tool_calls == 0 and bad.unparseable_tool_calls == 1
    assert {good.prompt_mode, bad.prompt_mode} == {"token_in"} and bad.engine == good.engine
    (span,) = bad.malformed_tool_call_spans
    assert qwen_tokenizer.decode(bad.response_ids[span["start"]:span["end"]]).strip() == BAD  # what vLLM sampled
    for builder in ("prefix_merging", "per_request"):
        for policy in MALFORMED_POLICIES:
            check_policy(session, bad.completion_id, builder, policy)
