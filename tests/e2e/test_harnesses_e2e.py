"""End to end with real, unmodified harness CLIs: the gateway (oracle engine with the real Qwen tokenizer) runs each
of the six pinned CLIs in the local sandbox with nothing but the gateway reachable, on a demo task whose test fails.
The oracle plays the reference solution through the harness's own shell tool; the evaluator runs the task's tests.
Every session must reach reward 1.0, merge into fewer traces than per_request, hold the fidelity invariant, and export
to ATIF documents the `atif` package validates (through the gateway's route and the merge CLI).
With drift (non-canonical sampled tokens every second call) the oracle's token_in prompts must still give one
contiguous chain per conversation, conversations counted from the captured messages, not by the builder."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import atif
import httpx
import pytest
import pytest_asyncio

from polar_gym.assets import tokenizer_dir
from polar_gym.gateway import GatewayNode
from polar_gym.harness.install import cli_paths, install_dir
from polar_gym.merge import MergeConfig, check_contiguity, nemo_items
from polar_gym.merge.cli import main as merge_main
from polar_gym.merge.per_request import per_request
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.chat import ChatRequest, ChatResult
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.schema import (
    BuilderSpec,
    CompletionRecord,
    CompletionSession,
    RuntimeSpec,
    SessionResult,
    SessionSpec,
    SessionStatus,
)
from polar_gym.tasks import demo_task
from tests._procs import processes_with
from tests._serving import ADMIN, served_gateway
from tests._waiting import until
from tests.merge._sessions import check_invariants

if TYPE_CHECKING:
    from polar_gym.proxy.tokenizer import ChatTokenizer

pytestmark = [pytest.mark.harness, pytest.mark.slow]

HARNESSES = ["claude_code", "codex", "qwen_code", "gemini_cli", "opencode", "pi"]


class SlowOracle(OracleEngine):
    """The oracle, answering each call only after ``delay`` seconds (a long generation on a real engine)."""

    def __init__(self, tokenizer: ChatTokenizer, delay: float, **engine_kw: Any) -> None:
        super().__init__(tokenizer, **engine_kw)
        self.delay = delay

    async def complete(self, request: ChatRequest, session_id: str) -> ChatResult:
        await asyncio.sleep(self.delay)
        return await super().complete(request, session_id)


@contextlib.asynccontextmanager
async def oracle_gateway(tmp_path: Path, *, run_slots: int = 2, answer_delay: float = 0.0,
                         **engine_kw: Any) -> AsyncIterator[tuple[GatewayNode, ProxyService]]:
    """A gateway whose proxy plays the oracle (real Qwen tokenizer) for real harness CLIs. ``answer_delay``: each call
    is answered after that many seconds, and a streamed answer starts with keepalive bytes after 0.05 s (an engine
    slower than the proxy's keepalive delay)."""
    from polar_gym.proxy.tokenizer import HFChatTokenizer

    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")
    missing = [name for name, path in cli_paths(install_dir()).items() if not path.exists()]
    if missing:
        pytest.fail(f"harness CLIs not installed ({missing}): run `bash scripts/setup.sh`")
    # strict: a field a real harness sends that a front end does not know fails its call (the live CLIs' check)
    tokenizer = HFChatTokenizer(tokenizer_dir())
    engine = SlowOracle(tokenizer, answer_delay, **engine_kw) if answer_delay else OracleEngine(tokenizer, **engine_kw)
    keepalive: dict[str, Any] = {"keepalive_after": 0.05, "keepalive_interval": 0.2} if answer_delay else {}
    service = ProxyService(engine, CaptureJournal(tmp_path / "capture"), SessionRegistry(allow_adhoc=False),
                           strict=True, **keepalive)
    async with served_gateway(service, tmp_path / "gateway", init_workers=2, ready_buffer=2, run_slots=run_slots,
                              postrun_workers=2) as node:
        yield node, service
    service.journal.close()


@pytest_asyncio.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[GatewayNode, ProxyService]]:
    async with oracle_gateway(tmp_path) as served:
        yield served


def session_for(harness: str, task_id: str = "demo-calc-add", *, runtime: RuntimeSpec | None = None,
                timeout: float = 240) -> SessionSpec:
    """A demo task's session for ``harness``, in the local sandbox unless ``runtime`` says otherwise."""
    runtime = runtime or RuntimeSpec(backend="local", network="gateway", workdir="/workspace")
    request = demo_task(task_id).to_request(harness=harness, runtime=runtime,
                                            builder=BuilderSpec(strategy="prefix_merging"), timeout_seconds=timeout)
    return SessionSpec.from_task(request, 0)


def _documents(doc: atif.Trajectory) -> list[atif.Trajectory]:
    return [doc, *(doc.subagent_trajectories or [])]


