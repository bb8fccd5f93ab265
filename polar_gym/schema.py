"""Every wire type of polar_gym, in one place (pydantic v2).

The shapes follow the Polar paper's appendix (TaskRequest A.3, Trace A.4). Services, the proxy journal, builders and
trainer bridges all speak these types. Nothing else of ours is imported at import time, so any part can depend on
this module and a builder run loads no asyncio (every extra module is more for the cyclic GC to walk in a merge's
allocations). The last section holds the bodies the rollout server and its gateways exchange
(polar_gym.gateway.client on the server's side, the gateway's ServerLink on the other).
"""

from __future__ import annotations

import enum
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)
from typing_extensions import TypedDict

__all__ = [
    "HOST_READ_ENV",
    "MAX_REWARD",
    "ORACLE_NAME_PATTERN",
    "AgentSpec",
    "BuilderSpec",
    "CompletionRecord",
    "CompletionSession",
    "EvalResult",
    "EvaluatorSpec",
    "FleetWeightUpdate",
    "GatewayHealth",
    "GatewayRegistration",
    "GatewayView",
    "OracleScript",
    "PauseReply",
    "PauseRequest",
    "PrepareAction",
    "ResumeReply",
    "ResumeRequest",
    "RuntimeSpec",
    "SamplingOverride",
    "SessionCancelReply",
    "SessionPollReply",
    "SessionPollRequest",
    "SessionResult",
    "SessionSpec",
    "SessionStatus",
    "SessionView",
    "TaskMetadata",
    "TaskRequest",
    "TaskStatus",
    "TokenLogprob",
    "Trace",
    "Trajectory",
    "UpstreamAdded",
    "UpstreamChange",
    "UpstreamRemoved",
    "UpstreamsView",
    "VersionSpan",
    "WeightUpdateReply",
    "WeightUpdateRequest",
    "host_read_env_names",
]


class _Model(BaseModel):
    """Wire types reject unknown fields so a typo in a config fails loudly instead of being ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _Open(BaseModel):
    """Free-form sections (metadata, evaluator config) keep whatever the caller sends."""

    model_config = ConfigDict(extra="allow")


class PrepareAction(_Model):
    """One preparation step run in the runtime before the harness starts."""

    type: Literal["exec", "upload_file", "upload_dir"]
    command: str | list[str] | None = None
    src: str | None = None
    dst: str | None = None
    content: str | None = None
    timeout_seconds: float | None = None

    @model_validator(mode="after")
    def _check_fields(self) -> PrepareAction:
        if self.type == "exec" and not self.command:
            raise ValueError("prepare action 'exec' needs a command")
        if self.type != "exec" and not self.dst:
            raise ValueError(f"prepare action {self.type!r} needs dst")
        if self.type == "upload_dir" and not self.src:
            raise ValueError("prepare action 'upload_dir' needs src")
        if self.type == "upload_file" and self.src is None and self.content is None:
            raise ValueError("prepare action 'upload_file' needs src or content")
        return self


#: environment names that a dynamic loader, libc or a container engine reads as instructions to the process that
#: starts (preload a library, load a converter, pick a config or a storage root). A task or a request is untrusted
#: input: its env only ever reaches the command inside the sandbox, and these names are refused outright as a second
#: line of defence, so that no slip in a backend can hand them to a host binary. Entries ending in ``*`` are prefixes.
HOST_READ_ENV: tuple[str, ...] = (
    "LD_*", "GCONV_PATH", "GETCONF_DIR", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH", "MALLOC_*", "GLIBC_TUNABLES",
    "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TZDIR",
    "CONTAINERS_*", "CONTAINER_*", "DOCKER_*", "PODMAN_*", "BUILDAH_*", "STORAGE_*", "REGISTRY_AUTH_FILE",
    "APPTAINER*", "SINGULARITY*", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "BWRAP_*",
)


def host_read_env_names(env: dict[str, str]) -> list[str]:
    """The names of ``env`` that :data:`HOST_READ_ENV` refuses, or that no environment can hold (empty, ``=``, NUL),
    in ``env``'s order."""

    def refused(name: str) -> bool:
        if not name or "=" in name or "\0" in name:
            return True
        upper = name.upper()
        return any(upper.startswith(p[:-1]) if p.endswith("*") else upper == p for p in HOST_READ_ENV)

    return [name for name in env if refused(name)]


