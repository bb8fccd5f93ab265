"""Agent-shaped sessions through the proxy in token-in mode, end to end over loopback HTTP: the official SDKs (as
harnesses use them) -> the proxy -> VLLMTokenInEngine -> a vLLM-compatible upstream with the REAL Qwen tokenizer
that samples non-canonical tokenizations of its own text on 30 % of calls (``tests._drifting_vllm``) -> the capture
journal -> prefix_merging. The driver knows the ground truth (which answered call belongs to which conversation,
which attempts it abandoned or saw fail: ``tests.merge._agents.Ledger``); the builder, with the default
configuration and with ``on_rerender="merge"``, must give exactly one trace per conversation, every used completion
in exactly one trace (abandoned attempts superseded, failed ones excluded as errors), every mask-1 token sampled by
the engine with its logprob, NeMo RL's contiguity rule on every trace, and no ``drift`` break anywhere."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import atif
import httpx
import openai
import orjson
import pytest
from google import genai
from google.genai import types

from polar_gym.assets import tokenizer_dir
from polar_gym.merge import MergeConfig, check_contiguity, nemo_items
from polar_gym.merge.atif import atif_json
from polar_gym.merge.exports import sft_records, template_tool
from polar_gym.merge.prefix_merging import prefix_merging
from polar_gym.proxy import prefix
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.tokenin import VLLMTokenInEngine
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.parsers.base import parser_for
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.schema import CompletionSession, Trajectory
from tests._drifting_vllm import DriftingVLLM, drifting_vllm
from tests._serving import RunningProxy, serve
from tests._waiting import until_sync
from tests.merge._agents import AnthropicAgent, ChatAgent, GoogleAgent, Ledger, ResponsesAgent, tool_spec
from tests.merge._sessions import EOT, check_invariants, rec, session

pytestmark = pytest.mark.sdk

CONFIGS = {"break": MergeConfig(), "merge": MergeConfig(on_rerender="merge")}
#: how a new chain may start: never because a reply was re-rendered differently from what was sampled
ALLOWED_BREAKS = {"new_context", "compaction", "fork", "history_rewritten"}


@pytest.fixture(scope="module")
def tok() -> HFChatTokenizer:
    if not (tokenizer_dir() / ".complete").exists():
        pytest.skip("the Qwen tokenizer is not built (bash scripts/setup.sh)")
    return HFChatTokenizer(tokenizer_dir())


@pytest.fixture(scope="module")
def upstream(tok: HFChatTokenizer) -> Iterator[DriftingVLLM]:
    with drifting_vllm(tok) as served:
        yield served


@pytest.fixture
def proxy(tok: HFChatTokenizer, upstream: DriftingVLLM) -> Iterator[RunningProxy]:
    engine = VLLMTokenInEngine(tok, parser_for("qwen3"), UpstreamPool([upstream.url]), upstream_model=upstream.model,
                               client=httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0),
                                                        limits=httpx.Limits(max_keepalive_connections=0)))
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True))
    yield from serve(service)


@pytest.fixture
def chat_proxy(upstream: DriftingVLLM) -> Iterator[RunningProxy]:
    """The proxy in ``prompt_mode: chat`` on the same upstream (its /v1/chat/completions)."""
    engine = VLLMEngine(UpstreamPool([upstream.url]), httpx.AsyncClient(
        timeout=httpx.Timeout(120.0, connect=5.0), limits=httpx.Limits(max_keepalive_connections=0)),
        upstream_model=upstream.model)
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True))
    yield from serve(service)


def openai_client(proxy: RunningProxy, key: str, **options: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, **{"max_retries": 0, **options})


def anthropic_client(proxy: RunningProxy, key: str, max_retries: int = 0) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=max_retries)


def google_client(proxy: RunningProxy, key: str, stack: contextlib.ExitStack) -> genai.Client:
    options = types.HttpOptions(base_url=proxy.url, retry_options=types.HttpRetryOptions(attempts=1))
    client = genai.Client(api_key=key, http_options=options)
    stack.callback(client.close)
    return client


def captured(proxy: RunningProxy, key: str, ledger: Ledger) -> CompletionSession:
    """The session's journal once every call the driver made, abandoned ones included, is in it."""
    until_sync(lambda: len(proxy.completions(key)) == ledger.completions, timeout=60,
               what=f"{ledger.completions} journaled completions")
    return CompletionSession.model_validate({"session_id": key, "completions": proxy.completions(key)})


