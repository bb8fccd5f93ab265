"""The gateway with vLLM's CPU build behind it (tiny random Qwen3, real tokenizer): real harness CLIs run sessions
in the local sandbox; every recorded completion carries exactly the token IDs and logprobs the engine returned, and
the traces train only those sampled tokens.

In token_in mode (the proxy sends exact prefix token IDs) every harness runs at once, their first shell calls
sampled by the engine under a regex (structured outputs: random weights never write a well-formed tool call on their
own), so each harness's real tool loop runs: prefix_merging gives one trace per conversation, counted from the
request messages alone, and every trace passes NeMo RL's contiguity check."""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar_gym.merge import MergeConfig
from polar_gym.merge.exports import check_contiguity, nemo_items
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.parsers.base import parser_for
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.schema import BuilderSpec, CompletionRecord, CompletionSession, EvaluatorSpec, RuntimeSpec, SessionSpec
from polar_gym.tasks import demo_task
from tests._serving import served_gateway
from tests.engine._engine_kit import RecordingTransport, ToolSteeredEngine, count_conversations, message_key
from tests.merge._sessions import check_invariants

pytestmark = pytest.mark.engine

HARNESSES = ["claude_code", "codex", "qwen_code", "gemini_cli", "opencode", "pi"]
#: the harnesses added since (issue 39): in the token-in run too
MORE_HARNESSES = ["mini_swe_agent", "aider", "hermes", "openhands", "cline", "openclaw"]


#: side requests (titles, summaries) are trained, each as a conversation of its own, and counted so
BUILDER = BuilderSpec(strategy="prefix_merging", config={"include_side_requests": True})


def session_for(harness: str) -> SessionSpec:
    request = demo_task("demo-calc-add").to_request(
        harness=harness, runtime=RuntimeSpec(backend="local", network="gateway", workdir="/workspace"),
        builder=BUILDER, evaluator=EvaluatorSpec(strategy="session_completed"),
        timeout_seconds=300)
    return SessionSpec.from_task(request, 0)


def engine_answers(transport: RecordingTransport, prompt_mode: str) -> dict[tuple[tuple[int, ...], tuple[int, ...]],
                                                                          list[float]]:
    """(prompt IDs, sampled IDs) -> logprobs of every answer the engine gave, read from the raw wire."""
    answers = {}
    for x in transport.exchanges:
        if x.status != 200:
            continue
        choice = x.answer["choices"][0]
        if prompt_mode == "chat":
            answers[(tuple(x.answer["prompt_token_ids"]), tuple(choice["token_ids"]))] = [
                c["logprob"] for c in choice["logprobs"]["content"]]
        else:
            assert x.path == "/v1/completions" and x.request["prompt"] == choice["prompt_token_ids"]
            answers[(tuple(choice["prompt_token_ids"]), tuple(choice["token_ids"]))] = choice["logprobs"][
                "token_logprobs"]
    return answers


def assert_engines_tokens(records: list[CompletionRecord], answers: dict[Any, list[float]], harness: str) -> None:
    for rec in records:
        assert rec.status == "ok" and rec.token_faithful and rec.engine == "vllm", (harness, rec.error)
        key = (tuple(rec.prompt_ids), tuple(rec.response_ids))
        assert key in answers, "recorded tokens are exactly an answer the engine gave"
        assert rec.response_logprobs == answers[key]


def _say(line: str) -> None:
    print(f"[gateway-vllm] {line}", file=sys.__stderr__, flush=True)  # past pytest's capture: the numbers to report


async def test_real_harnesses_in_chat_mode_record_the_engines_tokens(vllm_server, tmp_path: Path) -> None:
    """Chat mode (vLLM renders the messages itself): the recorded tokens are still exactly the engine's."""
    transport = RecordingTransport()
    client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(120.0, connect=5.0))
    engine = VLLMEngine(UpstreamPool([vllm_server.url]), client=client, upstream_model=vllm_server.model)
    # random weights rarely stop: cap every call so a session takes seconds
    service = ProxyService(engine, CaptureJournal(tmp_path / "capture"), SessionRegistry(allow_adhoc=False),
                           max_tokens_cap=24)
    specs = [session_for(harness) for harness in ("pi", "qwen_code")]
    async with served_gateway(service, tmp_path / "gateway", run_slots=2) as node:
        results = await asyncio.wait_for(node.run(specs), 600)
    answers = engine_answers(transport, "chat")
    for spec, result in zip(specs, results, strict=True):
        records = await service.journal.records(spec.session_id)
        assert records, (spec.agent.harness, result.status, result.reason)
        assert_engines_tokens(records, answers, spec.agent.harness)
        assert all(rec.prompt_mode == "chat" for rec in records)
        assert result.trajectory is not None
        check_invariants(CompletionSession(session_id=spec.session_id, completions=records), result.trajectory)
    await client.aclose()
    service.journal.close()


