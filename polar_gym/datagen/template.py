"""What every task of a run shares: the harness, runtime, builder and evaluator a task source shapes its
TaskRequests with (``launch``'s groups, ``polar_gym.env``'s agent config, a dataset file's loader)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from polar_gym.schema import AgentSpec, BuilderSpec, EvaluatorSpec, RuntimeSpec

__all__ = ["RunShape", "TaskTemplate"]


class RunShape(BaseModel):
    """How many sessions each task gets and how long each may take (the launch's top-level keys)."""

    model_config = ConfigDict(extra="forbid")

    num_samples: int = Field(default=1, ge=1, description="sessions per task (TaskRequest.num_samples)")
    timeout_seconds: float = Field(default=600.0, gt=0, description="each session's deadline, in seconds: its "
                                   "sandbox's set-up and its run (a wait for a gateway's run slot is not counted)")


class TaskTemplate(RunShape):
    """What every task of a run shares, from the harness/runtime/builder/evaluator groups; task sources fill in
    the rest. ``evaluator`` config keys override the task's own evaluator config when the strategies agree."""

    agent: AgentSpec
    runtime: RuntimeSpec
    builder: BuilderSpec
    evaluator: EvaluatorSpec
