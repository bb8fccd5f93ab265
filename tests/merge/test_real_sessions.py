"""Sessions captured for real by the proxy (oracle engine, real Qwen tokenizer), driven like a harness drives
them through official SDKs, then merged: one exact chain per agent, token-identical to what the engine saw.

The oracle runs token_in (its default: the proxy sends exact prefix IDs, as with vLLM and SGLang), so non-canonical
sampling and thinking the template drops never break a chain; the chat-mode tests show what they do without it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.merge import MergeConfig, check_contiguity, nemo_items
from polar_gym.merge.per_request import per_request
from polar_gym.merge.prefix_merging import prefix_merging
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.schema import CompletionSession, OracleScript
from tests._serving import RunningProxy, oracle_service, serve
from tests.merge._sessions import check_invariants

SCRIPT = OracleScript(commands=["mkdir -p src", "echo 'print(1)' > src/main.py", "python3 src/main.py"],
                      final_answer="Finished.")
CFG = MergeConfig()  # Qwen end-of-turn tokens


@pytest.fixture(scope="module")
def qwen():
    from polar_gym.proxy.tokenizer import HFChatTokenizer

    if not (tokenizer_dir() / ".complete").exists():
        pytest.fail("the Qwen tokenizer asset is missing: run `bash scripts/setup.sh`")
    return HFChatTokenizer(tokenizer_dir())


def live(tmp_path: Path, qwen, **engine_kw) -> Iterator[RunningProxy]:
    engine = OracleEngine(qwen, default_script=SCRIPT, **engine_kw)
    yield from serve(oracle_service(tmp_path / "capture", engine=engine))


@pytest.fixture
def proxy(tmp_path: Path, qwen) -> Iterator[RunningProxy]:
    yield from live(tmp_path, qwen)


def chat_agent(proxy: RunningProxy, key: str) -> int:
    """A Chat-Completions harness loop: call, run the tool (pretend), send the result back, until a text answer."""
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)
    tools = [{"type": "function", "function": {"name": "bash", "description": "Run a command", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
    messages: list[dict] = [{"role": "system", "content": "You are a careful engineer."},
                            {"role": "user", "content": "Create and run src/main.py."}]
    for turn in range(10):
        with client.chat.completions.stream(model="policy", messages=messages, tools=tools) as stream:
            reply = stream.get_final_completion().choices[0].message
        messages.append(reply.model_dump(exclude_none=True, exclude={"parsed", "refusal", "annotations", "audio"}))
        if not reply.tool_calls:
            return turn + 1
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"ok: {call.function.arguments}"})
    raise AssertionError("the oracle never finished")


def anthropic_agent(proxy: RunningProxy, key: str) -> int:
    client = anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0)
    tools = [{"name": "Bash", "description": "Run a command", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}]
    messages: list[dict] = [{"role": "user", "content": "Create and run src/main.py."}]
    for turn in range(10):
        with client.messages.stream(model="claude-sonnet-4-5", max_tokens=2000, system="You are careful.",
                                    messages=messages, tools=tools,
                                    thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
            message = stream.get_final_message()
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        uses = [b for b in message.content if b.type == "tool_use"]
        if not uses:
            return turn + 1
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": f"ok: {json.dumps(b.input)}"} for b in uses]})
    raise AssertionError("the oracle never finished")


def captured(proxy: RunningProxy, key: str) -> CompletionSession:
    return CompletionSession.model_validate({"session_id": key, "completions": proxy.completions(key)})


@pytest.mark.parametrize("agent", [chat_agent, anthropic_agent])
def test_a_real_tool_loop_merges_into_one_exact_chain(proxy, agent):
    calls = agent(proxy, "real-loop")
    assert calls == len(SCRIPT.commands) + 1
    sess = captured(proxy, "real-loop")
    traj = prefix_merging(sess, CFG)
    check_invariants(sess, traj)
    (trace,) = traj.traces
    assert traj.diagnostics["breaks"] == {} and traj.diagnostics["completions_merged"] == calls - 1
    last = sess.completions[-1]
    # token-identical to what the engine saw and sampled on the last call
    assert trace.prompt_ids + trace.response_ids == last.prompt_ids + last.response_ids
    for span, rec in zip(trace.metadata["spans"], sess.completions, strict=True):
        assert trace.prompt_ids + trace.response_ids[:span["start"]] == rec.prompt_ids
    check_contiguity(nemo_items(trace))
    assert len(per_request(sess, CFG).traces) == calls


def exact_chain(sess: CompletionSession, trace) -> None:
    """``trace`` is token-identical to what the engine saw on each of its calls, and NeMo RL's contiguity holds."""
    by_id = {r.completion_id: r for r in sess.completions}
    for span in trace.metadata["spans"]:
        assert trace.prompt_ids + trace.response_ids[:span["start"]] == by_id[span["completion_id"]].prompt_ids
    check_contiguity(nemo_items(trace))


