"""The gateway node's settings: pool sizes per stage and the time budgets around the shared deadline.

:class:`GatewayPools` is what an operator sets (the gateway's flags, ``launcher=local``, a Slurm gateway job);
:class:`GatewayConfig` adds the node's wiring (its directory, endpoint, hooks). Both are pydantic models, so the
defaults live here once and a bad value is refused when the settings are made, before anything starts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from polar_gym.evaluate.judge import JudgeEndpoint
from polar_gym.runtime.base import GatewayEndpoint
from polar_gym.schema import SessionResult
from polar_gym.telemetry import TelemetrySettings

__all__ = ["GatewayConfig", "GatewayPools", "ResultHook"]

#: called once per session with its final result (after teardown); exceptions are logged, never fatal
ResultHook = Callable[[SessionResult], Awaitable[None] | None]


class GatewayPools(BaseModel):
    """Pool sizes and the operator's options. Why separate pools: preparation and evaluation are CPU/IO-bound and
    must never hold a run slot (the stand-in for rollout GPU time); the READY buffer keeps warm runtimes waiting for
    free slots."""

    model_config = ConfigDict(extra="forbid")

    init_workers: int = Field(default=4, ge=1, description="sessions prepared at once (INIT: runtime start, prepare)")
    ready_buffer: int = Field(default=4, ge=0, description="warm runtimes allowed to wait for a run slot (0: an "
                              "initialized session waits holding its init slot)")
    run_slots: int = Field(default=8, ge=1, description="harnesses running at once (RUNNING)")
    postrun_workers: int = Field(default=4, ge=1, description="sessions built and evaluated at once (POSTRUN)")
    prewarm_workers: int = Field(default=2, ge=1, description="concurrent preparations of fresh evaluation runtimes "
                                 "(evaluator prewarm), separate from INIT")
    pool_sizing: Literal["fixed", "auto"] = Field(default="auto", description="auto: INIT, READY and POSTRUN are "
                                                  "sized from the stage times the node observes, so the run slots "
                                                  "stay busy (the sizes above are the start); fixed: as set")
    max_runtimes: int | None = Field(default=None, ge=1, description="auto sizing: at most this many sandboxes on "
                                     "the node at once (each INIT, READY, RUN and POSTRUN slot holds one); growth "
                                     "also stops when memory or disk runs low")
    postrun_grace_seconds: float = Field(default=300.0, ge=0, description="POSTRUN (build, evaluate) must end by "
                                         "the deadline plus this, so a timed-out session still gets its traces "
                                         "scored")
    runtime_options: dict[str, Any] = Field(default_factory=dict, description="options passed to every runtime "
                                            "backend, the only place options that reach the host may come from "
                                            "(docker cli/run_args, apptainer binary/binds, local ro_binds, limits "
                                            "such as memory_mb or disk_mb); a session request may set only its "
                                            "backend's request options")
    expose_roots: list[Path] = Field(default_factory=list, description="host directories under which a request's "
                                     "runtime.options.expose may name paths (bound read-only in the local "
                                     "sandbox); empty: a request cannot expose anything")

    judges: dict[str, JudgeEndpoint] = Field(default_factory=dict, description="LLM judges the rubric evaluator "
                                             "may ask, by name (an OpenAI-compatible url, model, optional key "
                                             "file): the operator's, never a task's")

    def dispatch_capacity(self) -> int:
        """How many sessions a rollout server may hand this node at once: room in every stage (INIT workers, the
        READY buffer, the run slots, POSTRUN workers). Why not the run slots alone: the server counts a session
        until its result, so a slot would sit empty while its last session is scored and the next one is only then
        dispatched and prepared (benchmarks/bench_scale.py, docs/scaling.md)."""
        return self.init_workers + self.ready_buffer + self.run_slots + self.postrun_workers

class GatewayConfig(GatewayPools):
    """Everything a :class:`~polar_gym.gateway.node.GatewayNode` is built from."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    #: per-session directories (sandbox dir, evaluation runtime dir, artifacts) go under this
    workdir: Path = Path("polar_gym-gateway")
    #: where runtimes reach this node's proxy (the relay target in network mode "gateway")
    endpoint: GatewayEndpoint | None = None
    #: how long past the deadline RUN may take to stop the harness and collect its logs
    run_grace_seconds: float = 30.0
    teardown_timeout_seconds: float = 60.0
    #: how long BUILDING waits for the session's in-flight model calls to be journaled
    settle_timeout_seconds: float = 10.0
    log_collect_timeout_seconds: float = 30.0
    evaluate_on_timeout: bool = True
    #: finished sessions remembered for GET /sessions/{id}/result (oldest forgotten first)
    max_finished: int = 10_000
    hooks: list[ResultHook] = Field(default_factory=list)
    #: OpenTelemetry spans of every finished session (None or nothing enabled: none)
    telemetry: TelemetrySettings | None = None

    def pools(self) -> GatewayPools:
        """The operator's part of this config."""
        return GatewayPools.model_validate(self.model_dump(include=set(GatewayPools.model_fields)))
