"""Every demo task's tests fail on the prepared repository and pass after its reference solution, in the sandbox."""

from __future__ import annotations

import shlex

import pytest

from polar_gym.schema import RuntimeSpec, TaskRequest
from polar_gym.tasks import DEMO_TASKS, TEST_COMMAND, demo_task, demo_tasks
from tests.evaluate._evalkit import needs_bwrap, solve

pytestmark = needs_bwrap


def test_task_set_shape() -> None:
    assert 3 <= len(DEMO_TASKS) <= 5
    for task in demo_tasks():
        assert task.solution and task.instruction and task.files
        for command in task.solution:
            assert "\n" not in command, "reference commands are one line each"
            shlex.split(command)  # valid POSIX quoting


def test_demo_task_lookup() -> None:
    assert demo_task("demo-calc-add").task_id == "demo-calc-add"
    with pytest.raises(KeyError, match="known: "):
        demo_task("nope")


def test_to_request_round_trips_and_keeps_runtime_fields() -> None:
    task = demo_task("demo-inventory")
    base = RuntimeSpec(backend="docker", image="python:3.12-slim", workdir="/repo",
                       prepare=[{"type": "exec", "command": "true"}])
    request = task.to_request(harness="codex", runtime=base, num_samples=4)
    again = TaskRequest.model_validate_json(request.model_dump_json())
    assert again == request
    assert again.runtime.backend == "docker" and again.runtime.image == "python:3.12-slim"
    assert again.runtime.prepare[0].command == "true"  # the caller's own actions first
    uploads = [a.dst for a in again.runtime.prepare if a.type == "upload_file"]
    assert "/repo/inventory/store.py" in uploads and "/repo/.gitignore" in uploads
    assert again.runtime.prepare[-1].type == "exec" and "git" in str(again.runtime.prepare[-1].command)
    assert again.evaluator.strategy == "test_on_output"
    assert again.evaluator.config.model_dump()["repo_dir"] == "/repo"
    assert again.metadata.model_dump()["oracle"]["commands"] == task.solution
    assert again.agent.harness == "codex" and again.num_samples == 4


def test_oracle_script() -> None:
    task = demo_task("demo-slugify")
    script = task.oracle_script()
    assert script.commands == task.solution and script.final_answer == task.final_answer


@pytest.mark.parametrize("task_id", list(DEMO_TASKS))
async def test_fails_before_and_passes_after_reference(demo_runtime, task_id: str) -> None:
    task = demo_task(task_id)
    async with demo_runtime(task) as rt:
        log = await rt.exec("git log --oneline && git status --porcelain", timeout=30)
        assert log.ok and "Initial commit" in log.text
        assert log.text.strip().count("\n") == 0, f"the prepared tree is committed and clean: {log.text}"
        before = await rt.exec(TEST_COMMAND, timeout=60)
        assert before.exit_code not in (None, 0), before.stderr
        await solve(rt, task)
        after = await rt.exec(TEST_COMMAND, timeout=60)
        assert after.ok, after.stderr.decode()
        # the solution is idempotent: playing it again (a retried tool call) leaves the tests passing
        await solve(rt, task)
        assert (await rt.exec(TEST_COMMAND, timeout=60)).ok


@pytest.mark.parametrize("shell", ["sh", "bash", "dash"])
async def test_reference_runs_under_other_shells(demo_runtime, shell: str) -> None:
    """Harness tools hand commands to sh -c, bash -lc or argv arrays: the same text works in each."""
    task = demo_task("demo-inventory")
    async with demo_runtime(task) as rt:
        if not (await rt.exec(["sh", "-c", f"command -v {shell}"])).ok:
            pytest.skip(f"{shell} is not installed")
        for command in task.solution:
            result = await rt.exec([shell, "-c", command], timeout=60)
            assert result.ok, (shell, command, result.stderr)
