"""Tasks, sessions and what they produce: a task request and its runtime, agent and evaluator specs, the completion
records the proxy journals, traces, trajectories and session results. The shapes follow the Polar paper's appendix
(TaskRequest A.3, Trace A.4)."""

from __future__ import annotations

import enum
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)
from typing_extensions import TypedDict

from polar_gym.schema._base import _Model, _Open

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
    "ImageRef",
    "OracleScript",
    "PrepareAction",
    "ResultHead",
    "RuntimeSpec",
    "SamplingOverride",
    "SessionResult",
    "SessionSpec",
    "SessionStatus",
    "TaskMetadata",
    "TaskRequest",
    "TokenLogprob",
    "Trace",
    "Trajectory",
    "VersionSpan",
    "host_read_env_names",
]


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
    reads: list[str] = Field(default_factory=list, description="files the oracle reads through the harness's own "
                             "file-reading tool before the commands, as a model looks at a file (an image then "
                             "reaches the model as the harness sends it); skipped with a harness that has none")
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
    #: the callback body: the task view as JSON (``json``), or with its results packed (``packed``,
    #: polar_gym.result_codec.frame_results: about 20x smaller, and the server decodes nothing; CallbackReceiver
    #: asks for it and hands on_task the same view as JSON)
    callback_format: Literal["json", "packed"] = "json"
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


class TokenSpan(TypedDict):
    """``response_ids[start:end]`` of a completion: where something the record names was sampled."""

    start: int
    end: int


class ImageRef(TypedDict):
    """An image in a completion's prompt: its SHA-256 and type (the pixels are in the normalized request, as a data
    URL, stored once per journal stream), its decoded size, and ``prompt_ids[start:end]``, the placeholders the
    model's processor expanded it into (None when the proxy had no tokenizer of the model to tell)."""

    sha256: str
    media_type: str
    size: int
    prompt_span: TokenSpan | None


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
    #: where each of those blocks was sampled (``response_ids`` offsets, tags included), in order; empty in chat mode
    #: and in journals older than the field
    malformed_tool_call_spans: list[TokenSpan] = Field(default_factory=list)
    #: whether the harness was still connected when its answer was ready to send: False means it had hung up (a
    #: client timeout, a retry usually follows) and never read the answer; None: not known (a caller that is not an
    #: HTTP client, journals older than the field). Builders keep a delivered answer that nothing went on from as
    #: its own conversation instead of reading a later call with the same prompt as its retry.
    delivered: bool | None = None
    #: a generation that weight updates cut and that continued under new weights (token-in engines): which
    #: ``response_ids`` each policy version sampled, in order and covering them all; None when one version sampled
    #: them all (``policy_version``). ``policy_version`` is then the version of the last token.
    version_spans: list[VersionSpan] | None = None
    #: the images of the prompt, in order (empty: none)
    images: list[ImageRef] = Field(default_factory=list)
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
    """A session's score: the outcome ``reward``; optionally one reward per trace (in trace order; it replaces the
    outcome on that trace), the per-trace scores they came from (a judge's, for the record), and rewards per turn
    (``{completion_id: reward}``: a process reward given for one model call, carried to the trace holding it)."""

    reward: Reward
    passed: bool | None = None
    per_trace_rewards: list[Reward] | None = None
    per_trace_scores: list[float] | None = None
    per_turn_rewards: dict[str, Reward] | None = None
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


class ResultHead(_Open):
    """The head of a packed result (polar_gym.result_codec): the few fields the rollout server files a result by,
    readable without decoding the result; open, so a newer gateway may add fields."""

    session_id: str
    task_id: str
    status: SessionStatus
    reason: str | None = None
    attempt_id: str | None = None
    reward: float | None = None
    error_cause: str | None = None
    traces: int = 0
    completions: int | None = None
    seconds: float | None = None
    #: unique token ids and logprobs (not +0.0) stored: what :func:`polar_gym.result_codec.unique_token_bytes` counts
    token_ids: int = 0
    logprobs: int = 0
    #: set when the server's retention cut the result down after the trainer had it (``compact`` or ``drop``)
    retained: str | None = None