def check_session(sess: CompletionSession, ledger: Ledger, upstream: DriftingVLLM) -> dict[str, Any]:
    """Every property the issue asks of the builder, for both configurations; returns the counts for the report."""
    by_response = {r.response.get("id"): r for r in sess.completions if r.status == "ok"}
    conversation = {by_response[rid].completion_id: conv for rid, conv in ledger.conversation_of().items()}
    abandoned = {r.completion_id for r in sess.completions if r.status == "ok" and r.completion_id not in conversation}
    failed = [r.completion_id for r in sess.completions if r.status != "ok"]
    assert len(abandoned) == sum(ledger.abandoned.values())
    assert len(failed) == sum(ledger.failed.values())
    assert all(r.prompt_mode == "token_in" for r in sess.completions if r.status == "ok")
    # the proxy saw which answers reached their harness: a timed-out attempt's did not, every other one did
    assert {r.completion_id: r.delivered for r in sess.completions if r.status == "ok"} == {
        r.completion_id: r.completion_id not in abandoned for r in sess.completions if r.status == "ok"}

    # the journal holds exactly what the engine sampled (IDs and logprobs), for the prompt it was sent
    sampled = {(tuple(e.prompt_ids), tuple(e.token_ids)): e.logprobs for e in upstream.exchanges if e.status == 200}
    for r in sess.completions:
        if r.status == "ok":
            assert sampled[(tuple(r.prompt_ids), tuple(r.response_ids))] == r.response_logprobs
    # ... and the proxy sent each conversation one contiguous token sequence (NeMo RL's rule, on the records)
    records = {r.completion_id: r for r in sess.completions}
    ordered = {conv: [records[by_response[rid].completion_id] for rid in ids] for conv, ids in ledger.calls.items()}
    for chain in ordered.values():
        for earlier, later in itertools.pairwise(chain):
            seen = earlier.prompt_ids + earlier.response_ids
            assert later.prompt_ids[:len(seen)] == seen

    for name, config in CONFIGS.items():
        traj = prefix_merging(sess, config)
        check_invariants(sess, traj)
        check_builder(traj, conversation, ordered, abandoned, failed, name)
    drifted = [e for e in upstream.exchanges if e.status == 200
               and (tuple(e.prompt_ids), tuple(e.token_ids)) in {(tuple(r.prompt_ids), tuple(r.response_ids))
                                                                  for r in sess.completions if r.status == "ok"}]
    return {"conversations": len(ledger.calls), "completions": len(sess.completions),
            "used": len(conversation), "abandoned": len(abandoned), "failed": len(failed),
            "drifted": sum(e.drift for e in drifted)}


def check_builder(traj: Trajectory, conversation: dict[str, str], ordered: dict[str, list[Any]],
                  abandoned: set[str], failed: list[str], name: str) -> None:
    label = f"on_rerender={name}"
    who = [[conversation.get(c, "abandoned" if c in abandoned else "?") for c in t.metadata["completion_ids"]]
           for t in traj.traces]
    traces = {conversation.get(t.metadata["completion_ids"][0], "?"): t for t in traj.traces}
    assert len(traj.traces) == len(ordered) == len(traces), (label, who, traj.diagnostics)  # one per conversation
    for conv, trace in traces.items():
        # exactly that conversation's used completions, in its order
        assert trace.metadata["completion_ids"] == [r.completion_id for r in ordered[conv]], (label, conv)
        check_contiguity(nemo_items(trace))
    assert set(traj.diagnostics["superseded"]) == abandoned, label
    assert traj.diagnostics["excluded"] == ({"error": failed} if failed else {}), label
    assert set(traj.diagnostics["breaks"]) <= ALLOWED_BREAKS, (label, traj.diagnostics["breaks"])
    assert traj.diagnostics["rerender_merged"] == 0, label


