"""Token-in prompts without sockets: the proxy (real app, real Qwen tokenizer and chat template) in front of a mock
vLLM ``/v1/completions`` that samples deliberately non-canonical tokenizations. Every prompt sent upstream must be
the chain's exact IDs plus the rendered suffix; an edited history starts a new chain labelled with its cause."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from polar_gym.proxy.app import create_app
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.tokenin import SGLangTokenInEngine, VLLMTokenInEngine
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.parsers.base import parser_for
from polar_gym.proxy.prefix import same_message
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.settings import (
    EngineSettings,
    build_engine,
    check_engine,
    configured_prompt_mode,
    describe_mode,
    mode_line,
    resolve_prompt_mode,
)
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.settings import ConfigError

EOT = 151645
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
CALL_TEXT = ('<think>\nlook first\n</think>\n\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n'
             '</tool_call>')


def drifted(tok: HFChatTokenizer, text: str) -> list[int]:
    """A non-canonical tokenization of ``text`` (cut in two pieces at odd places) plus the end-of-turn token."""
    ids: list[int] = []
    for start in range(0, len(text), 7):
        ids += tok.encode(text[start:start + 7])
    return [*ids, EOT]


class FakeCompletions:
    """vLLM's /v1/completions for token prompts: plays ``replies`` in order, each sampled as :func:`drifted`."""

    def __init__(self, tok: HFChatTokenizer, replies: list[str]) -> None:
        self.tok, self.replies, self.sent = tok, list(replies), []  # type: ignore[var-annotated]
        self.sampled: list[list[int]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert request.url.path == "/v1/completions"
        self.sent.append(body)
        text = self.replies.pop(0)
        ids = drifted(self.tok, text)
        if text.endswith("…"):  # cut at max_tokens: no end-of-turn token sampled
            ids = ids[:-1]
        self.sampled.append(ids)
        choice = {"index": 0, "text": text, "finish_reason": "stop", "prompt_token_ids": body["prompt"],
                  "token_ids": ids, "logprobs": {"token_logprobs": [-0.01 * (i + 1) for i in range(len(ids))],
                                                 "tokens": [], "top_logprobs": None, "text_offset": []}}
        return httpx.Response(200, json={"id": "cmpl", "object": "text_completion", "choices": [choice]})


def proxy(tok: HFChatTokenizer, replies: list[str]) -> tuple[FakeCompletions, ProxyService, httpx.AsyncClient]:
    fake = FakeCompletions(tok, replies)
    engine = VLLMTokenInEngine(tok, parser_for("qwen3"), UpstreamPool(["http://engine"]),
                               client=httpx.AsyncClient(transport=httpx.MockTransport(fake)), upstream_model="tiny")
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(create_app(service, "admin")), base_url="http://proxy")
    return fake, service, client


