"""``test_on_output``: run a test command where the agent worked (or in a fresh copy of the task) and score it.

Config (``EvaluatorSpec.config``)::

    command: "python3 -m unittest -q"   # str for sh -c, or argv
    cwd: null                # where to run it; default repo_dir, else the runtime's workdir
    repo_dir: null           # the repository (paper field): where the patch is taken and applied
    timeout: 600
    expected_exit_code: 0    # null: do not check
    output_regex: null       # must match stdout+stderr (re.M) when set
    framework: auto          # pytest | unittest | auto | none: which summary to parse into details
    fractional: false        # reward = passed / total tests, when a summary was parsed
    min_tests: 0             # fail unless the summary reports at least this many tests
    runtime: live            # or fresh (as does EvaluatorSpec.refresh_runtime)
    patch_command: null      # fresh only; default: diff of the live repo against base_ref, untracked files too
    base_ref: HEAD
    exclude: [*.pyc, ...]    # fresh only; globs of files left out of the patch
    exclude_binary: false
    exclude_tests: false     # also drop the agent's changes to test files (TEST_FILE_GLOBS)

Why fresh: what the agent did to its sandbox beyond the repository (a patched site-packages, a faked ``python3``)
should not decide the reward; only the repository's diff crosses over, applied with fallbacks.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from polar_gym.evaluate.base import EvalContext, Evaluator
from polar_gym.evaluate.errors import EvaluatorConfigError, MissingRuntimeError
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
)
from polar_gym.evaluate.results import parse_summary
from polar_gym.runtime.base import ExecStatus, Runtime
from polar_gym.schema import EvalResult, EvaluatorSpec

__all__ = ["TestOnOutput", "TestOnOutputConfig"]


class TestOnOutputConfig(PatchConfig):
    """Unknown keys are rejected so a typo (``expected_exit``) fails when the evaluator is built."""

    __test__ = False
    model_config = ConfigDict(extra="forbid")

    command: str | list[str] = Field(description="the test command: a string for sh -c, or argv (demo tasks "
                                     "bring their own)")
    cwd: str | None = Field(default=None, description="where to run it; default repo_dir, else the runtime's "
                            "workdir")
    repo_dir: str | None = Field(default=None, description="the repository: where the patch is taken and applied")
    timeout: float = Field(default=600.0, gt=0, description="seconds the test command may take")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of the test command")
    expected_exit_code: int | None = Field(default=0, description="the exit code that passes (null: not checked)")
    output_regex: str | None = Field(default=None, description="must match stdout+stderr (re.M) when set")
    framework: Literal["auto", "pytest", "unittest", "none"] = Field(
        default="auto", description="which test summary to parse into details")
    fractional: bool = Field(default=False, description="reward = passed / total tests, when a summary was parsed")
    min_tests: int = Field(default=0, ge=0, description="fail unless the summary reports at least this many tests")
    runtime: Literal["live", "fresh"] = Field(default="live", description="live: in the session's sandbox; fresh: "
                                              "the repository's diff applied in a fresh copy of the task")
    base_ref: str = Field(default="HEAD", description="fresh only: what the patch is taken against")
    #: paper field, unused here
    instance: Any = Field(default=None, description="unused here: lets one config serve several evaluators")

    @field_validator("output_regex")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"output_regex does not compile: {exc}") from exc
        return value


class TestOnOutput(Evaluator):
    __test__ = False
    name: ClassVar[str] = "test_on_output"
    config_model: ClassVar[type[BaseModel]] = TestOnOutputConfig

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        try:
            self.options = TestOnOutputConfig.model_validate(self.config)
        except ValidationError as exc:
            raise EvaluatorConfigError(f"test_on_output config: {exc}") from exc

    def wants_fresh_runtime(self, spec: EvaluatorSpec | None = None) -> bool:
        return self.options.runtime == "fresh" or super().wants_fresh_runtime(spec)

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        fresh = self.wants_fresh_runtime(ctx.spec.evaluator)
        details: dict[str, Any] = {"runtime": "fresh" if fresh else "live"}
        if ctx.runtime is None:
            raise MissingRuntimeError("test_on_output needs the session's live runtime"
                                      + (" (to take the patch from)" if fresh else ""))
        target: Runtime = ctx.runtime
        if fresh:
            if ctx.fresh_runtime is None:
                raise MissingRuntimeError("test_on_output is set to a fresh runtime but none was given")
            target = ctx.fresh_runtime
            failure = await self._transfer(ctx.runtime, target, details)
            if failure:
                return _fail(failure, details)
        return await self._run_tests(target, details)

    async def _transfer(self, live: Runtime, fresh: Runtime, details: dict[str, Any]) -> str | None:
        """Carry the live repository's diff into the fresh runtime; a reason when that fails."""
        opts = self.options
        command = opts.patch_command or patch_command(opts.base_ref)
        try:
            raw = await extract_patch(live, command, cwd=opts.repo_dir, timeout=opts.timeout)
        except PatchExtractionError as exc:
            return str(exc)
        exclude = [*opts.exclude, *(TEST_FILE_GLOBS if opts.exclude_tests else ())]
        filtered = filter_patch(raw, exclude=exclude, exclude_binary=opts.exclude_binary)
        outcome = await apply_patch(fresh, filtered.text, cwd=opts.repo_dir, path=opts.patch_path,
                                    timeout=opts.timeout)
        details["patch"] = {"bytes": len(filtered.text.encode("utf-8", "surrogateescape")), "files": filtered.kept,
                            "dropped": filtered.dropped, **outcome.summary()}
        return None if outcome.applied else "the patch did not apply in the fresh runtime"

    async def _run_tests(self, runtime: Runtime, details: dict[str, Any]) -> EvalResult:
        opts = self.options
        cwd = opts.cwd or opts.repo_dir
        result = check_ran(await runtime.exec(opts.command, cwd=cwd, env=opts.env or None, timeout=opts.timeout),
                           "test command")
        output = (result.stdout + b"\n" + result.stderr).decode(errors="replace")
        details.update(command=opts.command, status=result.status.value, exit_code=result.exit_code,
                       seconds=round(result.seconds, 3), output=output_tail(result.stdout + result.stderr))
        if result.status is ExecStatus.TIMEOUT:
            return _fail(f"the test command timed out after {opts.timeout:g}s", details)
        summary = None if opts.framework == "none" else parse_summary(output, opts.framework)
        if summary is not None:
            details["tests"] = summary.as_dict()
        reasons = []
        if opts.expected_exit_code is not None and result.exit_code != opts.expected_exit_code:
            reasons.append(f"exit code {result.exit_code}, expected {opts.expected_exit_code}")
        if opts.output_regex is not None:
            matched = re.search(opts.output_regex, output, re.M) is not None
            details["regex_matched"] = matched
            if not matched:
                reasons.append(f"output does not match {opts.output_regex!r}")
        if opts.min_tests and (summary is None or summary.total < opts.min_tests):
            reasons.append(f"fewer than {opts.min_tests} test(s) ran")
        passed = not reasons
        reward = 1.0 if passed else 0.0
        if opts.fractional and summary is not None and summary.total:
            reward = summary.fraction
        details["reason"] = "; ".join(reasons) or "all checks passed"
        return EvalResult(reward=reward, passed=passed, details=details)


def _fail(reason: str, details: dict[str, Any]) -> EvalResult:
    return EvalResult(reward=0.0, passed=False, details={**details, "reason": reason})
