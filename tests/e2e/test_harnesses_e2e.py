"""End to end with real, unmodified harness CLIs: the gateway (oracle engine with the real Qwen tokenizer) runs each
of the six pinned CLIs in the local sandbox with nothing but the gateway reachable, on a demo task whose test fails.
The oracle plays the reference solution through the harness's own shell tool; the evaluator runs the task's tests.
Every session must reach reward 1.0, merge into fewer traces than per_request, and hold the fidelity invariant."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from polar_gym.assets import tokenizer_dir
from polar_gym.gateway import GatewayNode
from polar_gym.harness.install import cli_paths, install_dir
from polar_gym.merge import MergeConfig
from polar_gym.merge.per_request import per_request
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.schema import BuilderSpec, CompletionSession, RuntimeSpec, SessionSpec, SessionStatus
from polar_gym.tasks import demo_task
from tests._procs import processes_with
from tests._serving import served_gateway
from tests._waiting import until
from tests.merge._sessions import check_invariants

pytestmark = [pytest.mark.harness, pytest.mark.slow]

HARNESSES = ["claude_code", "codex", "qwen_code", "gemini_cli", "opencode", "pi"]


@pytest_asyncio.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[GatewayNode, ProxyService]]:
    from polar_gym.proxy.tokenizer import HFChatTokenizer

    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")
    missing = [name for name, path in cli_paths(install_dir()).items() if not path.exists()]
    if missing:
        pytest.fail(f"harness CLIs not installed ({missing}): run `bash scripts/setup.sh`")
    service = ProxyService(OracleEngine(HFChatTokenizer(tokenizer_dir())), CaptureJournal(tmp_path / "capture"),
                           SessionRegistry(allow_adhoc=False))
    async with served_gateway(service, tmp_path / "gateway", init_workers=2, ready_buffer=2, run_slots=2,
                              postrun_workers=2) as node:
        yield node, service
    service.journal.close()


def session_for(harness: str, task_id: str = "demo-calc-add") -> SessionSpec:
    request = demo_task(task_id).to_request(
        harness=harness, runtime=RuntimeSpec(backend="local", network="gateway", workdir="/workspace"),
        builder=BuilderSpec(strategy="prefix_merging"), timeout_seconds=240)
    return SessionSpec.from_task(request, 0)


async def test_six_real_harnesses_solve_a_demo_task_through_the_gateway(gateway):
    node, service = gateway
    specs = [session_for(name) for name in HARNESSES]
    results = await asyncio.wait_for(node.run(specs), 900)
    failures = {spec.agent.harness: (r.status, r.reason, (r.evaluation.details if r.evaluation else None))
                for spec, r in zip(specs, results, strict=True)
                if r.status is not SessionStatus.COMPLETED or r.evaluation is None or r.evaluation.reward != 1.0}
    assert failures == {}
    for spec, result in zip(specs, results, strict=True):
        records = await service.journal.records(spec.session_id)
        session = CompletionSession(session_id=spec.session_id, completions=records)
        trajectory = result.trajectory
        assert trajectory is not None and trajectory.builder == "prefix_merging"
        check_invariants(session, trajectory)  # mask-1 tokens are sampled tokens; nothing lost
        assert all(t.reward == 1.0 for t in trajectory.traces)
        flat = per_request(session, MergeConfig())
        assert len(trajectory.traces) < len(flat.traces), (spec.agent.harness, trajectory.diagnostics)
        assert result.timings, "every stage is timed"


def _with_script(spec: SessionSpec, commands: list[str], timeout: float) -> SessionSpec:
    metadata = spec.metadata.model_copy(update={"oracle": {"commands": commands, "final_answer": "done"}})
    return spec.model_copy(update={"metadata": metadata, "timeout_seconds": timeout})


def _sandbox_processes(marker: str) -> list[int]:
    return [int(line.split(":", 1)[0]) for line in processes_with(marker)]


async def test_a_real_harness_killed_by_the_deadline_keeps_its_partial_traces(gateway):
    node, service = gateway
    marker = "polar-e2e-deadline-marker"
    # the deadline leaves a loaded machine room to start the harness and make two calls; only it ends the sleep
    spec = _with_script(session_for("pi"), ["printf hi > first.txt", f"sleep 300 # {marker}"], timeout=60)
    (result,) = await asyncio.wait_for(node.run([spec]), 300)
    assert result.status is SessionStatus.TIMEOUT, (result.status, result.reason)
    records = await service.journal.records(spec.session_id)
    assert len(records) >= 2  # the first command's call and the call that started the long one
    assert result.trajectory is not None and result.trajectory.traces
    check_invariants(CompletionSession(session_id=spec.session_id, completions=records), result.trajectory)
    await until(lambda: not _sandbox_processes(marker), 30, "the sandbox's processes to go")


async def test_a_real_harness_cancelled_while_running_leaves_nothing_behind(gateway):
    node, _ = gateway
    marker = "polar-e2e-cancel-marker"
    spec = _with_script(session_for("claude_code"), [f"sleep 300 # {marker}"], timeout=300)
    session = node.submit(spec)
    await until(lambda: _sandbox_processes(marker), 60, "the harness to make its call and start the command")
    assert node.cancel(spec.session_id)
    result = await asyncio.wait_for(node.wait(spec.session_id), 120)
    assert result.status is SessionStatus.CANCELLED and session.spec.session_id == result.session_id
    await until(lambda: not _sandbox_processes(marker), 30, "the sandbox's processes to go")