def abandon_next_call(upstream: DriftingVLLM, ledger: Ledger, conversation: str, call: Callable[[], Any]) -> None:
    """``call`` times out on the client while the engine holds it (it runs on); once the engine has it, the caller
    sends the retry, then releases the held attempt (which is journaled last)."""
    held = upstream.held
    upstream.hold_next()
    with pytest.raises((openai.APITimeoutError, anthropic.APITimeoutError)):
        call()
    ledger.abandoned[conversation] += 1
    until_sync(lambda: upstream.held == held + 1, what="the abandoned attempt to reach the engine")


# -- the upstream -----------------------------------------------------------------------------------------------------
def test_the_upstream_speaks_vllm_and_refuses_text_prompts(upstream: DriftingVLLM, tok: HFChatTokenizer) -> None:
    models = httpx.get(upstream.url + "/v1/models").json()
    assert models["data"][0]["id"] == upstream.model and models["object"] == "list"
    for refused in ("hi", [], [1, "2"], [[1, 2]], [1.5]):
        resp = httpx.post(upstream.url + "/v1/completions", json={"model": upstream.model, "prompt": refused})
        assert resp.status_code == 400
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    prompt = tok.render([{"role": "system", "content": "You are probe."}, {"role": "user", "content": "1 step"}],
                        [{"type": "function", "function": tool_spec("Bash")}])
    body = httpx.post(upstream.url + "/v1/completions", json={"prompt": prompt, "return_token_ids": True}).json()
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == prompt and choice["token_ids"][-1] == tok.end_of_turn_ids[0]
    assert tok.decode(choice["token_ids"][:-1]) == choice["text"] and "<tool_call>" in choice["text"]
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    assert body["usage"]["completion_tokens"] == len(choice["token_ids"])


# -- the scenarios ----------------------------------------------------------------------------------------------------
def test_main_agent_with_many_tool_turns_drops_thinking(proxy: RunningProxy, upstream: DriftingVLLM) -> None:
    """(a) One Anthropic-style main agent: 16 tool turns then a follow-up task of 3 more, thinking on and dropped
    from the history it sends back, tool-use IDs its own, every other call streamed."""
    ledger = Ledger()
    with anthropic_client(proxy, "ses-main") as client:
        main = AnthropicAgent("main", ledger, "You are main-agent, a coder.", "Fix the bug: 16 steps.",
                              tool_spec("Bash"))
        main.run(client)
        main.say("Now add a test: 3 steps.")
        main.run(client)
    counts = check_session(captured(proxy, "ses-main", ledger), ledger, upstream)
    assert counts == {**counts, "conversations": 1, "completions": 21, "used": 21}
    assert counts["drifted"] >= 3


# -- more of what harnesses do ----------------------------------------------------------------------------------------
def test_parallel_sub_agents_from_the_same_first_prompt(proxy: RunningProxy, upstream: DriftingVLLM) -> None:
    """Two sub-agents launched at once from the same first prompt (parallel Task calls), each in its own thread,
    while the main agent waits; their calls interleave in the journal in whatever order the machine makes. They
    write no text before their tool calls: with text, a loaded machine that starts them more than 0.2 s apart hits
    the builder bug pinned below (test_parallel_sub_agents_started_a_moment_apart)."""
    ledger = Ledger()
    with anthropic_client(proxy, "ses-parallel") as client:
        def delegate(command: str) -> str:
            explorers = [AnthropicAgent(f"explorer{i}", ledger, "You are explorer-agent, read-only.",
                                        "Explore the repository layout quietly: 3 steps.", tool_spec("Glob"))
                         for i in range(2)]
            with ThreadPoolExecutor(2) as pool:
                return "\n".join(pool.map(lambda agent: agent.run(client), explorers))
        main = AnthropicAgent("main", ledger, "You are main-agent.", "Plan the change: 1 step.", tool_spec("Task"))
        main.run(client, delegate)
    counts = check_session(captured(proxy, "ses-parallel", ledger), ledger, upstream)
    assert counts == {**counts, "conversations": 3, "completions": 10, "used": 10}


