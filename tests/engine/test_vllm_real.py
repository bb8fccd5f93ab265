"""The proxy in front of a real vLLM server (CPU build, tiny random Qwen3, real Qwen tokenizer), driven by the
official SDKs of every front end, plain and streamed. For every captured completion the recorded prompt IDs,
sampled IDs and logprobs must be exactly the engine's (compared with the raw JSON the engine sent back), and our
own chat-template rendering (the oracle's) must give the engine's prompt IDs for the same conversation.

Random weights emit gibberish and rarely stop, so every call caps its output at a few tokens.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import types

from polar_gym.merge import MergeConfig
from polar_gym.merge.prefix_merging import prefix_merging
from polar_gym.proxy.chat import ChatRequest
from polar_gym.proxy.tokenizer import HFChatTokenizer, template_messages
from polar_gym.schema import CompletionSession
from tests.merge._sessions import check_invariants

pytestmark = pytest.mark.engine

SHELL = {"type": "function", "function": {
    "name": "run_shell_command", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
PICK = {"type": "function", "function": {
    "name": "pick", "description": "Pick a mode",
    "parameters": {"type": "object", "properties": {"mode": {"type": "string", "enum": ["fast", "slow"]}},
                   "required": ["mode"], "additionalProperties": False}}}

def records(proxy: Any, session: str) -> list[dict[str, Any]]:
    resp = httpx.get(f"{proxy.url}/sessions/{session}/completions", headers={"authorization": f"Bearer {session}"})
    resp.raise_for_status()
    return list(resp.json()["completions"])


def assert_faithful(proxy: Any, session: str, tokenizer: HFChatTokenizer, *, count: int) -> list[dict[str, Any]]:
    """Every record of ``session`` holds exactly the engine's token data, and our rendering equals the engine's."""
    recs = records(proxy, session)
    calls = [e for e in proxy.exchanges if e.path == "/v1/chat/completions"]
    assert len(recs) == len(calls) == count
    for rec, call in zip(recs, calls, strict=True):
        assert call.status == 200, call.answer
        choice = call.answer["choices"][0]
        assert rec["status"] == "ok" and rec["token_faithful"] and rec["engine"] == "vllm"
        assert rec["prompt_ids"] == call.answer["prompt_token_ids"]
        assert rec["response_ids"] == choice["token_ids"]
        assert rec["response_logprobs"] == [item["logprob"] for item in choice["logprobs"]["content"]]
        assert rec["server"] == proxy.server.url
        # what we sent is the normalized request, under the served model's name
        assert call.request["messages"] == rec["normalized_request"]["messages"]
        assert call.request["model"] == proxy.server.model and call.request["return_token_ids"] is True
        request = ChatRequest.model_validate(rec["normalized_request"])
        if not request.extra.get("chat_template_kwargs"):
            messages, tools = template_messages(request)
            assert_same_rendering(tokenizer, tokenizer.render(messages, tools), call.answer["prompt_token_ids"])
    return recs


def assert_same_rendering(tokenizer: HFChatTokenizer, ours: list[int], engines: list[int]) -> None:
    """Our (the oracle's) prompt rendering must be the engine's; on a mismatch show the text where they part."""
    if ours == engines:
        return
    at = next((i for i, (a, b) in enumerate(zip(ours, engines, strict=False)) if a != b), min(len(ours), len(engines)))
    lo = max(0, at - 12)
    raise AssertionError(
        f"our chat-template rendering differs from vLLM's at token {at} ({len(ours)} vs {len(engines)} tokens)\n"
        f"  ours:   {tokenizer.decode(ours[lo:at + 24])!r}\n  engine: {tokenizer.decode(engines[lo:at + 24])!r}")


def answer_of(proxy: Any, index: int = -1) -> dict[str, Any]:
    return proxy.exchanges[index].answer


# --- OpenAI Chat Completions ----------------------------------------------------------------------------------

_OPEN: list[Any] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """SDK clients hold pooled sockets: close them so none is collected open (warnings are errors here)."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def chat_client(proxy: Any, key: str) -> openai.OpenAI:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)
    _OPEN.append(client)
    return client


def test_openai_chat_plain(engine_proxy, qwen_tokenizer):
    c = chat_client(engine_proxy, "e-chat")
    resp = c.chat.completions.create(model="policy", max_tokens=6, messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}])
    (rec,) = assert_faithful(engine_proxy, "e-chat", qwen_tokenizer, count=1)
    raw = answer_of(engine_proxy)
    assert resp.choices[0].finish_reason == raw["choices"][0]["finish_reason"]
    assert resp.usage.prompt_tokens == len(rec["prompt_ids"]) == raw["usage"]["prompt_tokens"]
    assert resp.usage.completion_tokens == len(rec["response_ids"]) == raw["usage"]["completion_tokens"]
    assert 1 <= len(rec["response_ids"]) <= 6
    # vLLM's qwen3 reasoning parser files unterminated output under "reasoning"; we must not lose either part
    message = raw["choices"][0]["message"]
    assert rec["response"]["message"].get("reasoning_content") == (message.get("reasoning") or None)
    assert rec["response"]["message"].get("content") == message.get("content")


