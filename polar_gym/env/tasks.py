"""NeMo Gym rows to TaskRequests. A row's ``polar_task`` is either ``{"task_request": {...}}`` (a whole
TaskRequest, passed through) or a dataset row in the shape of :mod:`polar_gym.datagen.dataset` (``instance_id``,
``repo``, ``demo`` / ``instruction`` / ``test_command`` / SWE-bench fields), shaped by a template (harness, runtime,
builder, evaluator) the agent config supplies. ``{"demo": ID}`` alone is a demo task (instance_id = ID).

This runs in polar_gym's own interpreter (``python -m polar_gym.env request``): the Gym-side agent runs in NeMo
Gym's venv, which does not have polar_gym."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from polar_gym.datagen.dataset import DatasetRow, row_request
from polar_gym.datagen.template import TaskTemplate
from polar_gym.schema import AgentSpec, BuilderSpec, EvaluatorSpec, RuntimeSpec, TaskRequest

__all__ = ["EnvTemplate", "task_request"]


class EnvTemplate(BaseModel):
    """What the agent config's ``task_template`` may set for dataset rows (defaults: the launch defaults, pi on the
    local sandbox, prefix merging, the task's tests)."""

    model_config = ConfigDict(extra="forbid")

    harness: str = "pi"
    model_name: str = "policy"
    agent_config: dict[str, Any] = Field(default_factory=dict)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    builder: BuilderSpec = Field(default_factory=BuilderSpec)
    evaluator: EvaluatorSpec = Field(default_factory=lambda: EvaluatorSpec(strategy="test_on_output"))
    timeout_seconds: float = Field(default=600.0, gt=0)

    def task_template(self) -> TaskTemplate:
        return TaskTemplate(agent=AgentSpec(harness=self.harness, model_name=self.model_name,
                                            config=self.agent_config),
                            runtime=self.runtime, builder=self.builder, evaluator=self.evaluator, num_samples=1,
                            timeout_seconds=self.timeout_seconds)


def task_request(polar_task: dict[str, Any], template: EnvTemplate | None = None) -> TaskRequest:
    """The TaskRequest of one row's ``polar_task`` (raises ValueError / ValidationError when it cannot be one)."""
    if not isinstance(polar_task, dict):
        raise ValueError(f"polar_task must be an object, got {type(polar_task).__name__}")
    if "task_request" in polar_task:
        return TaskRequest.model_validate(polar_task["task_request"])
    row = dict(polar_task)
    if "demo" in row:
        row.setdefault("instance_id", row["demo"])
        row.setdefault("repo", "polar_gym/demo")
    return row_request(DatasetRow.model_validate(row), (template or EnvTemplate()).task_template())
