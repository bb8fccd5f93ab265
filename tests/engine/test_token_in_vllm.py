"""Token-in prompts on a real vLLM (CPU build, tiny random Qwen3, real Qwen tokenizer and chat template): a
multi-turn conversation through the proxy is ONE chain whose every prompt extends the previous prompt + response
token for token, and the captured IDs and logprobs are exactly the engine's.

Random weights emit gibberish and rarely call a tool, so the tool round trip is in the conversation's history and
later sampled tool calls, if any, are answered (test_gateway_vllm.py has the engine sample them under a regex)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from polar_gym.merge import MergeConfig
from polar_gym.merge.prefix_merging import prefix_merging
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.chat import ChatRequest
from polar_gym.proxy.engines.tokenin import VLLMTokenInEngine
from polar_gym.proxy.parsers.base import parser_for
from polar_gym.proxy.service import ProxyService, SessionInfo, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer, template_messages
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.schema import CompletionSession, TaskMetadata
from tests._serving import serve
from tests._vllm import VLLMServer
from tests.engine._engine_kit import EngineProxy, RecordingTransport
from tests.merge._sessions import check_invariants

pytestmark = pytest.mark.engine

SHELL = {"type": "function", "function": {
    "name": "run_shell_command", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


@pytest.fixture
def token_proxy(vllm_server: VLLMServer, qwen_tokenizer: HFChatTokenizer) -> Iterator[EngineProxy]:
    transport = RecordingTransport()
    client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(120.0, connect=5.0))
    engine = VLLMTokenInEngine(qwen_tokenizer, parser_for("qwen3"), UpstreamPool([vllm_server.url]), client=client,
                               upstream_model=vllm_server.model)
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True),
                           model_names=[vllm_server.model])
    for running in serve(service):
        yield EngineProxy(running.url, service, transport, vllm_server)


def records(proxy: EngineProxy, session: str) -> list[dict[str, Any]]:
    resp = httpx.get(f"{proxy.url}/sessions/{session}/completions", headers={"authorization": f"Bearer {session}"})
    resp.raise_for_status()
    return list(resp.json()["completions"])


def assert_one_contiguous_chain(recs: list[dict[str, Any]], proxy: EngineProxy, eot: int) -> None:
    calls = [e for e in proxy.exchanges if e.path == "/v1/completions"]
    assert len(calls) == len(recs)
    for rec, call in zip(recs, calls, strict=True):
        assert call.status == 200, call.answer
        choice = call.answer["choices"][0]
        assert rec["status"] == "ok" and rec["prompt_mode"] == "token_in"
        assert call.request["prompt"] == rec["prompt_ids"] == choice["prompt_token_ids"]
        assert rec["response_ids"] == choice["token_ids"]
        assert rec["response_logprobs"] == choice["logprobs"]["token_logprobs"]
    for earlier, later in itertools.pairwise(recs):
        seen = earlier["prompt_ids"] + earlier["response_ids"]
        if not earlier["response_ids"] or earlier["response_ids"][-1] != eot:
            seen = [*seen, eot]  # a turn cut at max_tokens is closed by the template's end-of-turn token
        assert later["prompt_ids"][:len(seen)] == seen  # NeMo RL's contiguity rule, token for token
    new_chains = [[n for n in r["normalizations"] if n.startswith("token_in_new_chain")] for r in recs]
    assert new_chains == [["token_in_new_chain:new_context"]] + [[]] * (len(recs) - 1)


def test_multi_turn_chat_through_the_proxy_is_one_chain(token_proxy: EngineProxy,
                                                         qwen_tokenizer: HFChatTokenizer) -> None:
    c = openai.OpenAI(base_url=token_proxy.url + "/v1", api_key="tk-chat", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": "Say hi."}]
    for turn in range(4):
        resp = c.chat.completions.create(model="policy", max_tokens=6, messages=messages,  # type: ignore[arg-type]
                                         tools=[SHELL])  # type: ignore[list-item]
        msg = resp.choices[0].message
        messages.append({"role": "assistant", "content": msg.content or "",
                         **({"tool_calls": [t.model_dump() for t in msg.tool_calls]} if msg.tool_calls else {})})
        messages += [{"role": "tool", "tool_call_id": t.id, "content": "a.txt"} for t in msg.tool_calls or []]
        messages.append({"role": "user", "content": f"Go on ({turn})."})
    recs = records(token_proxy, "tk-chat")
    assert len(recs) == 4
    assert_one_contiguous_chain(recs, token_proxy, qwen_tokenizer.end_of_turn_ids[0])
    sess = CompletionSession.model_validate({"session_id": "tk-chat", "completions": recs})
    for config in (MergeConfig(), MergeConfig(on_rerender="merge")):
        traj = prefix_merging(sess, config)
        check_invariants(sess, traj)
        assert len(traj.traces) == 1


def test_tool_history_conversation_is_one_chain(token_proxy: EngineProxy, qwen_tokenizer: HFChatTokenizer) -> None:
    """A conversation whose history holds a tool round trip (compact JSON arguments, as harnesses echo them), whose
    later turns answer any sampled tool call with a tool result: still one chain, exact token for token."""
    c = openai.OpenAI(base_url=token_proxy.url + "/v1", api_key="tk-tools", max_retries=0)
    call = {"id": "call_1", "type": "function", "function": {"name": "run_shell_command",
                                                             "arguments": '{"command":"ls"}'}}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "List the files."},
                                      {"role": "assistant", "content": "", "tool_calls": [call]},
                                      {"role": "tool", "tool_call_id": "call_1", "content": "a.txt\nb.txt"}]
    for turn in range(3):
        resp = c.chat.completions.create(model="policy", max_tokens=5, messages=messages,  # type: ignore[arg-type]
                                         tools=[SHELL])  # type: ignore[list-item]
        msg = resp.choices[0].message
        messages.append({"role": "assistant", "content": msg.content or "",
                         **({"tool_calls": [t.model_dump() for t in msg.tool_calls]} if msg.tool_calls else {})})
        if msg.tool_calls:
            messages += [{"role": "tool", "tool_call_id": t.id, "content": "ok"} for t in msg.tool_calls]
        else:
            messages.append({"role": "user", "content": f"Now run it again ({turn})."})
    recs = records(token_proxy, "tk-tools")
    assert_one_contiguous_chain(recs, token_proxy, qwen_tokenizer.end_of_turn_ids[0])
    assert "<tool_response>\na.txt\nb.txt\n</tool_response>" in qwen_tokenizer.decode(recs[-1]["prompt_ids"])
    assert recs[0]["prompt_ids"] == qwen_tokenizer.render(
        *template_messages(ChatRequest.model_validate(recs[0]["normalized_request"])))


def test_greedy_sessions_sample_the_same_tokens_whatever_the_harness_asks(token_proxy: EngineProxy) -> None:
    """A session whose metadata forces greedy sampling (``metadata.sampling``, issue 36) is sent temperature 0 though
    its harness asks 1.0: two such sessions sample the same token IDs, and the records say so."""
    metadata = TaskMetadata.model_validate({"sampling": {"temperature": 0.0}}).model_dump()  # as a gateway has it
    for name in ("greedy-a", "greedy-b"):
        token_proxy.service.sessions.register(SessionInfo(name, "policy", metadata, key=f"{name}-key"))
        c = openai.OpenAI(base_url=token_proxy.url + "/v1", api_key=f"{name}-key", max_retries=0)
        c.chat.completions.create(model="policy", max_tokens=8, temperature=1.0,
                                  messages=[{"role": "user", "content": "Count to five."}])
    (a,), (b,) = (httpx.get(f"{token_proxy.url}/sessions/{name}/completions",
                            headers={"authorization": f"Bearer {name}-key"}).json()["completions"]
                  for name in ("greedy-a", "greedy-b"))
    calls = [e for e in token_proxy.exchanges if e.path == "/v1/completions"]
    assert [call.request["temperature"] for call in calls[-2:]] == [0.0, 0.0]
    assert a["request"]["temperature"] == 1.0 and a["normalized_request"]["temperature"] == 0.0
    assert a["response_ids"] and a["response_ids"] == b["response_ids"]
