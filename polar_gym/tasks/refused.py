"""A task source's answer when some of its tasks cannot be used: the requests to run and the tasks it refused.

A task is untrusted input (DESIGN.md, invariant 9): a Harbor task directory with a link out of it, a FIFO, an
oversized file or an env name the host's loader reads is refused, and so is a task whose request does not validate.
One bad task does not stop the others: the launch runs the rest and reports each refused task as an ERROR session
with cause ``invalid_task`` (:data:`polar_gym.causes.INVALID_TASK`); only a set with no usable task stops it."""

from __future__ import annotations

from dataclasses import dataclass, field

from polar_gym.schema import TaskRequest

__all__ = ["RefusedTask", "TaskSet"]


@dataclass(frozen=True)
class RefusedTask:
    """A task its source read but will not run."""

    task_id: str
    #: why, naming the task (its path) and the problem
    problem: str


@dataclass(frozen=True)
class TaskSet:
    """What a task source may return instead of a plain list of requests."""

    requests: list[TaskRequest]
    refused: list[RefusedTask] = field(default_factory=list)