def check_atif_export(doc: atif.Trajectory, records: list[CompletionRecord], trained: set[str], harness: str) -> None:
    """Every chain is in the document: each ``trained`` completion is an agent step carrying its exact tokens; and the
    harness's shell call is paired with its output."""
    sampled = {s.metrics.extra["completion_id"]: s.metrics for d in _documents(doc) for s in d.steps
               if s.metrics is not None and s.metrics.extra}
    assert set(sampled) == trained, harness
    by_id = {r.completion_id: r for r in records}
    for cid, metrics in sampled.items():
        rec = by_id[cid]
        assert metrics.completion_token_ids == rec.response_ids and metrics.prompt_token_ids == rec.prompt_ids
        assert metrics.logprobs == rec.response_logprobs, harness
    paired = [(call, result) for d in _documents(doc) for s in d.steps for call in s.tool_calls or []
              for result in (s.observation.results if s.observation else []) if result.source_call_id ==
              call.tool_call_id]
    assert any("calc.py" in str(call.arguments) for call, _ in paired), harness  # the oracle's edit
    assert all(result.content not in (None, "") for _, result in paired), harness


async def check_atif_exports(node: GatewayNode, service: ProxyService, specs: list[SessionSpec],
                             results: list[SessionResult], tmp_path: Path) -> None:
    """The gateway's ``GET /sessions/{id}/result?format=atif`` and ``python -m polar_gym.merge --format atif`` on the
    captures: one ATIF document per session, each read back by the `atif` package's models."""
    url = f"http://{node.config.endpoint.host}:{node.config.endpoint.port}"
    trained = {spec.session_id: {cid for t in (r.trajectory.traces if r.trajectory else [])
                                 for cid in t.metadata["completion_ids"]}
               for spec, r in zip(specs, results, strict=True)}
    async with httpx.AsyncClient(base_url=url, headers={"x-admin-token": ADMIN}, timeout=60) as client:
        for spec in specs:
            resp = await client.get(f"/sessions/{spec.session_id}/result", params={"format": "atif"})
            assert resp.status_code == 200, resp.text
            doc = atif.Trajectory.model_validate(resp.json())
            assert doc.agent.name == spec.agent.harness and doc.extra and doc.extra["reward"] == 1.0
            check_atif_export(doc, await service.journal.records(spec.session_id), trained[spec.session_id],
                              spec.agent.harness)
    out = tmp_path / "atif.jsonl"
    assert merge_main(["--builder", "prefix_merging", "--format", "atif", str(tmp_path / "capture"),
                       "--out", str(out)]) == 0
    docs = {d.session_id: d for d in map(atif.Trajectory.model_validate_json, out.read_bytes().splitlines())}
    assert set(docs) == {spec.session_id for spec in specs}
    for spec in specs:
        check_atif_export(docs[spec.session_id], await service.journal.records(spec.session_id),
                          trained[spec.session_id], spec.agent.harness)


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(part.get("text") or "") for part in content if isinstance(part, dict))
    return str(content or "")


def _calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for call in message.get("tool_calls") or []:
        arguments = call["function"]["arguments"]
        out.append((call["function"]["name"], json.loads(arguments) if isinstance(arguments, str) else arguments))
    return out


def _same(sent: dict[str, Any], known: dict[str, Any]) -> bool:
    """A request's message is an earlier one at the message level: the same, or for an assistant turn the same text
    and calls (harnesses may drop its thinking, trim it, or respell call IDs)."""
    if sent.get("role") != known.get("role"):
        return False
    if sent.get("role") != "assistant":
        return sent == known
    return _text(sent.get("content")).strip() == _text(known.get("content")).strip() and _calls(sent) == _calls(known)


def conversations(records: list[CompletionRecord]) -> int:
    """Conversations among the trained calls, counted from the captured messages alone: a call continues an earlier
    call when its messages are that call's messages, then that call's reply, then more; every other call (a first
    call, a side request such as a title, a compacted or edited history) starts a conversation."""
    seen: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []
    count = 0
    for rec in sorted(records, key=lambda r: r.index):
        if rec.status != "ok" or not rec.response_ids:
            continue
        messages = rec.normalized_request["messages"]
        if not any(len(messages) > len(prev) + 1 and _same(messages[len(prev)], reply)
                   and all(_same(a, b) for a, b in zip(messages, prev, strict=False)) for prev, reply in seen):
            count += 1
        seen.append((messages, rec.response["message"]))
    return count