class RuntimeSpec(_Model):
    backend: str = "local"
    image: str | None = None
    network: Literal["none", "host", "gateway"] = "gateway"
    workdir: str = "/workspace"
    prepare: list[PrepareAction] = Field(default_factory=list)
    cpus: float | None = None
    memory_mb: int | None = None
    max_processes: int | None = None
    #: the sandboxed command's environment (handed into the sandbox, never to a host process; see HOST_READ_ENV)
    env: dict[str, str] = Field(default_factory=dict)
    #: backend-specific settings (e.g. the docker CLI to use, apptainer overlay size)
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("env")
    @classmethod
    def _env_reaches_only_the_sandbox(cls, env: dict[str, str]) -> dict[str, str]:
        if refused := host_read_env_names(env):
            raise ValueError(f"runtime env may not set {', '.join(map(repr, refused))}: a dynamic loader or container "
                             "engine reads it (set it in the image instead)")
        return env


class AgentSpec(_Model):
    harness: str
    model_name: str = "policy"
    config: dict[str, Any] = Field(default_factory=dict)


class BuilderSpec(_Model):
    strategy: str = "prefix_merging"
    config: dict[str, Any] = Field(default_factory=dict)


class EvaluatorSpec(_Model):
    strategy: str = "session_completed"
    refresh_runtime: bool = False
    config: _Open = Field(default_factory=_Open)


#: an oracle script's name: a short identifier (it names a ``solution-<name>/`` directory and labels SFT records)
ORACLE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"


class OracleScript(_Model):
    """A task's reference solution, played by the oracle engine: shell commands to run in order, then a final text
    answer. It travels in the task's ``metadata["oracle"]``; alternatives (a wrong solution, another right one) in
    ``metadata["oracle_variants"]``, each with its own ``name``."""

    commands: list[str] = Field(default_factory=list)
    final_answer: str = "Done."
    name: str = Field(default="reference", pattern=ORACLE_NAME_PATTERN,
                      description="reference, or the name of an alternative (a forked task's variant)")
    reasoning: Literal["quote", "brief"] = Field(
        default="quote", description="what the oracle thinks before a command: quote (`Step N: run `CMD`.`) or brief "
        "(`Step N.`: a forked task's scripts, so a token the fork changes appears once in what a model learns, not "
        "twice)")


class SamplingOverride(_Model):
    """Sampling values that replace what the harness sends, on every model call of a session (``metadata.sampling``):
    a trainer measures greedy success (``{"temperature": 0.0}``) through an unmodified harness, which sends its own
    values or none (the engine's default, 1.0 in vLLM, then applies). A field left None keeps the harness's value.
    The bounds are the ones both vLLM and SGLang accept, so a bad value is refused at submit (422), not by the engine
    at the first call. The oracle engine samples nothing and ignores it."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="0 to 2; 0 is greedy")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="above 0, at most 1")
    #: 0 is refused: vLLM reads it as "all tokens", SGLang refuses it
    top_k: int | None = Field(default=None, ge=-1, description="-1 (all tokens) or at least 1")
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1,
                             description="a 64-bit signed integer, the same on every call of the session")

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("top_k must be -1 (all tokens) or at least 1")
        return value

    def overrides(self) -> dict[str, float | int]:
        """The fields set (not None): what replaces the harness's values."""
        return {name: value for name, value in self.__dict__.items() if value is not None}