def drifted(qwen, sess: CompletionSession) -> int:
    """How many calls sampled a non-canonical tokenization of their own text."""
    return sum(1 for r in sess.completions if qwen.encode(qwen.decode(r.response_ids)) != r.response_ids)


@pytest.mark.parametrize("agent", [chat_agent, anthropic_agent])
def test_token_in_keeps_one_chain_whatever_the_oracle_samples(tmp_path, qwen, agent):
    """Every second call samples non-canonical tokens: token_in reuses them as they are, so one chain, no break."""
    for proxy in live(tmp_path, qwen, drift_every=2):
        calls = agent(proxy, "drifting")
        sess = captured(proxy, "drifting")
    assert drifted(qwen, sess) >= 1
    assert {r.prompt_mode for r in sess.completions} == {"token_in"}
    assert [n for r in sess.completions for n in r.normalizations if n.startswith("token_in_new_chain")] == [
        "token_in_new_chain:new_context"]  # the first call only
    traj = prefix_merging(sess, CFG)
    check_invariants(sess, traj)
    (trace,) = traj.traces
    assert traj.diagnostics["breaks"] == {} and len(trace.metadata["completion_ids"]) == calls
    exact_chain(sess, trace)


def test_drift_from_non_canonical_sampling_breaks_without_losing_anything(tmp_path, qwen):
    """In chat mode the engine renders the history again: a drifted reply re-renders canonically, a new chain."""
    for proxy in live(tmp_path, qwen, drift_every=2, prompt_mode="chat"):
        calls = chat_agent(proxy, "drifting")
        sess = captured(proxy, "drifting")
    assert {r.prompt_mode for r in sess.completions} == {"chat"}
    traj = prefix_merging(sess, CFG)
    check_invariants(sess, traj)
    assert traj.diagnostics["breaks"].get("drift", 0) >= 1
    assert sum(len(t.metadata["completion_ids"]) for t in traj.traces) == calls
    merged = prefix_merging(sess, MergeConfig(on_rerender="merge"))
    check_invariants(sess, merged)
    assert len(merged.traces) == 1 and merged.diagnostics["rerender_merged"] >= 1


def test_a_sub_agent_interleaved_with_the_main_agent(proxy):
    """Two agents of one session (main and a sub-agent with its own system prompt) calling in turn."""
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="two-agents", max_retries=0)
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
    convs = {"main": [{"role": "system", "content": "Main agent."}, {"role": "user", "content": "Do it."}],
             "sub": [{"role": "system", "content": "Explore sub-agent."}, {"role": "user", "content": "Look."}]}
    for _ in range(3):
        for conv in convs.values():
            reply = client.chat.completions.create(model="policy", messages=conv, tools=tools).choices[0].message
            conv.append(reply.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"}))
            for call in reply.tool_calls or []:
                conv.append({"role": "tool", "tool_call_id": call.id, "content": "ok"})
    sess = captured(proxy, "two-agents")
    traj = prefix_merging(sess, CFG)
    check_invariants(sess, traj)
    assert [len(t.metadata["completion_ids"]) for t in traj.traces] == [3, 3]
    assert traj.diagnostics["breaks"] == {"new_context": 1}


def two_user_turns(proxy: RunningProxy, key: str) -> int:
    """A tool loop, then the user asks again in the same conversation (Qwen3's template drops the first loop's
    thinking from the history once a new user turn follows)."""
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
    messages: list[dict] = [{"role": "user", "content": "Do it."}]
    calls = 0
    for ask in ("Do it.", "And again."):
        if calls:
            messages.append({"role": "user", "content": ask})
        while True:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=tools).choices[0].message
            calls += 1
            messages.append(reply.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"}))
            if not reply.tool_calls:
                break
            for call in reply.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "ok"})
    return calls


@pytest.mark.parametrize(("mode", "traces"), [("token_in", 1), ("chat", 2)])
def test_thinking_the_template_drops_breaks_only_chat_mode(tmp_path, qwen, mode, traces):
    for proxy in live(tmp_path, qwen, prompt_mode=mode):
        calls = two_user_turns(proxy, "two-turns")
        sess = captured(proxy, "two-turns")
    traj = prefix_merging(sess, CFG)
    check_invariants(sess, traj)
    assert len(traj.traces) == traces and sum(len(t.metadata["completion_ids"]) for t in traj.traces) == calls
    for trace in traj.traces:
        exact_chain(sess, trace)
