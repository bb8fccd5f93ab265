"""``swebench_harness``: grade a SWE-bench instance with the official ``swebench`` package, in our fresh runtime.

What is ours and what is theirs: we take the agent's diff from the live runtime (excluding binary files, the files
the instance's test patch owns, test files and configured globs), apply it in a fresh runtime of the instance's image
with fallbacks, and run the eval script there. The test spec (``make_test_spec``: eval script, log parser, FAIL_TO_PASS
/ PASS_TO_PASS) and the grading of the log (``get_eval_report``) are swebench's own; none of its Docker code is used.

Config::

    instance: {...}          # a SWE-bench instance (swebench 5.x fields: instance_id, image, repo, version,
                             #   FAIL_TO_PASS, PASS_TO_PASS, log_parser, eval_type, eval_script; base_commit and
                             #   test_patch used when present)
    repo_dir: /testbed
    timeout: 1800            # for the eval script
    patch_command: null      # default: diff against instance.base_commit (else HEAD), untracked files included
    exclude: [...]           # extra globs dropped from the patch (DEFAULT_EXCLUDES by default)
    exclude_binary: true
    exclude_tests: true      # drop the agent's edits to test files (a conftest.py can print fake PASSED lines)
    partial_credit: false    # reward = FAIL_TO_PASS fraction when PASS_TO_PASS all hold, instead of 0/1

The package is an optional extra (``pip install 'polar_gym[swebench]'``): it pulls in datasets, docker and modal.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import tempfile
from types import SimpleNamespace
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from polar_gym.evaluate.base import EvalContext, Evaluator
from polar_gym.evaluate.errors import EvaluationError, EvaluatorConfigError, MissingRuntimeError
from polar_gym.evaluate.patches import (
    TEST_FILE_GLOBS,
    PatchConfig,
    PatchExtractionError,
    apply_patch,
    check_ran,
    extract_patch,
    filter_patch,
    output_tail,
    patch_command,
    patch_paths,
)
from polar_gym.runtime.base import ExecStatus
from polar_gym.schema import AgentSpec, EvalResult, EvaluatorSpec, RuntimeSpec, TaskRequest

__all__ = [
    "SwebenchConfig",
    "SwebenchHarness",
    "SwebenchMissing",
    "grade_log",
    "load_swebench",
    "swebench_task",
]

_INSTALL_HINT = "pip install 'polar_gym[swebench]' (the swebench package)"


class SwebenchMissing(EvaluatorConfigError):
    """The ``swebench`` package is not installed."""


class SwebenchConfig(PatchConfig):
    model_config = ConfigDict(extra="forbid")

    instance: dict[str, Any] = Field(description="the SWE-bench instance (a dataset row brings it)")
    repo_dir: str = Field(default="/testbed", description="the repository inside the instance's image")
    timeout: float = Field(default=1800.0, gt=0, description="seconds the eval script may take")
    eval_script_path: str = Field(default="/tmp/polar_eval/eval.sh", description="where swebench's eval script "
                                  "is written in the fresh runtime")
    exclude_binary: bool = Field(default=True, description="leave binary files out of the patch")
    exclude_tests: bool = Field(default=True, description="drop the agent's changes to the files the test patch "
                                "owns and to test files")
    partial_credit: bool = Field(default=False, description="reward FAIL_TO_PASS's share when PASS_TO_PASS holds")
    model_name: str = Field(default="polar_gym", description="the model name in swebench's prediction")


def load_swebench() -> Any:
    """swebench's grading and test-spec functions, imported on first use (about a second: keep it off the loop)."""
    try:
        from swebench.harness import grading
        from swebench.harness.utils import make_test_spec
    except ImportError as exc:
        raise SwebenchMissing(f"swebench_harness needs the swebench package: {_INSTALL_HINT}") from exc

    return SimpleNamespace(make_test_spec=make_test_spec, get_eval_report=grading.get_eval_report,
                           compute_fail_to_pass=grading.compute_fail_to_pass,
                           compute_pass_to_pass=grading.compute_pass_to_pass)


def grade_log(instance: dict[str, Any], log: str, model_patch: str | None = "", *, model_name: str = "polar_gym",
              partial_credit: bool = False) -> tuple[float, dict[str, Any]]:
    """Grade an eval-script log with swebench's own functions: (reward, swebench's report for the instance).

    Blocking (imports swebench, writes a temporary file): call it through ``asyncio.to_thread``.
    """
    api = load_swebench()
    spec = api.make_test_spec(instance)
    prediction = {"instance_id": spec.instance_id, "model_name_or_path": model_name, "model_patch": model_patch}
    fd, path = tempfile.mkstemp(prefix="polar_swebench_", suffix=".log")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
            f.write(log)
        report = api.get_eval_report(test_spec=spec, prediction=prediction, test_log_path=path,
                                     include_tests_status=True)[spec.instance_id]
    finally:
        os.unlink(path)
    reward = 1.0 if report.get("resolved") else 0.0
    status = report.get("tests_status")
    if partial_credit and status and not report.get("resolved"):
        if api.compute_pass_to_pass(status) == 1:
            reward = float(api.compute_fail_to_pass(status))
    return reward, report


