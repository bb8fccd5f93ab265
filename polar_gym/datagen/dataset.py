"""The dataset task source: a JSONL file of tasks, one per line, turned into TaskRequests for the ``tasks`` group.

Row shape (unknown keys are kept as SWE-bench instance fields, never silently dropped)::

    instance_id        required; becomes task_id (and metadata.group_id)
    repo               required; the stratification key of the export ("owner/name"), kept in metadata.repo
    instruction        what to ask; or problem_statement (SWE-bench); a demo row may omit both
    demo               a built-in demo task id: its repository, test command and oracle script are reused
    image              runtime image (else the template's)
    workdir            where the repository lives (alias repo_dir); default /testbed for SWE-bench rows,
                       else the template's runtime.workdir
    setup              shell command or list of commands run in workdir before the harness starts
    test_command       gives a test_on_output evaluator running it in workdir
    base_commit, version, FAIL_TO_PASS, PASS_TO_PASS, test_patch, ...
                       SWE-bench fields: a row with FAIL_TO_PASS is a SWE-bench instance and gets the
                       swebench_harness evaluator with the row as ``config.instance``

Evaluator precedence (as ``demo_requests``): the row implies an evaluator (demo → the demo's tests, test_command →
test_on_output, FAIL_TO_PASS → swebench_harness); when the template (the ``evaluator`` group) names the same
strategy, the template's config keys override the row's; when it names another strategy, the template wins as is.
A test_on_output evaluator without a command, or swebench_harness without a SWE-bench row, is refused at load time.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from polar_gym.datagen.template import TaskTemplate
from polar_gym.schema import AgentSpec, EvaluatorSpec, PrepareAction, TaskMetadata, TaskRequest
from polar_gym.tasks import DEMO_TASKS

__all__ = ["DatasetError", "DatasetRow", "dataset_requests", "load_dataset", "row_request"]

#: keys of a row that are ours, not SWE-bench instance fields (swebench 5.x instances carry `image` too)
_OWN_KEYS = {"demo", "instruction", "workdir", "repo_dir", "setup", "test_command"}
SWEBENCH_WORKDIR = "/testbed"


class DatasetError(ValueError):
    """A dataset file or row that cannot become a task; the message names the file and line."""


class DatasetRow(BaseModel):
    """One task of a dataset file. Extra keys (SWE-bench fields) are kept and passed to swebench_harness."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    instance_id: str = Field(min_length=1)
    repo: str = Field(min_length=1)
    instruction: str | None = None
    problem_statement: str | None = None
    demo: str | None = None
    image: str | None = None
    workdir: str | None = Field(default=None, alias="repo_dir")
    setup: list[str] = Field(default_factory=list)
    test_command: str | None = None
    base_commit: str | None = None
    version: str | None = None
    #: line of the dataset file the row came from (0: not from a file)
    _line: int = PrivateAttr(default=0)

    @field_validator("setup", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("version", mode="before")
    @classmethod
    def _version_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int | float) else value  # SWE-bench writes 0.12 or "0.12"

    @model_validator(mode="after")
    def _check(self) -> DatasetRow:
        if self.demo is not None and self.demo not in DEMO_TASKS:
            raise ValueError(f"unknown demo task {self.demo!r}; known: {', '.join(DEMO_TASKS)}")
        if self.demo is None and not (self.instruction or self.problem_statement):
            raise ValueError("needs an instruction (or problem_statement), or a demo task id")
        return self

    @property
    def is_swebench(self) -> bool:
        return "FAIL_TO_PASS" in (self.model_extra or {})

    def swebench_instance(self) -> dict[str, Any]:
        """The row as a SWE-bench instance (every field but ours)."""
        data = self.model_dump(by_alias=False, exclude_none=True)
        return {k: v for k, v in data.items() if k not in _OWN_KEYS}


