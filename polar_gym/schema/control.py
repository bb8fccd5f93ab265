"""The bodies the rollout server and its gateways exchange (polar_gym.gateway.client on the server's side, the
gateway's ServerLink on the other): session views and polls, health, upstream changes, pauses and weight updates,
registration; and a task's status as the rollout server reports it. Requests forbid unknown fields (a typo fails
loudly); answers are open (a newer peer may say more)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from polar_gym.schema._base import _Model, _Open
from polar_gym.schema.records import SessionResult, SessionStatus

__all__ = [
    "FleetWeightUpdate",
    "GatewayDrainRequest",
    "GatewayHealth",
    "GatewayRegistration",
    "GatewayView",
    "PauseReply",
    "PauseRequest",
    "PoolSizing",
    "ResumeReply",
    "ResumeRequest",
    "SessionCancelReply",
    "SessionPollReply",
    "SessionPollRequest",
    "SessionView",
    "SessionWithdrawReply",
    "SessionWithdrawRequest",
    "TaskStatus",
    "UpstreamAdded",
    "UpstreamChange",
    "UpstreamRemoved",
    "UpstreamsView",
    "WeightUpdateReply",
    "WeightUpdateRequest",
]


class TaskStatus(_Model):
    task_id: str
    status: SessionStatus
    sessions: dict[str, SessionStatus] = Field(default_factory=dict)
    results: list[SessionResult] = Field(default_factory=list)


# -- the rollout server <-> gateway API ---------------------------------------------------------------------------
# Requests forbid unknown fields (a typo fails loudly); answers are open (a newer peer may say more).


class SessionView(_Open):
    """A gateway's view of one session (POST /sessions 201, GET /sessions/{id}, 202 of .../result)."""

    session_id: str
    attempt_id: str | None = None
    task_id: str | None = None
    status: SessionStatus
    stage: str | None = None
    reason: str | None = None
    remaining_seconds: float | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    history: list[dict[str, Any]] = Field(default_factory=list)


class SessionCancelReply(SessionView):
    """POST /sessions/{id}/cancel: whether the session was live (and so is being cancelled), and its view."""

    cancelled: bool


class SessionPollRequest(_Model):
    """POST /sessions/poll: the sessions to watch and how long to wait for one of them to finish."""

    session_ids: list[Annotated[str, Field(max_length=512)]] = Field(max_length=100_000)
    wait: float = Field(default=0.0, ge=0.0, le=600.0)


class SessionWithdrawRequest(_Model):
    """POST /sessions/withdraw: sessions the rollout server takes back if they have not started running."""

    session_ids: list[Annotated[str, Field(max_length=512)]] = Field(max_length=100_000)


class SessionWithdrawReply(_Open):
    """The sessions withdrawn: cancelled before their harness ran (their attempt never ran, so it is not counted)."""

    withdrawn: list[str] = Field(default_factory=list)


class GatewayDrainRequest(_Model):
    """POST /gateways/{id}/drain (rollout server): with ``withdraw``, the sessions the gateway has not started
    running are taken back and queued again (a hand-over to the next Slurm job, polar_gym.launch.relaunch); with
    ``leaving``, the gateway is shutting down: it is gone at once (what missed heartbeats would find later), so no
    weight update or dispatch waits for it, and the sessions it still holds go back to the queue."""

    withdraw: bool = False
    leaving: bool = False


class SessionPollReply(_Open):
    """The answer to a poll: finished results, the statuses of the others, the ids the gateway does not know."""

    results: list[SessionResult] = Field(default_factory=list)
    statuses: dict[str, str] = Field(default_factory=dict)
    unknown: list[str] = Field(default_factory=list)


class PoolSizing(_Open):
    """A self-sizing gateway's current pool sizes and why (``pool_sizing: auto``): what the observed stage means
    want, which limit held them (max_runtimes, memory, disk), and whether the engine is the bottleneck."""

    init_workers: int
    ready_buffer: int
    postrun_workers: int
    #: the sizes the stage means call for before the node's limits
    wanted: dict[str, int] = Field(default_factory=dict)
    #: mean seconds of INIT, RUN, BUILD, EVALUATE over the recent window
    stage_means: dict[str, float] = Field(default_factory=dict)
    limited_by: str | None = None
    reason: str | None = None
    engine: str | None = None
    #: how many times the node changed a pool's size so far
    changes: int = 0


class GatewayHealth(_Open):
    """GET /gateway/health, also pushed as the heartbeat body: stage counts, queue depths, latencies (the keys every
    node reports are typed; more may come)."""

    status: str = "ok"
    accepting: bool = True
    live_sessions: int = 0
    statuses: dict[str, int] = Field(default_factory=dict)
    stages: dict[str, int] = Field(default_factory=dict)
    queue_depths: dict[str, int] = Field(default_factory=dict)
    pools: dict[str, Any] = Field(default_factory=dict)
    latency_seconds: dict[str, Any] = Field(default_factory=dict)
    run_slot_utilization: dict[str, Any] = Field(default_factory=dict)
    finished: dict[str, int] = Field(default_factory=dict)
    runtimes_live: int = 0
    #: the Slurm job the gateway runs in (SLURM_JOB_ID), so a launcher can tell which job a silent gateway was
    job_id: str | None = None
    #: how many sessions the server may hand this node now (a self-sizing node's pools change it)
    dispatch_capacity: int | None = None
    sizing: PoolSizing | None = None


class UpstreamChange(_Model):
    """POST /admin/upstreams and /admin/upstreams/remove: one LLM backend URL."""

    url: str = Field(max_length=2048)