def test_main_agent_and_sub_agent_calls_in_flight_together(proxy: RunningProxy, upstream: DriftingVLLM) -> None:
    """The main agent and a sub-agent each step in their own thread at the same time, round after round."""
    ledger = Ledger()
    with openai_client(proxy, "ses-concurrent") as client, ThreadPoolExecutor(2) as pool:
        main = ChatAgent("main", ledger, "You are main-agent.", "Port the module: 7 steps.", tool_spec("shell"))
        helper = ChatAgent("helper", ledger, "You are helper-agent.", "Find the callers: 5 steps.", tool_spec("grep"))
        while not (main.done and helper.done):
            list(pool.map(lambda agent: agent.step(client), [a for a in (main, helper) if not a.done]))
    counts = check_session(captured(proxy, "ses-concurrent", ledger), ledger, upstream)
    assert counts == {**counts, "conversations": 2, "completions": 14, "used": 14}


def test_thinking_sent_back_within_the_tool_loop(proxy: RunningProxy, upstream: DriftingVLLM) -> None:
    """A client that sends thinking blocks back (signature and all), as Claude Code does within a tool loop."""
    ledger = Ledger()
    with anthropic_client(proxy, "ses-keep-thinking") as client:
        main = AnthropicAgent("main", ledger, "You are main-agent.", "Fix the bug: 6 steps.", tool_spec("Bash"))
        main.keep_thinking = True
        main.run(client)
        main.say("And the docs: 2 steps.")
        main.run(client)
    counts = check_session(captured(proxy, "ses-keep-thinking", ledger), ledger, upstream)
    assert counts == {**counts, "conversations": 1, "completions": 10, "used": 10}


@pytest.mark.parametrize("cut_at", [20, 36])
def test_an_answer_cut_at_max_tokens_and_continued(proxy: RunningProxy, upstream: DriftingVLLM, cut_at: int) -> None:
    """One call's answer is cut at max_tokens (no end-of-turn token sampled), inside its thinking or inside its
    tool call (then answered as text); the harness keeps what it got and asks the model to go on."""
    ledger = Ledger()
    key = f"ses-cut-{cut_at}"
    with openai_client(proxy, key) as client:
        main = ChatAgent("main", ledger, "You are main-agent.", "Port the module: 4 steps.", tool_spec("shell"))
        main.step(client)
        main.max_tokens = cut_at
        main.step(client)
        assert main.done  # no tool call came through
        assert ("<tool_call>" in main.messages[-1]["content"]) is (cut_at > 20)
        main.max_tokens = 2048
        main.say("You were cut off. Go on: 2 steps.")
        main.run(client)
    counts = check_session(captured(proxy, key, ledger), ledger, upstream)
    assert counts == {**counts, "conversations": 1, "completions": 5, "used": 5}


# Was a builder bug (fixed): both first answers share their text but not their tool calls; the builder compared
# text only, so the first sub-agent's first answer was superseded as a retry.
def test_parallel_sub_agents_started_a_moment_apart(proxy: RunningProxy, upstream: DriftingVLLM) -> None:
    """Parallel sub-agents from one first prompt, the second launched a moment after the first (more than the 0.2 s
    the builder allows parallel twins) while the first one's first call still runs; that call answers first."""
    ledger = Ledger()
    with anthropic_client(proxy, "ses-staggered") as client, ThreadPoolExecutor(2) as pool:
        explorers = [AnthropicAgent(f"explorer{i}", ledger, "You are explorer-agent, read-only.",
                                    "Explore the repository layout: 3 steps.", tool_spec("Glob")) for i in range(2)]
        held = upstream.held
        gates = [upstream.hold_next()]
        runs = [pool.submit(explorers[0].run, client)]
        until_sync(lambda: upstream.held == held + 1, what="the first sub-agent's first call at the engine")
        apart = time.monotonic() + 0.3  # the scenario is defined by elapsed time: the second starts 0.3 s later
        until_sync(lambda: time.monotonic() >= apart, what="0.3 s")
        gates.append(upstream.hold_next())
        runs.append(pool.submit(explorers[1].run, client))
        until_sync(lambda: upstream.held == held + 2, what="the second sub-agent's first call at the engine")
        gates[0].set()
        until_sync(lambda: explorers[0].turns >= 1, what="the first sub-agent's first answer")
        gates[1].set()
        for run in runs:
            run.result()
    counts = check_session(captured(proxy, "ses-staggered", ledger), ledger, upstream)
    assert counts == {**counts, "conversations": 2, "completions": 8, "used": 8}


