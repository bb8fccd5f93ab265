"""The harnesses beyond the six CLIs, unmodified and from their pinned installs (npm or a venv of their own), each on
every demo task and every Harbor test task through the gateway, in the local sandbox with only the gateway reachable:
the oracle engine (real Qwen tokenizer, token-in prompts) plays the reference solution the way each harness takes
commands (its shell tool; aider, which has none, a fenced shell block), and every session must reach reward 1.0 with
traces that hold the builders' invariants."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from polar_gym.harness.pyinstall import installed_cli
from polar_gym.registry import HARNESSES
from polar_gym.schema import (
    BuilderSpec,
    CompletionSession,
    RuntimeSpec,
    SessionSpec,
    SessionStatus,
    TaskRequest,
)
from polar_gym.tasks import demo_tasks
from polar_gym.tasks.harbor import find_tasks
from tests.e2e.test_harnesses_e2e import oracle_gateway
from tests.merge._sessions import check_invariants

pytestmark = [pytest.mark.harness, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
#: the harnesses issue 39 added, by registry name
MORE_HARNESSES = ["mini_swe_agent", "aider", "hermes", "openclaw", "openhands", "cline"]
RUNTIME = RuntimeSpec(backend="local", network="gateway", workdir="/workspace")


def task_requests(harness: str) -> list[TaskRequest]:
    """The four demo tasks and the three Harbor test tasks, for ``harness``."""
    builder = BuilderSpec(strategy="prefix_merging")
    demos = [task.to_request(harness=harness, runtime=RUNTIME, builder=builder, timeout_seconds=300)
             for task in demo_tasks()]
    harbor = [task.to_request(harness=harness, model_name="policy", runtime=RUNTIME,
                              evaluator=task.evaluator(), builder=builder, num_samples=1, timeout_seconds=300)
              for task in find_tasks(ROOT / "tests" / "data" / "harbor" / "tasks")]
    return [*demos, *harbor]


async def test_each_harness_solves_every_demo_and_harbor_task(tmp_path: Path) -> None:
    missing = [h for h in MORE_HARNESSES if installed_cli(HARNESSES.get(h).pin) is None]
    if missing:
        pytest.fail(f"harnesses not installed ({missing}): run `bash scripts/setup.sh`")
    specs = [SessionSpec.from_task(request, 0) for h in MORE_HARNESSES for request in task_requests(h)]
    assert len(specs) == 7 * len(MORE_HARNESSES)
    async with oracle_gateway(tmp_path) as (node, service):
        results = await asyncio.wait_for(node.run(specs), 1200)
        failures = {(s.agent.harness, s.task_id): (r.status, r.reason, r.evaluation.details if r.evaluation else None)
                    for s, r in zip(specs, results, strict=True)
                    if r.status is not SessionStatus.COMPLETED or r.evaluation is None or r.evaluation.reward != 1.0}
        assert failures == {}
        for spec, result in zip(specs, results, strict=True):
            records = await service.journal.records(spec.session_id)
            assert result.trajectory is not None and result.trajectory.traces, spec.agent.harness
            check_invariants(CompletionSession(session_id=spec.session_id, completions=records), result.trajectory)
            assert {r.prompt_mode for r in records} == {"token_in"}
            # no process lost to a memory limit: OpenClaw's agent was at a task's 1024 MB and exited 0 undone
            assert result.metadata["harness"]["oom_kills"] == 0, spec.agent.harness