class SwebenchHarness(Evaluator):
    name: ClassVar[str] = "swebench_harness"
    needs_fresh_runtime: ClassVar[bool] = True
    config_model: ClassVar[type[BaseModel]] = SwebenchConfig

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        try:
            self.options = SwebenchConfig.model_validate(self.config)
        except ValidationError as exc:
            raise EvaluatorConfigError(f"swebench_harness config: {exc}") from exc
        if importlib.util.find_spec("swebench") is None:
            raise SwebenchMissing(f"swebench_harness needs the swebench package: {_INSTALL_HINT}")

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        opts = self.options
        if ctx.runtime is None or ctx.fresh_runtime is None:
            raise MissingRuntimeError("swebench_harness needs the live runtime (for the patch) and a fresh one "
                                      "(to run the eval script)")
        api = await asyncio.to_thread(load_swebench)
        try:
            spec = await asyncio.to_thread(api.make_test_spec, opts.instance)
        except (KeyError, ValueError, TypeError) as exc:
            raise EvaluatorConfigError(f"swebench could not build a test spec from the instance: {exc!r}") from exc
        details: dict[str, Any] = {"instance_id": spec.instance_id}

        base = opts.instance.get("base_commit") or "HEAD"
        try:
            raw = await extract_patch(ctx.runtime, opts.patch_command or patch_command(base), cwd=opts.repo_dir,
                                      timeout=opts.timeout)
        except PatchExtractionError as exc:
            return _fail(str(exc), details)
        test_patch = opts.instance.get("test_patch") or ""
        owned = patch_paths(test_patch) if test_patch.strip() else []
        exclude = [*opts.exclude, *(TEST_FILE_GLOBS if opts.exclude_tests else ())]
        filtered = filter_patch(raw, exclude=exclude, exclude_binary=opts.exclude_binary, exclude_paths=owned)
        details["patch"] = {"files": filtered.kept, "dropped": filtered.dropped,
                            "bytes": len(filtered.text.encode("utf-8", "surrogateescape"))}
        if not filtered.text.strip():
            return _fail("the agent's patch is empty (after excludes)", details)
        outcome = await apply_patch(ctx.fresh_runtime, filtered.text, cwd=opts.repo_dir, path=opts.patch_path,
                                    timeout=opts.timeout)
        details["patch"].update(outcome.summary())
        if not outcome.applied:
            return _fail("the patch did not apply in the fresh runtime", details)

        await ctx.fresh_runtime.upload(spec.eval_script.encode(), opts.eval_script_path)
        result = check_ran(await ctx.fresh_runtime.exec(["/bin/bash", "-c", f"/bin/bash {opts.eval_script_path} 2>&1"],
                                                        cwd=opts.repo_dir, timeout=opts.timeout), "eval script")
        log = result.stdout.decode(errors="replace") + result.stderr.decode(errors="replace")
        ctx.artifacts["swebench_test_output"] = log
        details.update(eval_status=result.status.value, eval_exit_code=result.exit_code,
                       eval_seconds=round(result.seconds, 3), output=output_tail(log.encode()))
        if result.status is ExecStatus.TIMEOUT:
            return _fail(f"the eval script timed out after {opts.timeout:g}s", details)
        try:
            reward, report = await asyncio.to_thread(grade_log, opts.instance, log, filtered.text,
                                                     model_name=opts.model_name, partial_credit=opts.partial_credit)
        except (KeyError, ValueError) as exc:
            raise EvaluationError(f"swebench could not grade the log: {exc!r}") from exc
        details["report"] = report
        resolved = bool(report.get("resolved"))
        details["reason"] = "resolved" if resolved else "not resolved"
        return EvalResult(reward=reward, passed=resolved, details=details)


def _fail(reason: str, details: dict[str, Any]) -> EvalResult:
    return EvalResult(reward=0.0, passed=False, details={**details, "reason": reason})


def swebench_task(instance: dict[str, Any], *, agent: AgentSpec | None = None, backend: str = "docker",
                  repo_dir: str = "/testbed", timeout_seconds: float = 3600.0, num_samples: int = 1,
                  evaluator_config: dict[str, Any] | None = None) -> TaskRequest:
    """A TaskRequest for one SWE-bench instance: its image as the runtime, the issue as the instruction, and this
    evaluator in a fresh runtime."""
    config = {"instance": instance, "repo_dir": repo_dir, **(evaluator_config or {})}
    return TaskRequest(
        task_id=str(instance["instance_id"]),
        instruction=str(instance.get("problem_statement") or f"Resolve {instance['instance_id']}."),
        num_samples=num_samples,
        timeout_seconds=timeout_seconds,
        runtime=RuntimeSpec(backend=backend, image=instance.get("image"), workdir=repo_dir),
        agent=agent or AgentSpec(harness="shell"),
        evaluator=EvaluatorSpec(strategy="swebench_harness", refresh_runtime=True, config=config),
    )
