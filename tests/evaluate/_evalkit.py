"""Helpers for the evaluator tests: play a reference solution, build an EvalContext. Nothing is faked: commands run
in a real local (bubblewrap) sandbox."""

from __future__ import annotations

import shutil

import pytest

from polar_gym.evaluate.base import EvalContext
from polar_gym.runtime.base import ExecResult, ExecStatus, Runtime
from polar_gym.schema import EvaluatorSpec, SessionSpec, Trace, Trajectory
from polar_gym.tasks import DemoTask

__all__ = ["context", "needs_bwrap", "solve"]

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


async def solve(rt: Runtime, task: DemoTask) -> None:
    """Play the task's reference solution in the runtime, one new shell per command, as a harness's tool would."""
    for command in task.solution:
        result = await rt.exec(["bash", "-lc", command], timeout=60)
        assert result.ok, (command, result.stdout, result.stderr)


def context(task: DemoTask, *, runtime: Runtime | None, fresh: Runtime | None = None,
            evaluator: EvaluatorSpec | None = None, harness: ExecResult | None = None, completions: int = 1,
            traces: list[Trace] | None = None) -> EvalContext:
    spec = SessionSpec.from_task(task.to_request(evaluator=evaluator), 0)
    trajectory = Trajectory(session_id=spec.session_id, traces=traces or [],
                            diagnostics={"completions": completions})
    if harness is None:
        harness = ExecResult(status=ExecStatus.OK, exit_code=0)
    return EvalContext(spec=spec, trajectory=trajectory, harness_result=harness, runtime=runtime,
                       fresh_runtime=fresh)
