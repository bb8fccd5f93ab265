"""One session's state on the node: its spec, where it is, what it holds, and how it ends.

Stage functions (:mod:`polar_gym.gateway.stages`) read and fill the working fields (runtime, harness result,
trajectory, evaluation); the node alone moves ``status`` and keeps the shared deadline, the timings and the history.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_gym.runtime.base import ExecResult, Runtime
from polar_gym.schema import EvalResult, SessionResult, SessionSpec, SessionStatus, SessionView, Trajectory

__all__ = ["STAGE_OF", "Session", "new_attempt_id", "stage_of"]

#: the stage (pool) a status belongs to, as reported by GET /sessions/{id} and the health endpoint
STAGE_OF: dict[SessionStatus, str] = {
    SessionStatus.REGISTERED: "queued",
    SessionStatus.INITIALIZING: "init",
    SessionStatus.READY: "ready",
    SessionStatus.RUNNING: "run",
    SessionStatus.POST_RUN: "postrun",
    SessionStatus.BUILDING: "postrun",
    SessionStatus.EVALUATING: "postrun",
}


def stage_of(status: SessionStatus) -> str:
    return STAGE_OF.get(status, "done")


def new_attempt_id() -> str:
    """A dispatch attempt's id: new for every POST /sessions, so a retried session (e.g. after a gateway was
    killed) never shares a workspace or a journal stream with an earlier attempt."""
    return uuid.uuid4().hex[:12]


@dataclass(eq=False)
class Session:
    spec: SessionSpec
    attempt_id: str = field(default_factory=new_attempt_id)
    status: SessionStatus = SessionStatus.REGISTERED
    history: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    #: loop time at which the shared deadline passes; set when INIT starts
    deadline: float | None = None
    # -- working fields, filled by the stage functions
    session_dir: Path | None = None
    runtime: Runtime | None = None
    eval_runtime: Runtime | None = None
    harness_result: ExecResult | None = None
    trajectory: Trajectory | None = None
    evaluation: EvalResult | None = None
    artifacts: dict[str, Any] = field(default_factory=dict)
    #: anything a stage implementation wants to carry between its stages
    scratch: dict[str, Any] = field(default_factory=dict)
    # -- outcome
    timed_out: bool = False
    problem: str | None = None  # a non-fatal failure (crashed harness) that makes the final status ERROR
    reason: str | None = None
    cancel_reason: str | None = None
    result: SessionResult | None = None
    task: asyncio.Task[None] | None = None
    driving: bool = False  # the driver task has started (and will tear down if cancelled)
    prewarm_task: asyncio.Task[None] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=time.time)

    @property
    def session_id(self) -> str:
        return self.spec.session_id

    @property
    def stage(self) -> str:
        return stage_of(self.status)

    @property
    def cancelled(self) -> bool:
        return self.cancel_reason is not None

    def start_deadline(self) -> None:
        self.deadline = asyncio.get_running_loop().time() + self.spec.timeout_seconds

    def refund(self, seconds: float) -> None:
        """Give back ``seconds`` the session waited for the gateway's own run slot: the timeout is the agent's budget
        (its sandbox's set-up and its run), not the gateway's queue, so a busy gateway does not cut runs short."""
        if self.deadline is not None:
            self.deadline += seconds

    def remaining(self) -> float:
        """Seconds left of the shared deadline (the full timeout before INIT started); never negative."""
        if self.deadline is None:
            return self.spec.timeout_seconds
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    def view(self) -> SessionView:
        """What GET /sessions/{id} answers (the wire type the rollout server's GatewayClient reads)."""
        return SessionView(session_id=self.session_id, attempt_id=self.attempt_id, task_id=self.spec.task_id,
                           status=self.status, stage=self.stage, reason=self.reason,
                           remaining_seconds=self.remaining(), timings=dict(self.timings), history=list(self.history))

    def describe(self) -> dict[str, Any]:
        return self.view().model_dump(mode="json")

    def to_result(self) -> SessionResult:
        harness = self.harness_result
        metadata: dict[str, Any] = {
            "sample_index": self.spec.sample_index,
            "attempt_id": self.attempt_id,
            "status_history": list(self.history),
            "task_metadata": self.spec.metadata.model_dump(),
            "artifacts": {k: v for k, v in self.artifacts.items() if isinstance(v, str | int | float | list | dict)},
        }
        if harness is not None:
            metadata["harness"] = {"status": harness.status.value, "exit_code": harness.exit_code,
                                   "seconds": harness.seconds, "reason": harness.reason,
                                   "oom_kills": harness.oom_kills}
        if self.session_dir is not None:
            metadata["session_dir"] = str(self.session_dir)
        return SessionResult(session_id=self.session_id, task_id=self.spec.task_id, status=self.status,
                             reason=self.reason, trajectory=self.trajectory, evaluation=self.evaluation,
                             timings=dict(self.timings), metadata=metadata)

    def shed(self) -> None:
        """Let go of what only a live session needs, once its result is out (a finished session stays in the
        node's table for GET /sessions/{id}/result, bounded by ``max_finished``; its result keeps the outcome)."""
        self.runtime = self.eval_runtime = None
        self.harness_result = None
        self.trajectory = None
        self.evaluation = None
        self.scratch.clear()
        self.prewarm_task = None
