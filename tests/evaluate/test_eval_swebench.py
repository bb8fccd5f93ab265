"""swebench_harness: grading with the real ``swebench`` functions (canned logs), and a whole evaluation of a
SWE-bench-shaped instance over a demo repository in real local sandboxes (eval script run in the fresh one)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from polar_gym.evaluate import MissingRuntimeError, load_evaluator
from polar_gym.evaluate.swebench_harness import SwebenchHarness, SwebenchMissing, swebench_task
from polar_gym.schema import AgentSpec, EvaluatorSpec
from polar_gym.tasks import demo_task
from tests.evaluate._evalkit import context, needs_bwrap, solve

HAVE_SWEBENCH = importlib.util.find_spec("swebench") is not None
needs_swebench = pytest.mark.skipif(not HAVE_SWEBENCH, reason="the swebench package is not installed "
                                    "(pip install 'polar_gym[swebench]')")

START, END = ">>>>> Start Test Output", ">>>>> End Test Output"

PYTEST_INSTANCE = {
    "instance_id": "polar__demo-1", "image": "polar/demo:latest", "repo": "polar/demo", "version": "0.1",
    "FAIL_TO_PASS": json.dumps(["tests/test_a.py::test_fixed", "tests/test_a.py::test_fixed_too"]),
    "PASS_TO_PASS": json.dumps(["tests/test_a.py::test_old"]),
    "log_parser": "parse_log_pytest", "eval_type": "pass_and_fail",
    "eval_script": f"#!/bin/bash\nset -uxo pipefail\ncd /testbed\necho '{START}'\npytest -rA tests/test_a.py\n"
                   f"echo '{END}'\n",
}


def _pytest_log(*lines: str, exit_code: int = 0) -> str:
    return "\n".join(["+ cd /testbed", START, "=== short test summary info ===", *lines, "=== 3 run in 0.1s ===",
                      END, f">>>>> Test Exit Code: {exit_code}", ""])


@needs_swebench
@pytest.mark.parametrize(("lines", "exit_code", "reward", "partial", "resolved"), [
    (["PASSED tests/test_a.py::test_fixed", "PASSED tests/test_a.py::test_fixed_too",
      "PASSED tests/test_a.py::test_old"], 0, 1.0, 1.0, True),
    (["PASSED tests/test_a.py::test_fixed", "FAILED tests/test_a.py::test_fixed_too - assert 1 == 2",
      "PASSED tests/test_a.py::test_old"], 1, 0.0, 0.5, False),
    (["PASSED tests/test_a.py::test_fixed", "PASSED tests/test_a.py::test_fixed_too",
      "FAILED tests/test_a.py::test_old"], 1, 0.0, 0.0, False),
])
def test_grade_canned_logs_with_swebench(lines, exit_code, reward, partial, resolved) -> None:
    from polar_gym.evaluate.swebench_harness import grade_log

    log = _pytest_log(*lines, exit_code=exit_code)
    got, report = grade_log(PYTEST_INSTANCE, log, "diff --git a/x b/x\n")
    assert got == reward and report["resolved"] is resolved and report["patch_successfully_applied"]
    assert set(report["tests_status"]) >= {"FAIL_TO_PASS", "PASS_TO_PASS"}
    assert grade_log(PYTEST_INSTANCE, log, "d", partial_credit=True)[0] == partial


@needs_swebench
def test_grade_log_without_markers_is_not_resolved() -> None:
    from polar_gym.evaluate.swebench_harness import grade_log

    reward, report = grade_log(PYTEST_INSTANCE, "+ git apply\nerror: patch failed\n", "d")
    assert reward == 0.0 and not report["resolved"] and not report["patch_successfully_applied"]


def test_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import polar_gym.evaluate.swebench_harness as mod

    real = mod.importlib.util.find_spec
    monkeypatch.setattr(mod.importlib.util, "find_spec", lambda name, *a: None if name == "swebench" else real(name))
    with pytest.raises(SwebenchMissing, match=r"polar_gym\[swebench\]"):
        SwebenchHarness({"instance": PYTEST_INSTANCE})


def test_swebench_task_request() -> None:
    request = swebench_task({**PYTEST_INSTANCE, "problem_statement": "Fix it."}, agent=AgentSpec(harness="pi"))
    assert request.task_id == "polar__demo-1" and request.instruction == "Fix it."
    assert request.runtime.image == "polar/demo:latest" and request.runtime.workdir == "/testbed"
    assert request.evaluator.strategy == "swebench_harness" and request.evaluator.refresh_runtime
    assert request.evaluator.config.model_dump()["instance"]["instance_id"] == "polar__demo-1"


# -- a whole evaluation over a demo repository, with a SWE-bench-shaped instance --------------------------------

TASK = demo_task("demo-calc-add")
F2P = "test_add (test_calc.CalcTest.test_add)"
P2P = "test_multiply (test_calc.CalcTest.test_multiply)"
DEMO_INSTANCE = {
    "instance_id": "polar__calc-1", "image": "local", "repo": "polar/calc", "version": "0.1",
    "FAIL_TO_PASS": [F2P], "PASS_TO_PASS": [P2P], "log_parser": "parse_log_django", "eval_type": "pass_and_fail",
    # the eval script restores the tests the instance owns, then runs them between swebench's markers
    "eval_script": "\n".join(["#!/bin/bash", "set -uxo pipefail", "cd /workspace", "git checkout HEAD -- test_calc.py",
                              f"echo '{START}'", "python3 -B -m unittest -v test_calc", f"echo '{END}'"]),
    "test_patch": "diff --git a/test_calc.py b/test_calc.py\n--- a/test_calc.py\n+++ b/test_calc.py\n@@ -1 +1 @@\n"
                  "-import unittest\n+import unittest  # owned by the instance\n",
}


def _evaluator() -> tuple[SwebenchHarness, EvaluatorSpec]:
    spec = EvaluatorSpec(strategy="swebench_harness", refresh_runtime=True,
                         config={"instance": DEMO_INSTANCE, "repo_dir": "/workspace", "timeout": 120})
    evaluator = load_evaluator(spec)
    assert isinstance(evaluator, SwebenchHarness) and evaluator.wants_fresh_runtime()
    return evaluator, spec


@needs_bwrap
@needs_swebench
async def test_swebench_end_to_end_resolved(demo_runtime) -> None:
    evaluator, spec = _evaluator()
    async with demo_runtime(TASK, "live") as live, demo_runtime(TASK, "fresh") as fresh:
        await solve(live, TASK)
        await live.exec("printf 'x' > blob.bin && printf '\\000\\001' >> blob.bin")  # binary: dropped
        ctx = context(TASK, runtime=live, fresh=fresh, evaluator=spec)
        result = await evaluator.evaluate(ctx)
        assert result.reward == 1.0 and result.passed, result.details
        assert result.details["patch"]["files"] == ["calc.py"]
        assert result.details["patch"]["dropped"] == {"blob.bin": "binary"}
        status = result.details["report"]["tests_status"]
        assert status["FAIL_TO_PASS"]["success"] == [F2P] and status["PASS_TO_PASS"]["success"] == [P2P]
        assert ">>>>> Test Exit Code: 0" in ctx.artifacts["swebench_test_output"]


@needs_bwrap
@needs_swebench
async def test_swebench_end_to_end_unresolved_and_tampering(demo_runtime) -> None:
    evaluator, spec = _evaluator()
    async with demo_runtime(TASK, "live") as live, demo_runtime(TASK, "fresh") as fresh:
        # nothing done: an empty patch scores 0 without running anything
        result = await evaluator.evaluate(context(TASK, runtime=live, fresh=fresh, evaluator=spec))
        assert result.reward == 0.0 and "empty" in result.details["reason"]
        # "solving" by editing the test: the change is dropped (the instance owns that file)
        await live.exec("sed -i 's/add(2, 3), 5/add(2, 3), -1/; s/add(-1, 1), 0/add(-1, 1), -2/' test_calc.py")
        await live.exec("printf 'import unittest\\n' > helper_used.py")
        result = await evaluator.evaluate(context(TASK, runtime=live, fresh=fresh, evaluator=spec))
        assert result.reward == 0.0 and result.passed is False, result.details
        assert "test_calc.py" in result.details["patch"]["dropped"]
        assert result.details["report"]["tests_status"]["FAIL_TO_PASS"]["failure"] == [F2P]


@needs_swebench
async def test_swebench_needs_both_runtimes() -> None:
    evaluator, spec = _evaluator()
    with pytest.raises(MissingRuntimeError):
        await evaluator.evaluate(context(TASK, runtime=None, evaluator=spec))