def test_a_seeded_call_longer_than_a_prefill_step_is_answered_and_the_engine_lives_on(engine_proxy, qwen_tokenizer):
    """A harness's ``seed`` reaches vLLM. The CPU build with chunked prefill split a prompt over 2,048 tokens across
    steps, and for a seeded one its engine died ("CPU Generator does not use offset"), failing every session on it
    from then on. The servers polar_gym starts take a whole prompt a step (``vllm_server_command``)."""
    c = chat_client(engine_proxy, "e-seeded")
    messages = [{"role": "user", "content": " ".join(f"Line {i}: the fox jumps." for i in range(400))}]
    answers = [c.chat.completions.create(model="policy", max_tokens=4, seed=11, messages=messages) for _ in range(2)]
    recs = assert_faithful(engine_proxy, "e-seeded", qwen_tokenizer, count=2)
    assert len(recs[0]["prompt_ids"]) > 2048
    assert [call.request["seed"] for call in engine_proxy.exchanges] == [11, 11]
    # the second call, on the same engine, is answered too, and the same seed sampled the same tokens
    assert recs[0]["response_ids"] == recs[1]["response_ids"]
    assert answers[0].choices[0].message == answers[1].choices[0].message


def test_openai_chat_stream(engine_proxy, qwen_tokenizer):
    c = chat_client(engine_proxy, "e-chat-stream")
    chunks = list(c.chat.completions.create(model="policy", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "Count to three"}]))
    (rec,) = assert_faithful(engine_proxy, "e-chat-stream", qwen_tokenizer, count=1)
    assert rec["stream"] is True
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(rec["response_ids"])
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [answer_of(engine_proxy)["choices"][0]["finish_reason"]]


def test_openai_chat_multi_turn_with_tools_extends_the_prompt(engine_proxy, qwen_tokenizer):
    c = chat_client(engine_proxy, "e-chat-turns")
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coder."},
                                      {"role": "user", "content": "List the files."}]
    for turn in range(3):
        resp = c.chat.completions.create(model="policy", max_tokens=4, messages=messages, tools=[SHELL])
        msg = resp.choices[0].message
        assistant: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
        if msg.tool_calls:  # random weights almost never call a tool, but answer properly if they do
            assistant["tool_calls"] = [call.model_dump() for call in msg.tool_calls]
        messages.append(assistant)
        messages += [{"role": "tool", "tool_call_id": call.id, "content": "a.txt"} for call in msg.tool_calls or []]
        messages.append({"role": "user", "content": f"Go on ({turn})."})
    recs = assert_faithful(engine_proxy, "e-chat-turns", qwen_tokenizer, count=3)
    for earlier, later in itertools.pairwise(recs):
        assert later["prompt_ids"][: len(earlier["prompt_ids"])] == earlier["prompt_ids"]
        assert len(later["prompt_ids"]) > len(earlier["prompt_ids"])
    assert "run_shell_command" in qwen_tokenizer.decode(recs[0]["prompt_ids"])  # the tools reached the template

    # Merged: random weights sample non-canonical, length-stopped replies, so the next prompt re-renders them
    # differently (drift) and the default builder breaks there; every completion still lands in exactly one trace,
    # and the paper's merge-anyway mode yields one chain. Mask-1 tokens are always the engine's own.
    sess = CompletionSession.model_validate({"session_id": "e-chat-turns", "completions": recs})
    for config in (MergeConfig(), MergeConfig(on_rerender="merge")):
        traj = prefix_merging(sess, config)
        check_invariants(sess, traj)
        assert sum(len(t.metadata["completion_ids"]) for t in traj.traces) == 3
    assert len(prefix_merging(sess, MergeConfig(on_rerender="merge")).traces) == 1