class UpstreamAdded(_Open):
    added: str


class UpstreamRemoved(_Open):
    removed: bool


class UpstreamsView(_Open):
    """GET /admin/upstreams: the proxy's LLM backends, and whether it is paused for a weight update."""

    paused: bool
    policy_version: int | str | None = None
    checkpoint: str | None = None
    servers: list[dict[str, Any]] = Field(default_factory=list)


class PauseRequest(_Model):
    """POST /admin/pause (optional body): what to do with in-flight model calls. ``cut`` (default) cuts token-in
    generations (they continue from their tokens after the resume) and waits for the other calls; ``wait`` waits
    for every call to finish."""

    in_flight: Literal["cut", "wait"] = "cut"


class PauseReply(_Open):
    paused: bool
    drained_seconds: float = 0.0
    #: in-flight generations the pause cut
    cut: int = 0


class ResumeRequest(_Model):
    """POST /admin/resume (and the rollout server's POST /backends/resume)."""

    policy_version: int | str | None = None


class ResumeReply(_Open):
    paused: bool
    policy_version: int | str | None = None


class WeightUpdateRequest(_Model):
    """POST /admin/weights (proxy, gateway) and the rollout server's POST /backends/weights: load ``checkpoint`` (a
    directory as the inference servers' hosts see it) into every server and stamp ``policy_version`` on every later
    completion. ``drain_timeout``: how long in-flight model calls may take to finish first. ``resume`` false leaves
    the pool paused after a success (the rollout server resumes every gateway once all of them took the weights).

    ``servers``: inference servers already serving ``checkpoint`` (restarted on it: an engine that cannot reload, or
    a change a reload cannot make). They replace the pool's servers instead of a reload, once each answers; the old
    ones leave the pool drained, for the caller to stop. On the rollout server they also become its backends."""

    checkpoint: str = Field(min_length=1, max_length=4096, pattern=r"^[^\x00-\x1f]+$")  # a path: no NUL, no newline
    policy_version: int | str
    drain_timeout: float = Field(default=600.0, gt=0, le=86400, allow_inf_nan=False)
    resume: bool = True
    servers: list[str] | None = Field(default=None, min_length=1, max_length=256)
    #: in-flight model calls: ``cut`` (default) cuts the generations of token-in engines, which continue from their
    #: exact tokens under the new weights (the update does not wait for them), and waits for the others; ``wait``
    #: waits for every call to finish first
    in_flight: Literal["cut", "wait"] = "cut"

    @field_validator("servers")
    @classmethod
    def _server_urls(cls, value: list[str] | None) -> list[str] | None:
        from polar_gym.httpguard import check_upstream_url  # only where a request is parsed

        return None if value is None else list(dict.fromkeys(check_upstream_url(u).rstrip("/") for u in value))

    @field_validator("policy_version")
    @classmethod
    def _short_version(cls, value: int | str) -> int | str:
        if (isinstance(value, str) and not 0 < len(value) <= 256) or (isinstance(value, int) and abs(value) >= 2**63):
            raise ValueError("a policy version is an int64 or a string of 1 to 256 characters")
        return value


class WeightUpdateReply(_Open):
    """What a weight update did: per server the seconds of each step (vLLM: reload, cache reset, version tag), the
    time to drain in-flight calls, and the version later completions carry. A failure answers in the error
    envelope instead (502 ``weight_update_failed``, the server named)."""

    checkpoint: str
    policy_version: int | str | None = None
    previous_version: int | str | None = None
    paused: bool = False
    drained_seconds: float = 0.0
    update_seconds: float = 0.0
    total_seconds: float = 0.0
    servers: dict[str, dict[str, float]] = Field(default_factory=dict)
    #: servers an update with ``servers`` took out of the pool, drained (the caller stops them)
    replaced: list[str] = Field(default_factory=list)
    #: in-flight generations the update cut (they continue under the new weights)
    cut: int = 0


class FleetWeightUpdate(_Open):
    """The rollout server's POST /backends/weights: whether every live gateway took the checkpoint (``updated``), the
    version later completions carry (the old one when not), what went wrong (``message``) and each gateway's
    answers to the three phases (``pause``, ``weights``, ``resume``: ``{"status", "body"}`` or ``{"status": None,
    "error"}``)."""

    updated: bool
    checkpoint: str
    policy_version: int | str | None = None
    message: str = ""
    seconds: float = 0.0
    gateways: dict[str, dict[str, Any]] = Field(default_factory=dict)
    #: in-flight generations the update cut on every gateway (they continue under the new weights)
    cut: int = 0


class GatewayRegistration(_Model):
    """POST /gateways/register (a gateway to its rollout server): where the gateway is, how many sessions it takes at
    once, its admin token."""

    url: str = Field(max_length=2048)
    capacity: int = Field(ge=1, le=1_000_000)
    admin_token: str | None = Field(default=None, max_length=4096)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        from polar_gym.httpguard import check_upstream_url  # only where a registration is parsed

        return check_upstream_url(value)


class GatewayView(_Open):
    """The rollout server's view of one gateway (register, heartbeat, drain, GET /gateways)."""

    gateway_id: str
    url: str
    capacity: int
    state: Literal["healthy", "draining", "dead"]
    suspect: bool = False
    in_flight: int = 0
    load: float = 0.0
    #: None for a gateway another server worker watches (this worker does not hear its heartbeats)
    seconds_since_heartbeat: float | None = 0.0
    health: dict[str, Any] = Field(default_factory=dict)
    #: the server worker that watches it and dispatches to it
    worker: str | None = None
