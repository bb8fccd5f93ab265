"""The harbor evaluator: reading /logs/verifier the way Harbor's verifier does (hostile files included), and running a
Harbor task's tests/test.sh after the agent in a real local sandbox laid out as tasks=harbor lays it out."""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from polar_gym.evaluate import EvaluationError, EvaluatorConfigError, InvalidReward, load_evaluator
from polar_gym.evaluate.base import EvalContext
from polar_gym.evaluate.harbor import MAX_REWARD_BYTES, HarborVerifier, read_reward
from polar_gym.runtime.base import ExecResult, ExecStatus, Runtime
from polar_gym.runtime.local import LocalRuntime
from polar_gym.schema import RuntimeSpec, SessionSpec, Trajectory
from polar_gym.settings import ConfigError
from polar_gym.tasks import run_prepare
from polar_gym.tasks.harbor import find_tasks
from tests.evaluate._evalkit import needs_bwrap

DATA = Path(__file__).resolve().parents[1] / "data" / "harbor"


# -- reading the reward (pure) -----------------------------------------------------------------------------------

def _dir(tmp_path: Path, **files: str | bytes) -> Path:
    for name, content in files.items():
        path = tmp_path / name.replace("_", ".")
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return tmp_path


@pytest.mark.parametrize(("files", "reward", "rewards", "source"), [
    ({"reward_txt": "1\n"}, 1.0, {"reward": 1.0}, "reward.txt"),
    ({"reward_txt": " 0.25 "}, 0.25, {"reward": 0.25}, "reward.txt"),
    ({"reward_json": '{"reward": 0.5, "style": 1}'}, 0.5, {"reward": 0.5, "style": 1.0}, "reward.json"),
    ({"reward_json": '{"parses": 1, "correct": 0}'}, 0.5, {"parses": 1.0, "correct": 0.0}, "reward.json"),
    ({"reward_json": "0.75"}, 0.75, {"reward": 0.75}, "reward.json"),
    # reward.json wins over reward.txt, as in Harbor
    ({"reward_json": '{"reward": 0}', "reward_txt": "1"}, 0.0, {"reward": 0.0}, "reward.json"),
], ids=["txt", "txt-spaces", "json-reward-key", "json-mean", "json-number", "json-first"])
def test_rewards_are_read_as_harbor_reads_them(tmp_path, files, reward, rewards, source) -> None:
    reading = read_reward(_dir(tmp_path, **files))
    assert (reading.reward, reading.rewards, reading.source, reading.error) == (reward, rewards, source, None)


@pytest.mark.parametrize(("files", "error"), [
    ({}, "no reward file"),
    ({"reward_txt": ""}, "empty"),
    ({"reward_txt": "  \n"}, "empty"),
    ({"reward_txt": "passed"}, "not a number"),
    ({"reward_txt": "nan"}, "not finite"),
    ({"reward_txt": "-inf"}, "not finite"),
    ({"reward_txt": b"\xff\xfe1"}, "not a number"),
    ({"reward_json": "{oops"}, "not JSON"),
    ({"reward_json": '{"reward": NaN}'}, "not finite"),
    ({"reward_json": '{"reward": 1e309}'}, "not finite"),
    ({"reward_json": '{"reward": "NaN"}'}, "not a number"),
    ({"reward_json": '{"reward": true}'}, "not a number"),
    ({"reward_json": '{"reward": [1]}'}, "not a number"),
    ({"reward_json": "{}"}, "empty object"),
    ({"reward_json": "null"}, "not a number"),
])
def test_hostile_or_broken_reward_files_give_no_reward_and_say_why(tmp_path, files, error) -> None:
    reading = read_reward(_dir(tmp_path, **files))
    assert reading.reward is None and error in str(reading.error)


def test_a_huge_reward_file_is_not_read(tmp_path) -> None:
    (tmp_path / "reward.txt").write_text("1" + " " * MAX_REWARD_BYTES)
    reading = read_reward(tmp_path)
    assert reading.reward is None and "over" in str(reading.error)


def test_a_symlink_out_of_the_directory_is_never_followed(tmp_path) -> None:
    outside = tmp_path / "secret"
    outside.write_text("1")
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    os.symlink(outside, verifier / "reward.txt")
    reading = read_reward(verifier)
    assert reading.reward is None and "symbolic link" in str(reading.error)
    os.symlink("/etc/hostname", verifier / "reward.json")  # the first file read is the link too
    assert "symbolic link" in str(read_reward(verifier).error)