def drops_a_cut_reply(rec: CompletionRecord, records: list[CompletionRecord]) -> bool:
    """Whether ``rec`` asks again after dropping a reply cut at max_tokens: its messages extend an earlier call's,
    which ended ``length``, without that call's reply (mini-swe-agent replaces a cut reply with a note to be brief,
    by design: a new conversation, not a broken one)."""
    sent = [message_key(m) for m in rec.normalized_request["messages"]]
    for earlier in records:
        before = [message_key(m) for m in earlier.normalized_request["messages"]]
        reply = message_key({"role": "assistant", **(earlier.response.get("message") or {})})
        if (earlier.index < rec.index and earlier.finish_reason == "length" and len(before) < len(sent)
                and sent[:len(before)] == before and sent[len(before)] != reply):
            return True
    return False


async def test_every_real_harness_in_token_in_mode_gives_one_contiguous_chain_per_conversation(
        vllm_server, tmp_path: Path) -> None:
    transport = RecordingTransport()
    client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(120.0, connect=5.0))
    engine = ToolSteeredEngine(HFChatTokenizer(vllm_server.tokenizer_dir), parser_for("qwen3"),
                               UpstreamPool([vllm_server.url]), client=client, upstream_model=vllm_server.model)
    # free replies are random text that never stops: capped short; steered shell calls get room for their block
    service = ProxyService(engine, CaptureJournal(tmp_path / "capture"), SessionRegistry(allow_adhoc=False),
                           max_tokens_cap=24)
    specs = [session_for(harness) for harness in [*HARNESSES, *MORE_HARNESSES]]
    started = time.monotonic()
    async with served_gateway(service, tmp_path / "gateway", init_workers=3, ready_buffer=3, run_slots=6,
                              postrun_workers=3) as node:
        results = await asyncio.wait_for(node.run(specs), 900)
    _say(f"{len(specs)} harnesses in {time.monotonic() - started:.1f} s")
    answers = engine_answers(transport, "token_in")
    assert MergeConfig.from_dict(BUILDER.config).include_side_requests  # so every call is counted below
    failures: dict[str, Any] = {}
    for spec, result in zip(specs, results, strict=True):
        harness = spec.agent.harness
        records = await service.journal.records(spec.session_id)
        assert records, (harness, result.status, result.reason)
        assert_engines_tokens(records, answers, harness)
        assert all(rec.prompt_mode == "token_in" for rec in records), harness
        trajectory = result.trajectory
        assert trajectory is not None and trajectory.builder == "prefix_merging", (harness, result.reason)
        session = CompletionSession(session_id=spec.session_id, completions=records)
        check_invariants(session, trajectory)
        for trace in trajectory.traces:
            check_contiguity(nemo_items(trace))  # NeMo RL's rule, on every trace: raises on the first gap
        usable = [r for r in records if r.response_ids]
        count = count_conversations(usable)
        sampled_calls = sum(bool((r.response.get("message") or {}).get("tool_calls")) for r in records)
        unparseable = sum(r.unparseable_tool_calls for r in records)
        new_chains = Counter(n.split(":", 1)[1] for r in records for n in r.normalizations
                             if n.startswith("token_in_new_chain:"))
        _say(f"{harness}: status={result.status.value} session={result.timings.get('total', 0):.1f}s "
             f"calls={len(records)} "
             f"side={sum(r.side_request for r in records)} conversations={count.conversations} "
             f"(roots={count.roots} edited={count.edited} branches={count.branches} forks={count.forks}) "
             f"traces={len(trajectory.traces)} breaks={trajectory.diagnostics.get('breaks')} "
             f"superseded={len(trajectory.diagnostics.get('superseded') or [])} proxy_new_chains={dict(new_chains)} "
             f"steered={engine.steered.get(spec.session_id, 0)} tool_calls_sampled={sampled_calls} "
             f"cut={engine.cut.get(spec.session_id, 0)} unparseable={unparseable}")
        # a malformed block (the cut call) is answered as text and counted on the record
        for rec in records:
            message = rec.response.get("message") or {}
            if "<tool_call>" in str(message.get("content") or ""):
                assert rec.unparseable_tool_calls >= 1 and not message.get("tool_calls"), (harness, rec.index)
        assert unparseable == engine.cut.get(spec.session_id, 0), harness
        # a harness edits its history only when something went wrong (e.g. two tool uses with one id: Claude Code
        # interrupts the second and every later call re-branches from the first); side requests may branch
        if (len(trajectory.traces) != count.conversations or count.edited
                or any(not r.side_request and not drops_a_cut_reply(r, records) for r in count.branch_calls)):
            failures[harness] = (len(trajectory.traces), count, trajectory.diagnostics.get("breaks"))
        if engine.steered.get(spec.session_id):
            assert sampled_calls >= 1, f"{harness}: the engine sampled the steered shell call"
    assert failures == {}, "chains == conversations, and no harness edited or re-branched its history"
    await client.aclose()
    service.journal.close()