class TaskMetadata(_Open):
    group_id: str | None = None
    policy_version: int | str | None = None
    rollout_step: int | None = None
    #: sampling values forced on every model call of the task's sessions (e.g. greedy evaluation); None: the
    #: harness's own
    sampling: SamplingOverride | None = Field(
        default=None, description="sampling forced on every model call of the sessions (e.g. greedy evaluation)")
    #: alternatives to ``metadata["oracle"]`` (a fork: right and wrong solutions of one task, polar_gym.tasks.forks):
    #: sample i of the task plays ``[oracle, *oracle_variants][i % n]`` (see :meth:`for_sample`)
    oracle_variants: list[OracleScript] | None = Field(
        default=None, description="alternative oracle scripts beside metadata.oracle: sample i plays "
        "[oracle, *oracle_variants][i % n] and its session's metadata names it in oracle_variant")

    @model_validator(mode="after")
    def _check_variants(self) -> TaskMetadata:
        if self.oracle_variants:
            raw = (self.model_extra or {}).get("oracle")
            if raw is None:
                raise ValueError("oracle_variants need the reference script in metadata.oracle")
            names = [OracleScript.model_validate(raw).name, *(v.name for v in self.oracle_variants)]
            repeated = sorted({n for n in names if names.count(n) > 1})
            if repeated:
                raise ValueError(f"oracle script names repeat: {', '.join(repeated)} (each variant needs its own name)")
        return self

    def for_sample(self, sample_index: int) -> TaskMetadata:
        """The metadata of one session: with ``oracle_variants``, ``oracle`` becomes the script this sample plays
        (round robin over the reference and its variants: sample 0 the reference, 1 the first variant, ...) and the
        variants are left out; ``oracle_variant`` names the script (what the oracle engine plays; a model engine
        ignores it). Without variants only the name is added. A datagen retry (``retry_samples``: its sample j
        stands for sample ``retry_samples[j]`` of the original task) plays what that sample played."""
        extra = self.model_extra or {}
        raw = extra.get("oracle")
        if not isinstance(raw, dict):
            return self
        if not self.oracle_variants:
            name = raw.get("name", "reference")
            return self if not isinstance(name, str) else self.model_copy(update={"oracle_variant": name})
        scripts = [OracleScript.model_validate(raw), *self.oracle_variants]
        stands_for = extra.get("retry_samples")
        if isinstance(stands_for, list) and 0 <= sample_index < len(stands_for) and isinstance(
                stands_for[sample_index], int):
            sample_index = stands_for[sample_index]
        chosen = scripts[sample_index % len(scripts)]
        return TaskMetadata.model_validate({**self.model_dump(), "oracle": chosen.model_dump(),
                                            "oracle_variant": chosen.name, "oracle_variants": None})


class TaskRequest(_Model):
    """What a trainer submits: one task, expanded into ``num_samples`` sessions."""

    task_id: str
    instruction: str
    num_samples: int = Field(default=1, ge=1)
    timeout_seconds: float = Field(default=1800.0, gt=0)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    agent: AgentSpec
    builder: BuilderSpec = Field(default_factory=BuilderSpec)
    evaluator: EvaluatorSpec = Field(default_factory=EvaluatorSpec)
    callback_url: str | None = None
    #: the receiver's shared secret: the server signs each callback body with it (HMAC-SHA256, see
    #: polar_gym.server.signing). Kept out of repr; stored with the request (the store is 0600) and in no answer.
    callback_secret: str | None = Field(default=None, min_length=16, max_length=512, pattern=r"^[\x21-\x7e]+$",
                                        repr=False)
    metadata: TaskMetadata = Field(default_factory=TaskMetadata)


class SessionStatus(str, enum.Enum):
    REGISTERED = "REGISTERED"
    INITIALIZING = "INITIALIZING"
    READY = "READY"
    RUNNING = "RUNNING"
    POST_RUN = "POST_RUN"
    BUILDING = "BUILDING"
    EVALUATING = "EVALUATING"
    COMPLETED = "COMPLETED"
    ERROR = "ERROR"
    TIMEOUT = "TIMEOUT"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = {SessionStatus.COMPLETED, SessionStatus.ERROR, SessionStatus.TIMEOUT, SessionStatus.CANCELLED}