def test_a_directory_named_like_the_reward_is_refused(tmp_path) -> None:
    (tmp_path / "reward.txt").mkdir()
    assert "not a regular file" in str(read_reward(tmp_path).error)


def test_config_typos_fail_when_the_evaluator_is_built() -> None:
    with pytest.raises(EvaluatorConfigError, match="timout"):
        HarborVerifier({"timout": 3})
    with pytest.raises(EvaluatorConfigError):
        HarborVerifier({"missing_reward": "maybe"})


# -- running a task's tests in a real sandbox --------------------------------------------------------------------

def _context(request_runtime: Runtime, spec: SessionSpec) -> EvalContext:
    return EvalContext(spec=spec, trajectory=Trajectory(session_id=spec.session_id), harness_result=ExecResult(
        status=ExecStatus.OK, exit_code=0), runtime=request_runtime)


@contextlib.asynccontextmanager
async def _task_runtime(tmp_path: Path, task_id: str, root: Path = DATA / "tasks",
                        **overrides: object) -> AsyncIterator[tuple[Runtime, SessionSpec, HarborVerifier]]:
    """The task's runtime as tasks=harbor builds it (local: the Dockerfile replayed, Harbor's dirs linked)."""
    task = find_tasks(root, [task_id])[0]
    runtime_spec = task.runtime(RuntimeSpec(network="none"))
    spec = SessionSpec(task_id=task_id, instruction=task.instruction, runtime=runtime_spec,
                       agent={"harness": "shell"}, evaluator=task.evaluator(overrides=dict(overrides)))
    evaluator = load_evaluator(spec.evaluator)
    assert isinstance(evaluator, HarborVerifier)
    session = tmp_path / "sandbox"
    session.mkdir(parents=True)
    async with LocalRuntime(runtime_spec, session) as rt:
        await run_prepare(rt, runtime_spec.prepare)
        yield rt, spec, evaluator


async def _sh(rt: Runtime, command: str) -> None:
    result = await rt.exec(["bash", "-c", command], timeout=60)
    assert result.ok, (command, result.stdout, result.stderr)


@needs_bwrap
async def test_the_tests_score_the_task_before_and_after_the_fix_and_are_hidden_until_then(tmp_path) -> None:
    async with _task_runtime(tmp_path, "fix-median") as (rt, spec, evaluator):
        assert spec.runtime.workdir == "/app"
        seen = await rt.exec("pwd; ls /tests | wc -l; ls /solution | wc -l; ls", timeout=30)
        assert seen.stdout.decode().split() == ["/app", "0", "0", "notes", "stats.py"]  # the RUN made notes/
        before = await evaluator.evaluate(_context(rt, spec))
        assert before.reward == 0.0 and before.passed is False
        assert before.details["reward_file"] == "reward.txt" and "1/5 cases pass" in before.details["output"]
        await _sh(rt, "printf '%s\\n' 'def median(v):' "
                      "'    s = sorted(v); n = len(s)' "
                      "'    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2' > /app/stats.py")
        after = await evaluator.evaluate(_context(rt, spec))
        assert (after.reward, after.passed, after.details["reason"]) == (1.0, True, "reward from reward.txt")
        # the verifier's env (MEDIAN_CASES from task.toml) reached the tests
        assert "5/5 cases pass" in after.details["output"]


@needs_bwrap
async def test_a_stale_reward_and_files_the_agent_left_in_tests_are_removed_before_the_tests_run(tmp_path) -> None:
    async with _task_runtime(tmp_path, "edit-greeting") as (rt, spec, evaluator):
        await _sh(rt, "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && "
                      "echo '{\"reward\": 1}' > /logs/verifier/reward.json && mkdir -p /tests/sub && "
                      "echo planted > /tests/sub/conftest.py")
        result = await evaluator.evaluate(_context(rt, spec))
        assert result.reward == 0.0 and result.details["reward_file"] == "reward.txt"
        listing = await rt.exec("cd /tests && find . -type f | sort", timeout=30)
        assert listing.stdout.decode().split() == ["./test.sh"]


@needs_bwrap
async def test_a_reward_json_with_several_keys_scores_their_mean(tmp_path) -> None:
    async with _task_runtime(tmp_path, "count-words") as (rt, spec, evaluator):
        await _sh(rt, "echo '{\"apple\": 3}' > /app/counts.json")
        result = await evaluator.evaluate(_context(rt, spec))
        assert result.reward == 0.5 and result.details["rewards"] == {"parses": 1.0, "correct": 0.0}


