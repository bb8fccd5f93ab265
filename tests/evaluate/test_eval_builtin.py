"""session_completed and test_on_output against demo repositories in real local sandboxes."""

from __future__ import annotations

import pytest

from polar_gym.evaluate import EvaluatorConfigError, MissingRuntimeError, load_evaluator
from polar_gym.evaluate.session_completed import SessionCompleted
from polar_gym.evaluate.test_on_output import TestOnOutput
from polar_gym.merge.rewards import apply_rewards
from polar_gym.runtime.base import ExecResult, ExecStatus
from polar_gym.schema import EvaluatorSpec, Trace
from polar_gym.tasks import TEST_COMMAND, demo_task
from tests.evaluate._evalkit import context, needs_bwrap, solve

pytestmark = needs_bwrap
TASK = demo_task("demo-calc-add")


def _trace() -> Trace:
    return Trace(prompt_ids=[1, 2], response_ids=[3], loss_mask=[1])


# -- session_completed -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("harness", "completions", "reward", "reason"), [
    (ExecResult(status=ExecStatus.OK, exit_code=0), 3, 1.0, "exited 0 after 3"),
    (ExecResult(status=ExecStatus.OK, exit_code=0), 0, 0.0, "without calling the model"),
    (ExecResult(status=ExecStatus.FAILED, exit_code=2), 3, 0.0, "ended failed (exit code 2)"),
    (ExecResult(status=ExecStatus.TIMEOUT), 3, 0.0, "ended timeout"),
    (None, 0, 0.0, "never ran"),
])
async def test_session_completed(harness, completions, reward, reason) -> None:
    ctx = context(TASK, runtime=None, harness=harness, completions=completions)
    if harness is None:
        ctx.harness_result = None
    result = await SessionCompleted().evaluate(ctx)
    assert result.reward == reward and result.passed is (reward == 1.0)
    assert reason in result.details["reason"]


async def test_session_completed_counts_traces_without_diagnostics() -> None:
    ctx = context(TASK, runtime=None, traces=[_trace()])
    ctx.trajectory.diagnostics.clear()
    assert (await SessionCompleted().evaluate(ctx)).reward == 1.0


# -- test_on_output, live runtime --------------------------------------------------------------------------------

async def test_live_unsolved_then_solved(demo_runtime) -> None:
    evaluator = load_evaluator(TASK.evaluator())
    assert isinstance(evaluator, TestOnOutput) and not evaluator.wants_fresh_runtime(TASK.evaluator())
    async with demo_runtime(TASK) as rt:
        before = await evaluator.evaluate(context(TASK, runtime=rt))
        assert before.reward == 0.0 and before.passed is False
        assert before.details["tests"] == {"framework": "unittest", "passed": 1, "failed": 1, "errors": 0,
                                           "skipped": 0, "total": 2}
        assert "exit code 1" in before.details["reason"] and "AssertionError" in before.details["output"]
        await solve(rt, TASK)
        after = await evaluator.evaluate(context(TASK, runtime=rt, traces=[_trace(), _trace()]))
        assert after.reward == 1.0 and after.passed is True
        assert after.details["tests"]["passed"] == 2 and after.details["runtime"] == "live"
        # the outcome flows into the trajectory
        traj = apply_rewards(context(TASK, runtime=rt, traces=[_trace(), _trace()]).trajectory, after)
        assert [t.reward for t in traj.traces] == [1.0, 1.0]


async def test_fractional_regex_and_min_tests(demo_runtime) -> None:
    async with demo_runtime(TASK) as rt:
        fractional = TestOnOutput({"command": TEST_COMMAND, "fractional": True})
        result = await fractional.evaluate(context(TASK, runtime=rt))
        assert result.reward == 0.5 and result.passed is False
        regex_only = TestOnOutput({"command": TEST_COMMAND, "expected_exit_code": None,
                                   "output_regex": r"^FAILED \(failures=1\)$"})
        assert (await regex_only.evaluate(context(TASK, runtime=rt))).reward == 1.0
        no_match = TestOnOutput({"command": "echo hello", "output_regex": "bye"})
        result = await no_match.evaluate(context(TASK, runtime=rt))
        assert result.reward == 0.0 and result.details["regex_matched"] is False
        too_few = TestOnOutput({"command": "true", "min_tests": 1})
        result = await too_few.evaluate(context(TASK, runtime=rt))
        assert result.reward == 0.0 and "fewer than 1" in result.details["reason"]