class SessionSpec(_Model):
    """One sample of a task, as dispatched to a gateway. ``session_id`` doubles as the harness's API key."""

    session_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    task_id: str
    sample_index: int = 0
    instruction: str
    timeout_seconds: float = 1800.0
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    agent: AgentSpec
    builder: BuilderSpec = Field(default_factory=BuilderSpec)
    evaluator: EvaluatorSpec = Field(default_factory=EvaluatorSpec)
    metadata: TaskMetadata = Field(default_factory=TaskMetadata)

    @classmethod
    def from_task(cls, task: TaskRequest, sample_index: int) -> SessionSpec:
        """Sample ``sample_index`` of ``task``; its metadata names the oracle script it plays
        (:meth:`TaskMetadata.for_sample`)."""
        return cls(
            session_id=f"{task.task_id}-{sample_index}-{uuid.uuid4().hex[:8]}",
            task_id=task.task_id,
            sample_index=sample_index,
            instruction=task.instruction,
            timeout_seconds=task.timeout_seconds,
            runtime=task.runtime,
            agent=task.agent,
            builder=task.builder,
            evaluator=task.evaluator,
            metadata=task.metadata.for_sample(sample_index),
        )


class TokenLogprob(_Model):
    token: str | None = None
    token_id: int
    logprob: float


class VersionSpan(TypedDict):
    """Which policy version sampled ``response_ids[start:end]`` of a completion a weight update cut."""

    start: int
    end: int
    policy_version: int | str | None


class CompletionRecord(_Model):
    """One model call as the proxy saw it: the contract between capture (I/O) and trajectory building (pure).

    ``prompt_ids`` and ``response_ids`` are exactly what the engine consumed and sampled; ``token_faithful`` is
    False when the engine could not report them (a plain OpenAI-compatible server), and builders must not train on
    such a record.
    """

    completion_id: str
    session_id: str
    index: int
    provider: str
    engine: str
    server: str | None = None
    policy_version: int | str | None = None
    model: str | None = None
    stream: bool = False
    side_request: bool = False
    #: the path and query string the harness called, e.g. ``/v1/messages?beta=true``
    path: str | None = None
    request: dict[str, Any] = Field(default_factory=dict)
    normalized_request: dict[str, Any] = Field(default_factory=dict)
    normalizations: list[str] = Field(default_factory=list)
    response: dict[str, Any] = Field(default_factory=dict)
    prompt_ids: list[int] = Field(default_factory=list)
    response_ids: list[int] = Field(default_factory=list)
    response_logprobs: list[float] = Field(default_factory=list)
    finish_reason: str | None = None
    token_faithful: bool = True
    #: how the prompt reached the engine: ``token_in`` (the proxy's exact token IDs), ``chat`` (the engine rendered
    #: the messages); None for engines that do not say and journals older than the setting
    prompt_mode: str | None = None
    #: tool-call blocks the output parser could not read (answered to the harness as text): a trainer may mask or
    #: zero such a completion (token_in mode; 0 elsewhere)
    unparseable_tool_calls: int = Field(default=0, ge=0)
    #: whether the harness was still connected when its answer was ready to send: False means it had hung up (a
    #: client timeout, a retry usually follows) and never read the answer; None: not known (a caller that is not an
    #: HTTP client, journals older than the field). Builders keep a delivered answer that nothing went on from as
    #: its own conversation instead of reading a later call with the same prompt as its retry.
    delivered: bool | None = None
    #: a generation that weight updates cut and that continued under new weights (token-in engines): which
    #: ``response_ids`` each policy version sampled, in order and covering them all; None when one version sampled
    #: them all (``policy_version``). ``policy_version`` is then the version of the last token.
    version_spans: list[VersionSpan] | None = None
    status: Literal["ok", "error"] = "ok"
    error: str | None = None
    started_at: float = Field(default_factory=time.time)
    upstream_seconds: float = 0.0
    total_seconds: float = 0.0

    def set_fields(self, values: dict[str, Any]) -> None:
        """Set several fields at once, as assigning each does (this model validates no assignment), without
        pydantic's per-assignment dispatch (~1 us a field, a dozen a call)."""
        unknown = values.keys() - type(self).model_fields.keys()
        if unknown:
            raise AttributeError(f"CompletionRecord has no field {sorted(unknown)[0]!r}")
        self.__dict__.update(values)
        self.__pydantic_fields_set__.update(values)

    @model_validator(mode="after")
    def _aligned(self) -> CompletionRecord:
        if self.response_logprobs and len(self.response_logprobs) != len(self.response_ids):
            raise ValueError(
                f"response_logprobs ({len(self.response_logprobs)}) must align with response_ids "
                f"({len(self.response_ids)})"
            )
        return self