@needs_bwrap
async def test_no_reward_is_a_zero_or_an_error_as_configured(tmp_path) -> None:
    async with _task_runtime(tmp_path, "edit-greeting", script="missing.sh") as (rt, spec, evaluator):
        result = await evaluator.evaluate(_context(rt, spec))
        assert result.reward == 0.0 and "no reward file" in result.details["reason"]
    async with _task_runtime(tmp_path / "b", "edit-greeting", script="missing.sh",
                             missing_reward="error") as (rt, spec, evaluator):
        with pytest.raises(EvaluationError, match="no usable reward"):
            await evaluator.evaluate(_context(rt, spec))


@needs_bwrap
async def test_a_reward_link_planted_by_the_agent_reads_nothing_outside(tmp_path) -> None:
    secret = tmp_path / "host-secret"
    secret.write_text("1")
    async with _task_runtime(tmp_path / "a", "edit-greeting", script="plant.sh") as (rt, spec, evaluator):
        evaluator.options.tests.append(evaluator.options.tests[0].model_copy(update={
            "path": "plant.sh", "data": base64.b64encode(
                f"#!/bin/sh\nln -sf {secret} /logs/verifier/reward.txt\n".encode()).decode()}))
        result = await evaluator.evaluate(_context(rt, spec))
        assert result.reward == 0.0 and "symbolic link" in result.details["reason"]


@needs_bwrap
async def test_the_verifier_timeout_ends_the_tests_with_zero(tmp_path) -> None:
    async with _task_runtime(tmp_path, "edit-greeting", script="slow.sh", timeout=1) as (rt, spec, evaluator):
        evaluator.options.tests.append(evaluator.options.tests[0].model_copy(update={
            "path": "slow.sh", "data": base64.b64encode(
                b"#!/bin/sh\necho 1 > /logs/verifier/reward.txt\nexec sleep 30\n").decode()}))
        result = await evaluator.evaluate(_context(rt, spec))
        assert result.reward == 0.0 and "timed out after 1s" in result.details["reason"]


@needs_bwrap
@pytest.mark.parametrize("missing_reward", ["zero", "error"])
async def test_a_reward_json_whose_mean_overflows_is_an_invalid_reward_not_a_zero(tmp_path, missing_reward) -> None:
    """Issue 35: each value was checked but not their mean; inf went out as null and the server looped on it."""
    async with _task_runtime(tmp_path, "edit-greeting", script="huge.sh",
                             missing_reward=missing_reward) as (rt, spec, evaluator):
        evaluator.options.tests.append(evaluator.options.tests[0].model_copy(update={
            "path": "huge.sh", "data": base64.b64encode(
                b"#!/bin/sh\necho 1 > /logs/verifier/reward.txt\n"
                b"echo '{\"a\": 1e308, \"b\": 1e308}' > /logs/verifier/reward.json\n").decode()}))
        with pytest.raises(InvalidReward, match=r"reward.json\['a'\] is 1e\+308, not finite or beyond"):
            await evaluator.evaluate(_context(rt, spec))


def test_a_task_dir_that_is_not_one_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no Harbor task"):
        find_tasks(tmp_path)


async def test_without_a_runtime_or_harbors_directories_it_is_an_evaluation_error(tmp_path) -> None:
    evaluator = HarborVerifier({})
    spec = SessionSpec(task_id="t", instruction="i", agent={"harness": "shell"})
    ctx = EvalContext(spec=spec, trajectory=Trajectory(session_id=spec.session_id), harness_result=None, runtime=None)
    with pytest.raises(EvaluationError, match="needs the session's runtime"):
        await evaluator.evaluate(ctx)
    if shutil.which("bwrap") is not None:  # a sandbox without the links: /logs cannot be made in its read-only root
        async with LocalRuntime(RuntimeSpec(network="none"), tmp_path / "s") as rt:
            with pytest.raises(EvaluationError, match="could not prepare /logs/verifier"):
                await evaluator.evaluate(_context(rt, spec))


@needs_bwrap
async def test_harbors_own_template_task_parses_and_its_empty_verifier_scores_zero_with_the_reason(tmp_path) -> None:
    """tests/data/harbor/template: what `harbor init` writes (Apache-2.0, see its NOTICE)."""
    async with _task_runtime(tmp_path, "harbor-init", root=DATA / "template") as (rt, spec, evaluator):
        assert spec.runtime.workdir == "/app" and spec.evaluator.config.model_dump()["timeout"] == 900.0
        result = await evaluator.evaluate(_context(rt, spec))
        assert result.reward == 0.0 and "no reward file" in result.details["reason"]