# Was a renderer limit (fixed): PrefixRenderer dropped the OLDEST of its MAX_NODES nodes first, a chain's latest
# node included, so a conversation idle while others made that many calls lost its chain.
def test_a_long_sub_agent_run_between_two_main_agent_turns(proxy: RunningProxy, upstream: DriftingVLLM,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The main agent waits on one tool call while a sub-agent makes more calls than the renderer keeps nodes per
    session (256; 16 here, so the test stays fast: the same mechanism)."""
    monkeypatch.setattr(prefix, "MAX_NODES", 16)
    ledger = Ledger()
    with openai_client(proxy, "ses-long-sub") as client:
        main = ChatAgent("main", ledger, "You are main-agent.", "Port the module: 3 steps.", tool_spec("shell"))
        helper = ChatAgent("helper", ledger, "You are helper-agent.", "Find every caller: 20 steps.",
                           tool_spec("grep"))
        main.step(client, lambda command: helper.run(client))
        main.run(client)
    counts = check_session(captured(proxy, "ses-long-sub", ledger), ledger, upstream)
    assert counts == {**counts, "conversations": 2, "completions": 25, "used": 25}


# Was a builder bug (fixed): two attempts at one turn whose answers share their text but not their tool calls; the
# abandoned one, journaled last, was taken as 'used' and trained as its own trace labelled 'fork'.
@pytest.mark.parametrize("held_turn_has_text", [False, True])
def test_retry_after_an_error_and_after_a_client_timeout(proxy: RunningProxy, upstream: DriftingVLLM,
                                                          held_turn_has_text: bool) -> None:
    """(b) The engine fails a call (the SDK retries it), and a call the client gives up on (timeout) is sent again
    while the first attempt is still running; the abandoned attempt finishes last. The model writes a line of text
    before every other tool call: with it, both attempts' answers have the same text and differ in the call only."""
    ledger = Ledger()
    key = f"ses-retry-{held_turn_has_text}"
    with openai_client(proxy, key, max_retries=2) as client:
        main = ChatAgent("main", ledger, "You are main-agent.", "Migrate the config: 8 steps.", tool_spec("shell"))
        for _ in range(2):
            main.step(client)
        upstream.fail_next()
        main.step(client)  # the SDK sees a 5xx and sends the same request again
        ledger.failed["main"] += 1
        while (main.turns % 2 == 0) is not held_turn_has_text:
            main.step(client)
        abandon_next_call(upstream, ledger, "main", lambda: main.ask(client.with_options(timeout=1.0, max_retries=0)))
        main.step(client)  # the retry, while the first attempt still runs
        upstream.release()
        main.run(client)
    counts = check_session(captured(proxy, key, ledger), ledger, upstream)
    assert counts == {**counts, "conversations": 1, "completions": 11, "used": 9, "abandoned": 1, "failed": 1}



def test_compaction_replaces_the_history_with_a_summary(proxy: RunningProxy, upstream: DriftingVLLM) -> None:
    """(c) An OpenAI Responses harness: 5 tool turns, a summary request on the whole history (it still extends the
    conversation), then the history replaced by the summary and the work continued: two conversations."""
    ledger = Ledger()
    with openai_client(proxy, "ses-compact") as client:
        system = "You are main-agent, a careful coder."
        before = ResponsesAgent("before", ledger, system, "Refactor the parser: 5 steps.", tool_spec("exec"))
        before.run(client)
        before.say("Summarize the conversation so far in one line.")
        summary = before.run(client)
        after = ResponsesAgent("after", ledger, system, f"{summary}\nContinue the refactor: 3 steps.",
                               tool_spec("exec"))
        after.run(client)
    counts = check_session(captured(proxy, "ses-compact", ledger), ledger, upstream)
    assert counts == {**counts, "conversations": 2, "completions": 11, "used": 11}


@pytest.mark.parametrize("sdk", ["openai_chat", "google"])
def test_sub_agent_interleaved_with_the_main_agent(proxy: RunningProxy, upstream: DriftingVLLM, sdk: str) -> None:
    """(d) A sub-agent with its own system prompt and tool calls between the main agent's turns (OpenAI Chat, and
    google-genai as Gemini CLI uses it)."""
    ledger = Ledger()
    key = f"ses-interleaved-{sdk}"
    make = ChatAgent if sdk == "openai_chat" else GoogleAgent
    with contextlib.ExitStack() as stack:
        client: Any = stack.enter_context(openai_client(proxy, key)) if sdk == "openai_chat" else google_client(
            proxy, key, stack)
        main = make("main", ledger, "You are main-agent.", "Port the module: 6 steps.", tool_spec("shell"))
        helper = make("helper", ledger, "You are helper-agent, who searches code.", "Find the callers: 4 steps.",
                      tool_spec("grep"))
        while not (main.done and helper.done):
            for agent in (main, helper):
                if not agent.done:
                    agent.step(client)
    counts = check_session(captured(proxy, key, ledger), ledger, upstream)
    assert counts == {**counts, "conversations": 2, "completions": 12, "used": 12}


def run_all_of_it(proxy: RunningProxy, upstream: DriftingVLLM, key: str) -> Ledger:
    """One Claude-Code-like run in one session: a main agent with many tool turns (thinking dropped, its own tool
    IDs), a helper sub-agent interleaved with its first turns, an engine error the SDK retries, a client timeout
    retried while the first attempt still runs, two sequential explorer sub-agents from the same first prompt, then
    compaction (a summary of the whole history, and the work continued from it)."""
    ledger = Ledger()
    with anthropic_client(proxy, key, max_retries=2) as client:
        explorers = iter(range(2))

        def results(command: str) -> str:
            if main.turns in (4, 8):  # the main agent's 4th and 8th tool calls delegate the same exploration
                explorer = AnthropicAgent(f"explorer{next(explorers)}", ledger, "You are explorer-agent, read-only.",
                                          "Explore the repository layout: 2 steps.", tool_spec("Glob"))
                return explorer.run(client)
            return f"ok: {command}"
        main = AnthropicAgent("main", ledger, "You are main-agent, a coder.", "Ship the feature: 10 steps.",
                              tool_spec("Bash"))
        helper = AnthropicAgent("helper", ledger, "You are helper-agent, who searches code.",
                                "Find the callers: 3 steps.", tool_spec("Grep"))
        while not main.done:
            if main.turns == 2:
                upstream.fail_next()
                ledger.failed["main"] += 1
            if main.turns == 5:
                abandon_next_call(upstream, ledger, "main",
                                  lambda: main.ask(client.with_options(timeout=1.0, max_retries=0)))
            main.step(client, results)
            upstream.release()
            if not helper.done:
                helper.step(client)
        main.say("Summarize the conversation so far in one line.")
        summary = main.run(client)
        AnthropicAgent("compacted", ledger, "You are main-agent, a coder.", f"{summary}\nContinue: 3 steps.",
                       tool_spec("Bash")).run(client)
    return ledger


def test_one_harness_session_with_all_of_it(proxy: RunningProxy, upstream: DriftingVLLM) -> None:
    ledger = run_all_of_it(proxy, upstream, "ses-all")
    sess = captured(proxy, "ses-all", ledger)
    counts = check_session(sess, ledger, upstream)
    assert counts == {**counts, "conversations": 5, "completions": 28, "used": 26, "abandoned": 1, "failed": 1}
    assert counts["drifted"] >= 0.2 * counts["used"]
    check_atif(sess, ledger)


def check_atif(sess: CompletionSession, ledger: Ledger) -> None:
    """The session as ATIF: the main agent is the root, the helper, both explorers and the compacted run are
    embedded chains, each explorer referenced from the main agent's call whose output is its answer; every used
    completion is an agent step with its exact tokens."""
    doc = atif.Trajectory.model_validate_json(orjson.dumps(atif_json(prefix_merging(sess))))
    subs = {s.trajectory_id: s for s in doc.subagent_trajectories or []}
    assert len(subs) == len(ledger.calls) - 1
    by_id = {r.completion_id: r for r in sess.completions}
    steps = [s for d in [doc, *subs.values()] for s in d.steps if s.metrics is not None and s.metrics.extra]
    assert len(steps) == sum(len(ids) for ids in ledger.calls.values())
    for step in steps:
        assert step.metrics is not None and step.metrics.extra is not None
        record = by_id[step.metrics.extra["completion_id"]]
        assert step.metrics.completion_token_ids == record.response_ids
        assert step.metrics.logprobs == record.response_logprobs
    delegated = [(r, ref) for step in doc.steps for r in (step.observation.results if step.observation else [])
                 for ref in r.subagent_trajectory_ref or []]
    assert sorted(ref.trajectory_id or "" for _, ref in delegated) == sorted(subs)
    explorers = [(result, subs[ref.trajectory_id or ""]) for result, ref in delegated
                 if "explorer-agent" in str(subs[ref.trajectory_id or ""].steps[0].message)]
    assert len(explorers) == 2
    for result, explorer in explorers:
        answer = explorer.steps[-1].message
        assert result.source_call_id is not None and isinstance(answer, str) and answer.strip() in str(result.content)


def test_the_same_session_in_chat_mode_breaks_at_drift(chat_proxy: RunningProxy, upstream: DriftingVLLM) -> None:
    """The contrast: the same run with ``prompt_mode: chat`` (vLLM renders and tokenizes the whole history on every
    call). Where the model sampled a non-canonical tokenization, or thought, the next prompt no longer extends what
    it sampled: the default builder starts new chains there, and merging joins them over a context the model never
    saw."""
    ledger = run_all_of_it(chat_proxy, upstream, "ses-all-chat")
    sess = captured(chat_proxy, "ses-all-chat", ledger)
    assert {r.prompt_mode for r in sess.completions if r.status == "ok"} == {"chat"}
    by_response = {r.response.get("id"): r for r in sess.completions if r.status == "ok"}
    not_extending = sum(later.prompt_ids[:len(earlier.prompt_ids + earlier.response_ids)]
                        != earlier.prompt_ids + earlier.response_ids
                        for ids in ledger.calls.values()
                        for earlier, later in itertools.pairwise([by_response[rid] for rid in ids]))
    assert not_extending > 0
    broken = prefix_merging(sess, CONFIGS["break"])
    check_invariants(sess, broken)
    assert len(broken.traces) > len(ledger.calls)
    assert {"drift", "thinking_dropped"} & set(broken.diagnostics["breaks"]), broken.diagnostics["breaks"]
    assert prefix_merging(sess, CONFIGS["merge"]).diagnostics["rerender_merged"] > 0


@pytest.mark.parametrize("explorer_steps", [2, 0])
def test_two_sequential_sub_agents_from_the_same_first_prompt(proxy: RunningProxy, upstream: DriftingVLLM,
                                                              explorer_steps: int) -> None:
    """(e) The main agent delegates the same task twice (Claude Code's Task tool): the second sub-agent starts from
    exactly the first one's first prompt, after the first one finished; they diverge from their first answer on.
    With no tool step, each sub-agent is one call."""
    ledger = Ledger()
    key = f"ses-twins-{explorer_steps}"
    with anthropic_client(proxy, key) as client:
        runs = iter(range(2))

        def delegate(command: str) -> str:
            explorer = AnthropicAgent(f"explorer{next(runs)}", ledger, "You are explorer-agent, read-only.",
                                      f"Explore the repository layout: {explorer_steps} steps.", tool_spec("Glob"))
            return explorer.run(client)
        main = AnthropicAgent("main", ledger, "You are main-agent.", "Plan the change: 2 steps.", tool_spec("Task"))
        main.run(client, delegate)
    counts = check_session(captured(proxy, key, ledger), ledger, upstream)
    calls = 3 + 2 * (explorer_steps + 1)
    assert counts == {**counts, "conversations": 3, "completions": calls, "used": calls}


def test_minimal_repro_of_the_abandoned_attempt_with_the_same_text() -> None:
    """The bug above without a proxy: attempt A times out on the client and still runs; B (same prompt, same text,
    another tool call) answers; A is journaled after B; the next call goes on from B (its messages and tokens)."""
    def answer(command: str) -> dict[str, Any]:
        return {"role": "assistant", "content": "Step 2: checking.", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "sh", "arguments": f'{{"command": "{command}"}}'}}]}
    asked = [{"role": "user", "content": "go"}]
    prompt = [1, 2, 3]
    b = rec(1, prompt, [30, 31, EOT], messages=asked, started=11.0, seconds=0.5)
    a = rec(2, prompt, [20, 21, EOT], messages=asked, started=10.0, seconds=5.0)
    b.response, a.response = {"message": answer("b")}, {"message": answer("a")}
    later = rec(3, [*prompt, 30, 31, EOT, 7, 8], [40, EOT], started=16.0,
                messages=[*asked, answer("b"), {"role": "tool", "tool_call_id": "c", "content": "ok"}])
    sess = session(b, a, later)
    traj = prefix_merging(sess, MergeConfig(end_of_turn_ids=(EOT,)))
    check_invariants(sess, traj)
    assert traj.diagnostics["superseded"] == ["c2"]
    assert [t.metadata["completion_ids"] for t in traj.traces] == [["c1", "c3"]]