def test_openai_chat_tool_call_history_renders_like_the_engine(engine_proxy, qwen_tokenizer):
    """A finished tool round trip in the history, as a harness sends it back (compact JSON arguments): vLLM parses
    the arguments into an object before templating, so our rendering must do the same to get the same prompt."""
    c = chat_client(engine_proxy, "e-chat-history")
    call = {"id": "call_1", "type": "function", "function": {"name": "run_shell_command",
                                                             "arguments": '{"command":"ls -la"}'}}
    c.chat.completions.create(model="policy", max_tokens=3, tools=[SHELL], messages=[
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt\nb.txt"}])
    (rec,) = assert_faithful(engine_proxy, "e-chat-history", qwen_tokenizer, count=1)
    assert "<tool_response>\na.txt\nb.txt\n</tool_response>" in qwen_tokenizer.decode(rec["prompt_ids"])


def test_openai_chat_forced_tool_call_mirrors_the_engine(engine_proxy, qwen_tokenizer):
    """A named tool_choice makes vLLM constrain decoding to the tool's schema (thinking off, so the constraint is
    not spent inside <think>): whatever call the engine made, the SDK sees the same one."""
    c = chat_client(engine_proxy, "e-chat-forced")
    resp = c.chat.completions.create(
        model="policy", max_tokens=24, temperature=0, messages=[{"role": "user", "content": "Pick a mode."}],
        tools=[PICK], tool_choice={"type": "function", "function": {"name": "pick"}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    (rec,) = assert_faithful(engine_proxy, "e-chat-forced", qwen_tokenizer, count=1)
    raw = answer_of(engine_proxy)
    sent = engine_proxy.exchanges[-1].request
    assert sent["chat_template_kwargs"] == {"enable_thinking": False} and sent["tool_choice"]["function"] == {
        "name": "pick"}
    engine_calls = raw["choices"][0]["message"].get("tool_calls") or []
    sdk_calls = resp.choices[0].message.tool_calls or []
    assert [(t.function.name, t.function.arguments) for t in sdk_calls] == [
        (t["function"]["name"], t["function"]["arguments"]) for t in engine_calls]
    if engine_calls:
        assert resp.choices[0].finish_reason == "tool_calls" and rec["finish_reason"] == "tool_calls"
    # the template closed an empty think block in the prompt, as the engine rendered it
    assert qwen_tokenizer.decode(rec["prompt_ids"]).endswith("<think>\n\n</think>\n\n")


def test_engine_refusal_is_a_400_the_harness_can_read(engine_proxy):
    c = chat_client(engine_proxy, "e-chat-too-long")
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="policy", max_tokens=200_000,  # more than the model's context
                                  messages=[{"role": "user", "content": "hello"}])
    assert "refused" in info.value.message
    (call,) = engine_proxy.exchanges
    assert call.status == 400
    assert str(call.answer["error"]["message"])[:60] in info.value.message  # vLLM's own reason comes through
    (rec,) = records(engine_proxy, "e-chat-too-long")
    assert rec["status"] == "error" and not rec["token_faithful"] and rec["response_ids"] == []


# --- Anthropic Messages ---------------------------------------------------------------------------------------

def anthropic_client(proxy: Any, key: str) -> anthropic.Anthropic:
    client = anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0)
    _OPEN.append(client)
    return client


def test_anthropic_plain_and_stream(engine_proxy, qwen_tokenizer):
    c = anthropic_client(engine_proxy, "e-ant")
    msg = c.messages.create(model="claude-sonnet-4-5", max_tokens=6, system="You are terse.",
                            messages=[{"role": "user", "content": "Say hi"}])
    with c.messages.stream(model="claude-sonnet-4-5", max_tokens=5,
                           messages=[{"role": "user", "content": "Count"}]) as stream:
        final = stream.get_final_message()
    plain, streamed = assert_faithful(engine_proxy, "e-ant", qwen_tokenizer, count=2)
    assert plain["provider"] == streamed["provider"] == "anthropic"
    assert not plain["stream"] and streamed["stream"]
    assert msg.usage.input_tokens == len(plain["prompt_ids"])
    assert msg.usage.output_tokens == len(plain["response_ids"])
    assert final.usage.output_tokens == len(streamed["response_ids"])
    assert msg.stop_reason in ("end_turn", "max_tokens") and final.stop_reason in ("end_turn", "max_tokens")


def test_anthropic_tools_render_like_the_engine(engine_proxy, qwen_tokenizer):
    c = anthropic_client(engine_proxy, "e-ant-tools")
    with c.messages.stream(model="claude-sonnet-4-5", max_tokens=5, tools=[{
            "name": "Bash", "description": "Run a command",
            "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                             "required": ["command"]}}],
            messages=[{"role": "user", "content": "List files"}]) as stream:
        final = stream.get_final_message()
    (rec,) = assert_faithful(engine_proxy, "e-ant-tools", qwen_tokenizer, count=1)
    assert final.usage.output_tokens == len(rec["response_ids"])


# --- OpenAI Responses -----------------------------------------------------------------------------------------

def test_openai_responses_plain_and_stream(engine_proxy, qwen_tokenizer):
    c = chat_client(engine_proxy, "e-resp")
    resp = c.responses.create(model="gpt-5-codex", input="Say hi", instructions="Be terse.", max_output_tokens=16)
    # not the SDK's stream helper: it insists on response.completed, and 16 tokens of gibberish end incomplete
    events = list(c.responses.create(model="gpt-5-codex", input=[{"role": "developer", "content": "Use tools."},
                                                                 {"role": "user", "content": "List files"}],
                                     tools=[{"type": "function", "name": "shell", "description": "Run a command",
                                             "parameters": SHELL["function"]["parameters"]}],
                                     max_output_tokens=16, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    plain, streamed = assert_faithful(engine_proxy, "e-resp", qwen_tokenizer, count=2)
    assert plain["provider"] == "openai_responses" and streamed["stream"]
    assert resp.usage.input_tokens == len(plain["prompt_ids"])
    assert resp.usage.output_tokens == len(plain["response_ids"])
    assert final.usage.output_tokens == len(streamed["response_ids"])
    assert resp.status in ("completed", "incomplete") and final.status in ("completed", "incomplete")


# --- Google generateContent -----------------------------------------------------------------------------------

def test_google_plain_and_stream(engine_proxy, qwen_tokenizer):
    options = types.HttpOptions(base_url=engine_proxy.url, api_version="v1beta",
                                retry_options=types.HttpRetryOptions(attempts=1))
    c = genai.Client(api_key="e-google", http_options=options)
    _OPEN.append(c)
    config = types.GenerateContentConfig(system_instruction="Be terse.", max_output_tokens=6)
    resp = c.models.generate_content(model="gemini-2.5-pro", contents="Say hi", config=config)
    chunks = list(c.models.generate_content_stream(model="gemini-2.5-flash", contents="Count", config=config))
    plain, streamed = assert_faithful(engine_proxy, "e-google", qwen_tokenizer, count=2)
    assert plain["provider"] == "google" and streamed["stream"]
    assert resp.usage_metadata.prompt_token_count == len(plain["prompt_ids"])
    usage = [ch.usage_metadata for ch in chunks if ch.usage_metadata and ch.usage_metadata.prompt_token_count]
    assert usage and usage[-1].prompt_token_count == len(streamed["prompt_ids"])


def test_raw_http_generate_content_records_the_engines_tokens(engine_proxy, qwen_tokenizer):
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}], "generationConfig": {"maxOutputTokens": 4}}
    resp = httpx.post(f"{engine_proxy.url}/v1beta/models/gemini-2.5-pro:generateContent", json=body,
                      headers={"x-goog-api-key": "e-google-raw"}, timeout=60)
    assert resp.status_code == 200, resp.text
    (rec,) = assert_faithful(engine_proxy, "e-google-raw", qwen_tokenizer, count=1)
    assert json.loads(json.dumps(rec["request"])) == body