async def test_six_real_harnesses_solve_a_demo_task_in_one_chain_per_conversation_while_the_oracle_drifts(
        tmp_path, capsys):
    """drift_every=2: every second call samples a non-canonical tokenization. token_in reuses the sampled IDs as they
    are, so each conversation is one contiguous chain (side requests, trained by default, are conversations too).
    The same sessions are the harnesses' end-to-end test: each reaches reward 1.0, merges into fewer traces than
    per_request, and exports to ATIF (a run without drift proved nothing more, at 20 s of CPU).

    And a slow engine's: every call takes 0.6 s, longer than the proxy's keepalive delay, so each streamed answer
    starts with keepalive bytes, and every harness must read through them without sending the call again. Gemini
    CLI bundles a copy of the google-genai SDK that reads a stream only while its buffer starts with ``data:``
    (after whitespace): an SSE comment there left every event unread, the call failed ("Incomplete JSON segment at
    the end") and Gemini CLI sent it again, forever on an engine slower than the keepalive delay (seen on vLLM CPU:
    identical calls re-sent after each 16-20 s answer)."""
    report = {}
    async with oracle_gateway(tmp_path, run_slots=3, answer_delay=0.6, drift_every=2, prompt_mode="token_in") as (
            node, service):
        # a longer loop than the reference solution alone: read-only looks first, so several calls drift
        commands = ["ls", "cat calc.py", "git status --short", *demo_task("demo-calc-add").solution, "git diff --stat"]
        specs = [with_script(session_for(name), commands, timeout=240) for name in HARNESSES]
        results = await asyncio.wait_for(node.run(specs), 900)
        sessions = {}
        for spec, result in zip(specs, results, strict=True):
            harness = spec.agent.harness
            records = await service.journal.records(spec.session_id)
            trajectory = result.trajectory
            assert trajectory is not None and trajectory.builder == "prefix_merging", (harness, result.reason)
            sessions[harness] = (result, CompletionSession(session_id=spec.session_id, completions=records))
            causes = Counter(n.split(":", 1)[1] for r in records for n in r.normalizations
                             if n.startswith("token_in_new_chain:"))
            report[harness] = {
                "calls": len(records), "side_requests": sum(r.side_request for r in records),
                "drifted": sum(service.engine.tokenizer.encode(service.engine.tokenizer.decode(r.response_ids))
                               != r.response_ids for r in records),
                "conversations": conversations(records), "traces": len(trajectory.traces),
                "prompts": [len(r.normalized_request.get("messages") or []) for r in records if not r.side_request],
                "new_chains": dict(causes), "breaks": trajectory.diagnostics["breaks"],
                "reward": result.evaluation.reward if result.evaluation else None}
        await check_atif_exports(node, service, specs, results, tmp_path)
    with capsys.disabled():
        print("\nharness: calls, side requests, drifted, conversations, traces, new chains by cause, builder breaks")
        for harness, row in report.items():
            print(f"  {harness}: {row}")
    assert MergeConfig().include_side_requests  # side requests are trained: each is its own conversation
    for harness, (result, session) in sessions.items():
        assert result.status is SessionStatus.COMPLETED and result.evaluation is not None, (harness, result.reason)
        assert result.evaluation.reward == 1.0, (harness, result.evaluation.details)
        assert {r.prompt_mode for r in session.completions} == {"token_in"}, harness
        assert result.trajectory is not None
        check_invariants(session, result.trajectory)  # mask-1 tokens are exactly the sampled tokens
        assert all(t.reward == 1.0 for t in result.trajectory.traces) and result.timings, harness
        flat = per_request(session, MergeConfig())
        assert len(result.trajectory.traces) < len(flat.traces), (harness, result.trajectory.diagnostics)
        by_id = {r.completion_id: r for r in session.completions}
        for trace in result.trajectory.traces:
            assert trace.metadata["has_logprobs"] and len(trace.response_logprobs) == len(trace.response_ids)
            for span in trace.metadata["spans"]:  # each call's prompt is the chain so far, token for token
                prompt = by_id[span["completion_id"]].prompt_ids
                assert trace.prompt_ids + trace.response_ids[:span["start"]] == prompt, harness
            check_contiguity(nemo_items(trace))  # NeMo RL's rule
    for harness, row in report.items():
        assert len(row["prompts"]) == len(set(row["prompts"])), ("a call sent twice", harness, row)
        assert row["drifted"] >= 1, (harness, row)
        assert row["traces"] == row["conversations"] == sum(row["new_chains"].values()), (harness, row)
        assert "drift" not in row["breaks"], (harness, row)


def with_script(spec: SessionSpec, commands: list[str], timeout: float) -> SessionSpec:
    metadata = spec.metadata.model_copy(update={"oracle": {"commands": commands, "final_answer": "done"}})
    return spec.model_copy(update={"metadata": metadata, "timeout_seconds": timeout})


def sandbox_processes(marker: str) -> list[int]:
    return [int(line.split(":", 1)[0]) for line in processes_with(marker)]


async def test_a_real_harness_cancelled_while_running_leaves_nothing_behind(gateway):
    node, _ = gateway
    marker = "polar-e2e-cancel-marker"
    spec = with_script(session_for("claude_code"), [f"sleep 300 # {marker}"], timeout=300)
    session = node.submit(spec)
    await until(lambda: sandbox_processes(marker), 60, "the harness to make its call and start the command")
    assert node.cancel(spec.session_id)
    result = await asyncio.wait_for(node.wait(spec.session_id), 120)
    assert result.status is SessionStatus.CANCELLED and session.spec.session_id == result.session_id
    await until(lambda: not sandbox_processes(marker), 30, "the sandbox's processes to go")
