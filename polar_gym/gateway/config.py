"""The gateway node's knobs: pool sizes per stage and the time budgets around the shared deadline."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_gym.runtime.base import GatewayEndpoint
from polar_gym.schema import SessionResult

__all__ = ["GatewayConfig", "ResultHook"]

#: called once per session with its final result (after teardown); exceptions are logged, never fatal
ResultHook = Callable[[SessionResult], Awaitable[None] | None]


@dataclass
class GatewayConfig:
    """Pool sizes and budgets. Why separate pools: preparation and evaluation are CPU/IO-bound and must never hold
    a run slot (the stand-in for rollout GPU time); the READY buffer keeps warm runtimes waiting for free slots."""

    #: per-session directories (sandbox dir, evaluation runtime dir, artifacts) go under this
    workdir: Path = field(default_factory=lambda: Path("polar_gym-gateway"))
    #: where runtimes reach this node's proxy (the relay target in network mode "gateway")
    endpoint: GatewayEndpoint | None = None
    init_workers: int = 4
    #: warm runtimes allowed to wait for a run slot (0: an initialized session waits holding its init slot)
    ready_buffer: int = 4
    run_slots: int = 8
    postrun_workers: int = 4
    #: concurrent preparations of fresh evaluation runtimes (evaluator prewarm), separate from INIT
    prewarm_workers: int = 2
    #: how long past the deadline RUN may take to stop the harness and collect its logs
    run_grace_seconds: float = 30.0
    #: POSTRUN (build, evaluate) must end by deadline + this, so a timed-out session still gets its traces scored
    postrun_grace_seconds: float = 300.0
    teardown_timeout_seconds: float = 60.0
    #: how long BUILDING waits for the session's in-flight model calls to be journaled
    settle_timeout_seconds: float = 10.0
    log_collect_timeout_seconds: float = 30.0
    callback_timeout_seconds: float = 30.0
    evaluate_on_timeout: bool = True
    #: finished sessions remembered for GET /sessions/{id}/result (oldest forgotten first)
    max_finished: int = 10_000
    hooks: list[ResultHook] = field(default_factory=list)
    #: options passed to every runtime backend, the only place options that reach the host may come from (docker
    #: ``cli``/``run_args``, apptainer ``binary``/``binds``, local ``ro_binds``, limits such as ``memory_mb`` or
    #: ``disk_mb``); a session request may set only its backend's ``Runtime.request_options``
    runtime_options: dict[str, Any] = field(default_factory=dict)
    #: host directories under which a request's ``runtime.options.expose`` may name paths (bound read-only at the
    #: same path inside the local sandbox); empty: a request cannot expose anything
    expose_roots: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        for name in ("init_workers", "run_slots", "postrun_workers", "prewarm_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.ready_buffer < 0:
            raise ValueError("ready_buffer must be >= 0")
