"""The harnesses beyond the six CLIs, unmodified and from their pinned installs (npm or a venv of their own), each on
a demo task and a Harbor test task through the gateway, in the local sandbox with only the gateway reachable:
the oracle engine (real Qwen tokenizer, token-in prompts) plays the reference solution the way each harness takes
commands (its shell tool; aider, which has none, a fenced shell block), and every session must reach reward 1.0 with
traces that hold the builders' invariants. The oracle plays any Harbor task as one base64 command, so one task per
harness is the harness's test; the 1024 MB one, where a memory limit would show. The same gateway runs a real harness
into its deadline meanwhile: a session that sleeps in a run slot of its own while the others work."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest

from polar_gym.harness.pyinstall import installed_cli
from polar_gym.registry import HARNESSES
from polar_gym.schema import (
    BuilderSpec,
    CompletionRecord,
    CompletionSession,
    RuntimeSpec,
    SessionResult,
    SessionSpec,
    SessionStatus,
    TaskRequest,
)
from polar_gym.tasks import demo_tasks
from polar_gym.tasks.harbor import find_tasks
from tests._waiting import until_sync
from tests.e2e.test_harnesses_e2e import oracle_gateway, sandbox_processes, session_for, with_script
from tests.merge._sessions import check_invariants

pytestmark = [pytest.mark.harness, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
#: the harnesses issue 39 added, by registry name
MORE_HARNESSES = ["mini_swe_agent", "aider", "hermes", "openclaw", "openhands", "cline"]
RUNTIME = RuntimeSpec(backend="local", network="gateway", workdir="/workspace")


HARBOR_TASK = "edit-greeting"  # its 1024 MB limit is where OpenClaw's agent once ran out
#: the demo task whose commands are the hardest to carry through a harness's shell tool: inventory's two in-place
#: edits with escaped newlines (backslashes and quotes through each harness's tool-call JSON and shell). The other
#: demo tasks' commands are one edit or one printf, shapes these carry too, and the Harbor task is one base64
#: command: each more demo task was six more sessions (about 40 s of CPU) proving the same thing again
DEMO_TASKS_HERE = ("demo-inventory",)
DEADLINE_MARKER = "polar-e2e-deadline-marker"


def task_requests(harness: str) -> list[TaskRequest]:
    """The demo task and the Harbor test task, for ``harness``."""
    builder = BuilderSpec(strategy="prefix_merging")
    demos = [task.to_request(harness=harness, runtime=RUNTIME, builder=builder, timeout_seconds=300)
             for task in demo_tasks() if task.task_id in DEMO_TASKS_HERE]
    assert len(demos) == len(DEMO_TASKS_HERE)
    harbor = [task.to_request(harness=harness, model_name="policy", runtime=RUNTIME,
                              evaluator=task.evaluator(), builder=builder, num_samples=1, timeout_seconds=300)
              for task in find_tasks(ROOT / "tests" / "data" / "harbor" / "tasks") if task.path.name == HARBOR_TASK]
    assert len(harbor) == 1
    return [*demos, *harbor]


@dataclass
class Batch:
    specs: list[SessionSpec]
    results: list[SessionResult]
    records: dict[str, list[CompletionRecord]]

    def of(self, spec: SessionSpec) -> tuple[SessionResult, list[CompletionRecord]]:
        return self.results[self.specs.index(spec)], self.records[spec.session_id]


def deadline_spec() -> SessionSpec:
    """pi runs one command, then one only the deadline ends. The deadline leaves a loaded machine room to start the
    harness and make two calls."""
    return with_script(session_for("pi"), ["printf hi > first.txt", f"sleep 300 # {DEADLINE_MARKER}"], timeout=60)


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> Batch:
    """Every session of this module on one gateway, the deadline's first: it sleeps in its own run slot."""
    missing = [h for h in MORE_HARNESSES if installed_cli(HARNESSES.get(h).pin) is None]
    if missing:
        pytest.fail(f"harnesses not installed ({missing}): run `bash scripts/setup.sh`")
    specs = [deadline_spec(), *(SessionSpec.from_task(request, 0) for h in MORE_HARNESSES
                                for request in task_requests(h))]

    async def run() -> Batch:
        async with oracle_gateway(tmp_path_factory.mktemp("batch"), run_slots=3) as (node, service):
            results = await asyncio.wait_for(node.run(specs), 1200)
            records = {s.session_id: await service.journal.records(s.session_id) for s in specs}
        return Batch(specs, results, records)

    return asyncio.run(run())


def test_each_harness_solves_a_demo_task_and_a_harbor_task(batch: Batch) -> None:
    specs = [s for s in batch.specs if s.agent.harness in MORE_HARNESSES]
    assert len(specs) == (len(DEMO_TASKS_HERE) + 1) * len(MORE_HARNESSES)
    failures = {(s.agent.harness, s.task_id): (r.status, r.reason, r.evaluation.details if r.evaluation else None)
                for s in specs for r, _ in [batch.of(s)]
                if r.status is not SessionStatus.COMPLETED or r.evaluation is None or r.evaluation.reward != 1.0}
    assert failures == {}
    for spec in specs:
        result, records = batch.of(spec)
        assert result.trajectory is not None and result.trajectory.traces, spec.agent.harness
        check_invariants(CompletionSession(session_id=spec.session_id, completions=records), result.trajectory)
        assert {r.prompt_mode for r in records} == {"token_in"}
        # no process lost to a memory limit: OpenClaw's agent was at a task's 1024 MB and exited 0 undone
        assert result.metadata["harness"]["oom_kills"] == 0, spec.agent.harness


def test_a_real_harness_killed_by_the_deadline_keeps_its_partial_traces(batch: Batch) -> None:
    spec = batch.specs[0]
    result, records = batch.of(spec)
    assert result.status is SessionStatus.TIMEOUT, (result.status, result.reason)
    assert len(records) >= 2  # the first command's call and the call that started the long one
    assert result.trajectory is not None and result.trajectory.traces
    check_invariants(CompletionSession(session_id=spec.session_id, completions=records), result.trajectory)
    until_sync(lambda: not sandbox_processes(DEADLINE_MARKER), 30, "the sandbox's processes to go")