def load_dataset(path: str | Path) -> list[DatasetRow]:
    """Every row of a JSONL dataset (blank lines and lines starting with ``#`` skipped). A bad line raises
    DatasetError naming ``path:line`` and the field at fault; a repeated instance_id is an error too."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"cannot read dataset {path}: {exc.strerror or exc}") from None
    rows: list[DatasetRow] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(data, dict):
            raise DatasetError(f"{where}: a row must be a JSON object, got {type(data).__name__}")
        try:
            row = DatasetRow.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'row'}: {e['msg']}" for e in exc.errors())
            raise DatasetError(f"{where}: {problems}") from None
        if row.instance_id in seen:
            raise DatasetError(f"{where}: instance_id {row.instance_id!r} repeats line {seen[row.instance_id]}")
        seen[row.instance_id] = number
        row._line = number
        rows.append(row)
    return rows


def _row_evaluator(row: DatasetRow, workdir: str, template: TaskTemplate) -> EvaluatorSpec | None:
    """The evaluator the row itself implies, or None."""
    refresh = template.evaluator.refresh_runtime
    if row.demo is not None and row.test_command is None:
        return DEMO_TASKS[row.demo].evaluator(refresh_runtime=refresh, workdir=workdir)
    if row.test_command is not None:
        return EvaluatorSpec(strategy="test_on_output", refresh_runtime=refresh,
                             config={"command": row.test_command, "repo_dir": workdir})
    if row.is_swebench:
        return EvaluatorSpec(strategy="swebench_harness", refresh_runtime=True,
                             config={"instance": row.swebench_instance(), "repo_dir": workdir})
    return None


def _evaluator(row: DatasetRow, workdir: str, template: TaskTemplate) -> EvaluatorSpec:
    own = _row_evaluator(row, workdir, template)
    chosen = template.evaluator
    if own is not None and own.strategy == chosen.strategy:
        config = {**own.config.model_dump(), **chosen.config.model_dump()}
        chosen = chosen.model_copy(update={"config": type(chosen.config)(**config),
                                           "refresh_runtime": own.refresh_runtime or chosen.refresh_runtime})
    config = chosen.config.model_dump()
    if chosen.strategy == "test_on_output" and not config.get("command"):
        raise ValueError("evaluator test_on_output needs a command: give the row a test_command (or demo), "
                         "set evaluator.config.command, or pick another evaluator (swebench_harness for SWE-bench "
                         "rows)")
    if chosen.strategy == "swebench_harness" and not config.get("instance"):
        raise ValueError("evaluator swebench_harness needs a SWE-bench row (with FAIL_TO_PASS)")
    return chosen


def _metadata(row: DatasetRow, base: TaskMetadata | None = None) -> TaskMetadata:
    extra = {"repo": row.repo, "instance_id": row.instance_id, "base_commit": row.base_commit,
             "version": row.version}
    data = {**(base.model_dump() if base is not None else {}),
            **{k: v for k, v in extra.items() if v is not None}, "group_id": row.instance_id}
    return TaskMetadata(**data)


def row_request(row: DatasetRow, template: TaskTemplate) -> TaskRequest:
    """One row as a TaskRequest shaped by ``template`` (raises ValueError when the evaluator cannot work)."""
    runtime = template.runtime
    workdir = row.workdir or (SWEBENCH_WORKDIR if row.is_swebench else runtime.workdir)
    runtime = runtime.model_copy(update={"workdir": workdir, "image": row.image or runtime.image})
    setup = [PrepareAction(type="exec", command=f"cd {shlex.quote(workdir)} && {command}", timeout_seconds=600)
             for command in row.setup]
    runtime = runtime.model_copy(update={"prepare": [*runtime.prepare, *setup]})
    evaluator = _evaluator(row, workdir, template)
    agent = template.agent if template.agent.config else AgentSpec(harness=template.agent.harness,
                                                                    model_name=template.agent.model_name)
    if row.demo is not None:
        request = DEMO_TASKS[row.demo].to_request(
            harness=agent.harness, model_name=agent.model_name, runtime=runtime, evaluator=evaluator,
            builder=template.builder, num_samples=template.num_samples, timeout_seconds=template.timeout_seconds)
        instruction = row.instruction or row.problem_statement or request.instruction
        request = request.model_copy(update={"task_id": row.instance_id, "instruction": instruction,
                                             "agent": agent, "metadata": _metadata(row, request.metadata)})
    else:
        request = TaskRequest(task_id=row.instance_id, instruction=row.instruction or row.problem_statement or "",
                              num_samples=template.num_samples, timeout_seconds=template.timeout_seconds,
                              runtime=runtime, agent=agent, builder=template.builder, evaluator=evaluator,
                              metadata=_metadata(row))
    return TaskRequest.model_validate(request.model_dump())  # re-validate the whole request


def dataset_requests(template: TaskTemplate, path: str, limit: int | None = None,
                     ids: list[str] | None = None) -> list[TaskRequest]:
    """The ``tasks=dataset`` source: the rows of the JSONL file at ``path`` (those in ``ids``, in file order; then
    the first ``limit``) as TaskRequests shaped by ``template``. Errors name the file and line."""
    rows = load_dataset(path)
    if ids is not None:
        known = {r.instance_id for r in rows}
        unknown = [i for i in ids if i not in known]
        if unknown:
            raise DatasetError(f"{path}: unknown instance_id(s) {unknown}")
        wanted = set(ids)
        rows = [r for r in rows if r.instance_id in wanted]
    if limit is not None:
        if limit < 0:
            raise DatasetError(f"limit must be >= 0, got {limit}")
        rows = rows[:limit]
    requests = []
    for row in rows:
        try:
            requests.append(row_request(row, template))
        except (ValueError, ValidationError) as exc:
            raise DatasetError(f"{path}:{row._line} ({row.instance_id}): {exc}") from None
    return requests