async def chat(client: httpx.AsyncClient, messages: list[dict[str, Any]]) -> dict[str, Any]:
    resp = await client.post("/v1/chat/completions", content=orjson.dumps(
        {"model": "claude-x", "messages": messages, "tools": TOOLS, "max_tokens": 64, "temperature": 0.7}),
        headers={"authorization": "Bearer s1", "content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    return dict(resp.json()["choices"][0]["message"])


async def test_each_prompt_is_the_chain_plus_the_rendered_suffix(tok: HFChatTokenizer) -> None:
    fake, service, client = proxy(tok, [CALL_TEXT, "All done.", "You are welcome."])
    history: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ls?"}]
    first = await chat(client, history)
    assert first["tool_calls"][0]["function"] == {"name": "bash", "arguments": '{"command": "ls"}'}
    assert first["reasoning_content"] == "look first"
    assert fake.sampled[0][:-1] != tok.encode(CALL_TEXT)  # the engine sampled a non-canonical tokenization
    # the harness drops the thinking from history, as Qwen3's template does for earlier turns
    history += [{"role": "assistant", "content": None, "tool_calls": first["tool_calls"]},
                {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "file.txt"}]
    await chat(client, history)
    chain = fake.sent[0]["prompt"] + fake.sampled[0]
    assert fake.sent[1]["prompt"][:len(chain)] == chain  # reused as sampled, never re-tokenized
    assert tok.decode(fake.sent[1]["prompt"][len(chain):]) == (
        "\n<|im_start|>user\n<tool_response>\nfile.txt\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    history += [{"role": "assistant", "content": "All done."}, {"role": "user", "content": "thanks"}]
    await chat(client, history)
    chain = fake.sent[1]["prompt"] + fake.sampled[1]
    assert fake.sent[2]["prompt"][:len(chain)] == chain
    assert tok.decode(fake.sent[2]["prompt"][len(chain):]) == (
        "\n<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n")
    # the request upstream: the served model, the request's sampling, stop at end of turn, token data back
    sent = fake.sent[2]
    assert sent["model"] == "tiny" and sent["max_tokens"] == 64 and sent["temperature"] == 0.7
    assert sent["return_token_ids"] is True and sent["logprobs"] == 0 and EOT in sent["stop_token_ids"]
    records = (await client.get("/sessions/s1/completions", headers={"authorization": "Bearer s1"})).json()
    recs = records["completions"]
    assert [r["prompt_mode"] for r in recs] == ["token_in"] * 3
    assert [r["response_ids"] for r in recs] == fake.sampled
    assert recs[0]["response_logprobs"][:2] == [-0.01, -0.02]
    assert [any(n.startswith("token_in_new_chain") for n in r["normalizations"]) for r in recs] == [True, False, False]
    assert service.engine.renderer.chain_count("s1") == 1  # type: ignore[attr-defined]


async def test_an_edited_history_starts_a_new_chain_with_its_cause(tok: HFChatTokenizer) -> None:
    fake, _, client = proxy(tok, ["Hello there.", "Again.", "Fresh."])
    history: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    await chat(client, history)
    edited = [*history, {"role": "assistant", "content": "Something I never said."}, {"role": "user", "content": "?"}]
    await chat(client, edited)
    assert fake.sent[1]["prompt"] == tok.render(edited, TOOLS)  # rendered whole, canonically
    await chat(client, [{"role": "user", "content": "another task"}])
    recs = (await client.get("/sessions/s1/completions", headers={"authorization": "Bearer s1"})).json()["completions"]
    causes = [[n for n in r["normalizations"] if n.startswith("token_in_new_chain")] for r in recs]
    assert causes == [["token_in_new_chain:new_context"], ["token_in_new_chain:history_edited"],
                      ["token_in_new_chain:new_context"]]


async def test_sglang_gets_input_ids_on_generate(tok: HFChatTokenizer) -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/generate"
        seen.append(json.loads(request.content))
        ids = drifted(tok, "Hi.")
        return httpx.Response(200, json={"text": "Hi.", "output_ids": ids, "meta_info": {
            "finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, t, None] for t in ids]}})

    engine = SGLangTokenInEngine(tok, parser_for("qwen3"), UpstreamPool(["http://engine"]),
                                 client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    from polar_gym.proxy.chat import ChatMessage, ChatRequest

    request = ChatRequest(model="m", messages=[ChatMessage(role="user", content="hi")], max_tokens=5)
    result = await engine.complete(request, "s")
    assert seen[0]["input_ids"] == result.prompt_ids == tok.render([{"role": "user", "content": "hi"}], None)
    assert seen[0]["sampling_params"]["max_new_tokens"] == 5 and result.message.content == "Hi."
    assert result.raw["prompt_mode"] == "token_in"


async def test_sglang_answers_cut_at_max_tokens_and_disagreeing_ids(tok: HFChatTokenizer) -> None:
    ids = tok.encode("ab")
    answer: dict[str, Any] = {"text": "ab", "output_ids": ids, "meta_info": {
        "finish_reason": {"type": "length", "length": len(ids)},
        "output_token_logprobs": [[-1.0 - i, t, None] for i, t in enumerate(ids)]}}
    engine = SGLangTokenInEngine(tok, parser_for("qwen3"), UpstreamPool(["http://engine"]), client=httpx.AsyncClient(
        transport=httpx.MockTransport(lambda _: httpx.Response(200, json=answer))))
    assert engine.end_of_turn_ids == tuple(tok.end_of_turn_ids)
    from polar_gym.proxy.chat import ChatMessage, ChatRequest
    from polar_gym.proxy.errors import UpstreamError

    request = ChatRequest(model="m", messages=[ChatMessage(role="user", content="hi")], max_tokens=len(ids))
    result = await engine.complete(request, "s")
    assert result.finish_reason == "length" and result.message.content == "ab" and result.response_ids == ids
    answer["output_ids"] = [*ids[:-1], ids[-1] + 1]
    with pytest.raises(UpstreamError, match="disagree"):
        await engine.complete(request, "s")


def test_assistant_turns_match_tolerating_dropped_thinking_and_whitespace() -> None:
    sampled = {"role": "assistant", "content": "ok", "reasoning_content": "hmm",
               "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    echoed = {"role": "assistant", "content": "ok\n",
              "tool_calls": [{"id": "b", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    assert same_message(echoed, sampled)
    assert not same_message({**echoed, "content": "other"}, sampled)
    assert not same_message({**echoed, "tool_calls": []}, sampled)
    assert not same_message({"role": "user", "content": "a"}, {"role": "user", "content": "a "})


def test_prompt_mode_defaults_and_refusals(tok: HFChatTokenizer, tmp_path: Path) -> None:
    vllm = {"engine": "vllm", "upstreams": ["http://x"]}
    # issue 41: null is token_in for vllm / sglang only when a tokenizer is set; the built one (tok) does not count
    assert resolve_prompt_mode(EngineSettings(**vllm)) == ("chat", None, None)
    assert resolve_prompt_mode(EngineSettings(engine="sglang", upstreams=["http://x"]))[0] == "chat"
    assert resolve_prompt_mode(EngineSettings(**vllm, tokenizer=str(tok.path))) == ("token_in", tok.path, "qwen3")
    assert resolve_prompt_mode(EngineSettings(engine="sglang", upstreams=["http://x"], tokenizer=str(tok.path)))[2] \
        == "qwen3"
    # an explicit token_in without a tokenizer takes the built Qwen one
    assert resolve_prompt_mode(EngineSettings(**vllm, prompt_mode="token_in")) == ("token_in", tok.path, "qwen3")
    assert resolve_prompt_mode(EngineSettings(**vllm, tokenizer=str(tok.path), prompt_mode="chat"))[0] == "chat"
    # ... but not for a model the Qwen tokenizer does not fit
    with pytest.raises(ConfigError) as err:
        check_engine(EngineSettings(**vllm, prompt_mode="token_in", upstream_model="meta-llama/Llama-3.1-8B"))
    assert err.value.problems[0][0] == "tokenizer" and "prompt_mode chat" in str(err.value)
    assert resolve_prompt_mode(EngineSettings(**vllm, upstream_model="meta-llama/Llama-3.1-8B"))[0] == "chat"
    assert resolve_prompt_mode(EngineSettings(engine="openai", upstreams=["http://x"]))[0] == "chat"
    with pytest.raises(ConfigError) as err:
        check_engine(EngineSettings(engine="openai", upstreams=["http://x"], prompt_mode="token_in"))
    assert err.value.problems[0][0] == "prompt_mode"
    other = tmp_path / "mistral-tokenizer"
    other.mkdir()
    with pytest.raises(ConfigError) as err:
        check_engine(EngineSettings(**vllm, tokenizer=str(other)))
    assert err.value.problems[0][0] == "parser"
    with pytest.raises(ConfigError) as err:
        check_engine(EngineSettings(**vllm, prompt_mode="token_in", parser="nope"))
    assert err.value.problems[0][0] == "parser"
    assert isinstance(build_engine(EngineSettings(**vllm, prompt_mode="token_in")), VLLMTokenInEngine)
    assert type(build_engine(EngineSettings(**vllm))) is VLLMEngine
    # sglang_generate: the name kept for sglang always fed token IDs
    assert isinstance(build_engine(EngineSettings(engine="sglang_generate", upstreams=["http://x"])),
                      SGLangTokenInEngine)
    for refused in (dict(prompt_mode="chat"), dict(upstream_model="meta-llama/Llama-3.1-8B")):
        with pytest.raises(ConfigError) as err:
            check_engine(EngineSettings(engine="sglang_generate", upstreams=["http://x"], **refused))
        assert err.value.problems[0][0] in ("prompt_mode", "tokenizer")


def test_a_built_tokenizer_in_the_cache_does_not_choose_the_mode(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 41: another job building the tokenizer must not switch a fleet to token_in; only the config does."""
    cache = tmp_path / "tokenizer-qwen3"
    cache.mkdir()
    monkeypatch.setattr("polar_gym.proxy.settings.tokenizer_dir", lambda: cache)
    vllm = {"engine": "vllm", "upstreams": ["http://x"]}
    with pytest.raises(ConfigError) as err:  # not built: an explicit token_in says the three ways out
        check_engine(EngineSettings(**vllm, prompt_mode="token_in"))
    message = str(err.value)
    assert err.value.problems[0][0] == "tokenizer" and str(cache) in message
    for way in ("bash scripts/setup.sh", "--tokenizer DIR", "--prompt-mode chat"):
        assert way in message, message
    before = resolve_prompt_mode(EngineSettings(**vllm))
    (cache / ".complete").touch()  # another job built it meanwhile
    assert before == resolve_prompt_mode(EngineSettings(**vllm)) == ("chat", None, None)
    assert resolve_prompt_mode(EngineSettings(engine="sglang", upstreams=["http://x"]))[0] == "chat"
    assert resolve_prompt_mode(EngineSettings(**vllm, prompt_mode="token_in")) == ("token_in", cache, "qwen3")
    assert configured_prompt_mode(EngineSettings(**vllm)) == "chat"
    assert configured_prompt_mode(EngineSettings(**vllm, tokenizer="/t")) == "token_in"
    assert configured_prompt_mode(EngineSettings(engine="sglang_generate")) == "token_in"
    assert configured_prompt_mode(EngineSettings()) == "token_in"  # the oracle
    assert configured_prompt_mode(EngineSettings(engine="openai", tokenizer="/t")) == "chat"


def test_the_first_log_line_says_the_mode_and_why(tmp_path: Path) -> None:
    settings = EngineSettings(engine="vllm", upstreams=["http://a:8000", "http://b:8000"], prompt_mode="token_in")
    line = mode_line("proxy", settings, "token_in", Path("/tok/qwen3"), "qwen3")
    assert line == ("polar_gym proxy: engine vllm, prompt mode token_in (tokenizer /tok/qwen3, parser qwen3), "
                    "upstreams http://a:8000, http://b:8000")
    chat = describe_mode(EngineSettings(engine="vllm", upstreams=["http://a:8000"]), "gateway")
    assert chat == ("polar_gym gateway: engine vllm, prompt mode chat (the engine renders the chat template; set "
                    "--tokenizer DIR for token_in: exact prefixes across turns), upstreams http://a:8000")
    waiting = describe_mode(EngineSettings(engine="openai", await_upstreams=True))
    assert waiting == ("polar_gym proxy: engine openai, prompt mode chat (the engine renders the chat template), "
                       "upstreams to come (await_upstreams)")
    assert "\n" not in line + chat + waiting


@pytest.mark.parametrize("short", [True, False])
async def test_suffix_only_and_whole_conversation_renders_give_the_same_prompt(tok: HFChatTokenizer,
                                                                               short: bool) -> None:
    """Rendering only the new messages (what the start-up probe allows for Qwen3) and cutting the whole
    conversation's rendering after the chain's end-of-turn markers send the same tokens."""
    fake, service, client = proxy(tok, [CALL_TEXT, "Two.", "Three."])
    renderer = service.engine.renderer  # type: ignore[attr-defined]
    assert renderer.short_suffix  # the probe found Qwen3's template renders new turns from local context
    renderer.short_suffix = short
    history: list[dict[str, Any]] = [{"role": "system", "content": "S"}, {"role": "user", "content": "go"}]
    first = await chat(client, history)
    history += [{"role": "assistant", "content": "", "tool_calls": first["tool_calls"]},
                {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "x"},
                {"role": "tool", "tool_call_id": "other", "content": "y"}]
    await chat(client, history)
    history += [{"role": "assistant", "content": "Two."}, {"role": "user", "content": "more"}]
    await chat(client, history)
    chain = fake.sent[1]["prompt"] + fake.sampled[1]
    assert tok.decode(fake.sent[2]["prompt"][len(chain):]) == (
        "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
    chain = fake.sent[0]["prompt"] + fake.sampled[0]
    assert tok.decode(fake.sent[1]["prompt"][len(chain):]) == (
        "\n<|im_start|>user\n<tool_response>\nx\n</tool_response>\n<tool_response>\ny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


async def test_anthropic_front_end_streams_a_token_in_tool_call(tok: HFChatTokenizer) -> None:
    """The answer of a token-in engine reaches every front end: an Anthropic stream carries the parsed tool call."""
    _, _, client = proxy(tok, [CALL_TEXT])
    resp = await client.post("/v1/messages", headers={"x-api-key": "s2", "content-type": "application/json"},
                             content=orjson.dumps({"model": "claude-x", "max_tokens": 64, "stream": True,
                                                   "messages": [{"role": "user", "content": "ls?"}],
                                                   "tools": [{"name": "bash", "description": "run", "input_schema": {
                                                       "type": "object", "properties": {
                                                           "command": {"type": "string"}}}}]}))
    assert resp.status_code == 200, resp.text
    assert '"tool_use"' in resp.text and '"name":"bash"' in resp.text.replace(" ", "")
    assert "ls" in resp.text and "input_json_delta" in resp.text
    recs = (await client.get("/sessions/s2/completions", headers={"x-api-key": "s2"})).json()["completions"]
    assert recs[0]["prompt_mode"] == "token_in" and recs[0]["provider"] == "anthropic"


async def test_a_turn_cut_at_max_tokens_is_closed_with_the_end_of_turn_token(tok: HFChatTokenizer) -> None:
    fake, _, client = proxy(tok, ["I was going to say…", "Ok."])
    history: list[dict[str, Any]] = [{"role": "user", "content": "talk"}]
    await chat(client, history)
    assert fake.sampled[0][-1] != EOT
    await chat(client, [*history, {"role": "assistant", "content": "I was going to say…"},
                        {"role": "user", "content": "go on"}])
    chain = fake.sent[0]["prompt"] + fake.sampled[0]
    assert fake.sent[1]["prompt"][:len(chain) + 1] == [*chain, EOT]
    assert tok.decode(fake.sent[1]["prompt"][len(chain) + 1:]) == (
        "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n")


async def test_a_retry_is_sent_exactly_the_tokens_of_the_first_attempt(tok: HFChatTokenizer) -> None:
    """The same messages again (a client retry, another sample of one context) get the earlier call's exact prompt,
    drifted tokens included, not a canonical re-rendering; the chain then goes on from either attempt."""
    fake, service, client = proxy(tok, ["First answer.", "Second.", "Retried.", "Third."])
    history: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
    await chat(client, history)
    history += [{"role": "assistant", "content": "First answer."}, {"role": "user", "content": "b"}]
    await chat(client, history)
    await chat(client, history)  # the retry
    assert fake.sent[2]["prompt"] == fake.sent[1]["prompt"]
    first_turn = fake.sent[0]["prompt"] + fake.sampled[0]  # drifted tokens: not re-tokenized for the retry
    assert fake.sent[2]["prompt"][:len(first_turn)] == first_turn
    await chat(client, [*history, {"role": "assistant", "content": "Retried."}, {"role": "user", "content": "c"}])
    chain = fake.sent[2]["prompt"] + fake.sampled[2]
    assert fake.sent[3]["prompt"][:len(chain)] == chain
    assert service.engine.renderer.chain_count("s1") == 1  # type: ignore[attr-defined]


async def test_an_unparseable_tool_call_is_answered_as_text_and_flagged_on_the_record(tok: HFChatTokenizer) -> None:
    broken = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"\n</tool_call>'
    _, _, client = proxy(tok, [broken, CALL_TEXT])
    message = await chat(client, [{"role": "user", "content": "ls?"}])
    assert not message.get("tool_calls") and '"command": "ls"' in message["content"]  # the harness sees the text
    ok = await chat(client, [{"role": "user", "content": "and again?"}])
    assert ok["tool_calls"][0]["function"]["name"] == "bash"
    recs = (await client.get("/sessions/s1/completions", headers={"authorization": "Bearer s1"})).json()["completions"]
    assert [r["unparseable_tool_calls"] for r in recs] == [1, 0]


async def test_a_large_new_turn_is_rendered_off_the_event_loop(tok: HFChatTokenizer) -> None:
    """A huge tool result would hold every session's calls if rendered inline: only small suffixes are."""
    from polar_gym.proxy.chat import ChatRequest
    from polar_gym.proxy.prefix import INLINE_SUFFIX_BYTES

    fake, service, client = proxy(tok, ["Ok.", "Fine.", "Done."])
    history: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    await chat(client, history)
    renderer = service.engine.renderer  # type: ignore[attr-defined]
    small = ChatRequest.model_validate({"model": "m", "tools": TOOLS, "messages": [
        *history, {"role": "assistant", "content": "Ok."}, {"role": "user", "content": "more"}]})
    big = ChatRequest.model_validate({"model": "m", "tools": TOOLS, "messages": [
        *history, {"role": "assistant", "content": "Ok."}, {"role": "user", "content": "x" * INLINE_SUFFIX_BYTES}]})
    assert renderer.plan_cheap(small, "s1") is not None
    assert renderer.plan_cheap(big, "s1") is None  # the caller renders it in a thread
    answer = await chat(client, big.model_dump(exclude_none=True)["messages"])
    assert answer["content"] == "Fine."
    assert fake.sent[1]["prompt"][:len(fake.sent[0]["prompt"])] == fake.sent[0]["prompt"]  # still the same chain