def test_sft_records_render_the_prompt_the_policy_is_sampled_with(proxy: RunningProxy, upstream: DriftingVLLM) -> None:
    """datagen's SFT records (messages + tools), rendered by the chat template as the trainer does, give exactly the
    prompt ids the proxy sent the engine, although the harness's tools carry a field the template never sees (pi's
    ``"strict": false``: kept in the records, the SFT prompt was 16 tokens off the rollout prompt)."""
    from transformers import AutoTokenizer

    from polar_gym.trainer.sft_data import sequence_of_record

    ledger = Ledger()
    tool = {**tool_spec("bash"), "strict": False}
    with openai_client(proxy, "ses-sft", max_retries=0) as client:
        ChatAgent("main", ledger, "You are main-agent.", "Fix it: 2 steps.", tool).run(client)
    sess = captured(proxy, "ses-sft", ledger)
    assert sess.completions[0].normalized_request["tools"][0]["function"]["strict"] is False  # as the harness sent
    (record,) = sft_records(prefix_merging(sess))
    assert record.tools == [template_tool(tool)] and "strict" not in record.tools[0]["function"]
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir()), local_files_only=True)
    # up to the first answer (Qwen3's template adds an empty think block to the last assistant turn only, so a
    # record whose earlier answers have no reasoning is skipped as re-rendered; the prompt is what matters here)
    first = {**record.model_dump(), "messages": record.messages[:3]}
    assert sequence_of_record(first, hf).prompt_ids == sess.completions[0].prompt_ids
    # an export older than the fix (strict kept) is read the same way
    old = {**first, "tools": [{"type": "function", "function": tool}]}
    assert sequence_of_record(old, hf).prompt_ids == sess.completions[0].prompt_ids