async def test_timeout_is_a_zero_not_an_error(demo_runtime) -> None:
    async with demo_runtime(TASK) as rt:
        result = await TestOnOutput({"command": "sleep 300", "timeout": 0.3}).evaluate(context(TASK, runtime=rt))
        assert result.reward == 0.0 and "timed out" in result.details["reason"]


async def test_missing_runtime_is_an_error() -> None:
    with pytest.raises(MissingRuntimeError):
        await TestOnOutput({"command": "true"}).evaluate(context(TASK, runtime=None))


def test_config_typos_fail_at_build_time() -> None:
    with pytest.raises(EvaluatorConfigError, match="expected_exit"):
        TestOnOutput({"command": "true", "expected_exit": 0})
    with pytest.raises(EvaluatorConfigError):
        TestOnOutput({})
    with pytest.raises(EvaluatorConfigError):
        TestOnOutput({"command": "true", "output_regex": "("})


# -- test_on_output, fresh runtime -------------------------------------------------------------------------------

@pytest.mark.parametrize("task_id", ["demo-calc-add", "demo-stack-module", "demo-inventory"])
async def test_fresh_runtime_gets_the_patch(demo_runtime, task_id: str) -> None:
    task = demo_task(task_id)
    spec = task.evaluator(refresh_runtime=True)
    evaluator = load_evaluator(spec)
    assert evaluator.wants_fresh_runtime(spec)
    async with demo_runtime(task, "live") as live, demo_runtime(task, "fresh") as fresh:
        await solve(live, task)  # the solution leaves __pycache__ (ignored) and, for stack, a new file
        await live.exec("echo scratch > notes.txt && mkdir -p demo.egg-info && echo x > demo.egg-info/PKG-INFO")
        result = await evaluator.evaluate(context(task, runtime=live, fresh=fresh, evaluator=spec))
        assert result.reward == 1.0, result.details
        patch = result.details["patch"]
        assert patch["applied"] and patch["strategy"] == "git_apply"
        assert "notes.txt" in patch["files"] and "demo.egg-info/PKG-INFO" in patch["dropped"]
        # the live repository's index is untouched by taking the patch
        status = await live.exec("git diff --cached --name-only")
        assert status.ok and status.text == ""


async def test_fresh_unsolved_is_zero_and_config_selects_fresh(demo_runtime) -> None:
    evaluator = TestOnOutput({"command": TEST_COMMAND, "runtime": "fresh"})
    assert evaluator.wants_fresh_runtime(EvaluatorSpec(strategy="test_on_output"))
    async with demo_runtime(TASK, "live") as live, demo_runtime(TASK, "fresh") as fresh:
        # the agent "fixes" things outside the repository: nothing of that reaches the fresh runtime
        await live.exec("mkdir -p /tmp/x && echo hacked > /tmp/x/state")
        result = await evaluator.evaluate(context(TASK, runtime=live, fresh=fresh))
        assert result.reward == 0.0 and result.details["patch"]["strategy"] == "empty"
        with pytest.raises(MissingRuntimeError):
            await evaluator.evaluate(context(TASK, runtime=live, fresh=None))


async def test_fresh_patch_failure_is_zero(demo_runtime) -> None:
    async with demo_runtime(TASK, "live") as live, demo_runtime(TASK, "fresh") as fresh:
        await live.exec("rm -rf .git")
        evaluator = TestOnOutput({"command": TEST_COMMAND, "runtime": "fresh"})
        result = await evaluator.evaluate(context(TASK, runtime=live, fresh=fresh))
        assert result.reward == 0.0 and "patch command failed" in result.details["reason"]