class CompletionSession(_Model):
    session_id: str
    completions: list[CompletionRecord] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)


#: the largest reward magnitude: a trainer squares rewards (a batch's variance), and 1e308 made every advantage NaN
MAX_REWARD = 1e9
#: a reward: a finite number within ±MAX_REWARD (JSON has no NaN or inf: ``inf`` became ``null``, a result no reader
#: could take back)
Reward = Annotated[float, Field(allow_inf_nan=False, ge=-MAX_REWARD, le=MAX_REWARD)]


class Trace(_Model):
    """One training sequence (paper A.4): prompt, response with loss mask, aligned logprobs, reward.

    In Python ``response_logprobs`` is one float per response token (the token is ``response_ids[i]``): a long
    chain holds ~10^5 of them, and an object per token made building and memory several times costlier. On the wire
    it has the paper's shape, ``[{token, token_id, logprob}]``, and either shape is accepted as input.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    response_logprobs: list[float] = Field(default_factory=list)
    prompt_messages: list[dict[str, Any]] = Field(default_factory=list)
    response_messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    finish_reason: str | None = None
    reward: Reward | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("response_logprobs", mode="before")
    @classmethod
    def _floats(cls, value: Any, info: ValidationInfo) -> Any:
        if not isinstance(value, list) or not value or not isinstance(value[0], dict):
            return value
        ids = info.data.get("response_ids")
        out = []
        for i, item in enumerate(value):
            entry = TokenLogprob.model_validate(item)
            if ids is not None and i < len(ids) and entry.token_id != ids[i]:
                raise ValueError(f"response_logprobs[{i}].token_id {entry.token_id} is not response_ids[{i}] {ids[i]}")
            out.append(entry.logprob)
        return out

    @field_serializer("response_logprobs")
    def _paper_shape(self, value: list[float]) -> list[dict[str, Any]]:
        return [{"token": None, "token_id": t, "logprob": lp} for t, lp in zip(self.response_ids, value, strict=False)]

    @model_validator(mode="after")
    def _aligned(self) -> Trace:
        if len(self.loss_mask) != len(self.response_ids):
            raise ValueError("loss_mask must align with response_ids")
        if self.response_logprobs and len(self.response_logprobs) != len(self.response_ids):
            raise ValueError("response_logprobs must align with response_ids")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask holds only 0 and 1")
        return self


class Trajectory(_Model):
    session_id: str
    traces: list[Trace] = Field(default_factory=list)
    builder: str = "per_request"
    diagnostics: dict[str, Any] = Field(default_factory=dict)


class EvalResult(_Model):
    reward: Reward
    passed: bool | None = None
    per_trace_rewards: list[Reward] | None = None
    details: dict[str, Any] = Field(default_factory=dict)


class SessionResult(_Model):
    session_id: str
    task_id: str
    status: SessionStatus
    reason: str | None = None
    trajectory: Trajectory | None = None
    evaluation: EvalResult | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)


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


class SessionPollReply(_Open):
    """The answer to a poll: finished results, the statuses of the others, the ids the gateway does not know."""

    results: list[SessionResult] = Field(default_factory=list)
    statuses: dict[str, str] = Field(default_factory=dict)
    unknown: list[str] = Field(default_factory=list)


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
    seconds_since_heartbeat: float = 0.0
    health: dict[str, Any] = Field(default_factory=dict)
