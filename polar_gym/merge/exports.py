"""Trainer-ready shapes of a built trajectory: Slime samples, NeMo Gym / NeMo RL output items, trace lines for JSONL
files and SFT records with OpenAI-style messages. Pure: models in, models out; writing files is the caller's job.

A *source* is a :class:`SessionResult` (status, reason, evaluation and trajectory of one session) or a bare
:class:`Trajectory`, which counts as a completed session with no evaluation and ``task_id = session_id`` (offline
re-merging of old captures).

Shapes (all pydantic v2, ``model_dump()`` gives the JSON):

- :class:`SlimeSample`, one per trace; the fields of slime's ``Sample`` (``slime.utils.types``) that a trainer reads:
  ``tokens`` = prompt + response, ``response_length``, ``loss_mask`` and ``rollout_log_probs`` over the response
  only, ``reward``, ``status`` ("completed" | "truncated" | "aborted"), ``group_index``/``index``,
  ``weight_versions`` (the policy version of each sampled span, in order, as slime appends one per generate
  call), ``metadata`` (``spans``: each span's response range, version and completion id, for importance
  correction and staleness per token); plus ``group_id`` from the task.
- :class:`NemoOutputItem`, one per sampled completion of a trace: ``prompt_token_ids`` (cumulative: the trace's
  prompt and every response token before this completion), ``generation_token_ids``, ``generation_log_probs``.
  ``policy_version`` (the version that sampled it) and ``logprobs_missing`` (the log probs are placeholder zeros).
  Each trace is its own chain (its own list), satisfying NeMo RL's prefix-contiguity rule, which
  :func:`check_contiguity` implements.
- :class:`TraceLine`, a Trace plus ``session_id``, ``trace_index`` and ``builder`` (one JSON object per line).
- :class:`SFTRecord`, one per trace: instance metadata (instance_id, task_id, session_id, reward, passed, ...) and
  ``messages`` / ``tools`` in OpenAI Chat shape (role, content, tool_calls, tool_call_id).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

from polar_gym.schema import SessionResult, SessionStatus, TaskMetadata, Trace, Trajectory
from polar_gym.schema.images import image_urls_of

__all__ = [
    "ContiguityError",
    "NemoOutputItem",
    "SFTRecord",
    "SlimeSample",
    "TraceLine",
    "check_contiguity",
    "main_chain",
    "nemo_item_chains",
    "nemo_items",
    "openai_message",
    "sample_status",
    "sft_records",
    "slime_samples",
    "template_tool",
    "trace_lines",
    "trajectory_records",
]

SampleStatus = Literal["completed", "truncated", "aborted"]
Source = SessionResult | Trajectory


class _Export(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- sources ----------------------------------------------------------------------------------------------------------
def _unpack(source: Source) -> tuple[SessionResult, Trajectory]:
    """A SessionResult for either kind of source, and its trajectory (empty when the session produced none)."""
    if isinstance(source, Trajectory):
        return SessionResult(session_id=source.session_id, task_id=source.session_id,
                             status=SessionStatus.COMPLETED, trajectory=source), source
    traj = source.trajectory or Trajectory(session_id=source.session_id)
    return source, traj


def _group_id(result: SessionResult, task: TaskMetadata | Mapping[str, Any] | None) -> str | None:
    if isinstance(task, TaskMetadata):
        return task.group_id
    if task is not None:
        value = task.get("group_id")
        return None if value is None else str(value)
    value = result.metadata.get("group_id")
    return None if value is None else str(value)


def _reward(trace: Trace, result: SessionResult) -> float | None:
    if trace.reward is not None:
        return trace.reward
    return result.evaluation.reward if result.evaluation is not None else None


# -- Slime ------------------------------------------------------------------------------------------------------------
class SlimeSample(_Export):
    """A trace as slime's ``Sample``: ``loss_mask`` and ``rollout_log_probs`` cover the response only."""

    group_index: int | None = None
    index: int | None = None
    group_id: str | None = None
    prompt: list[dict[str, Any]] = Field(default_factory=list)
    tokens: list[int]
    response_length: int
    reward: float
    loss_mask: list[int]
    rollout_log_probs: list[float]
    weight_versions: list[str] = Field(default_factory=list)
    status: SampleStatus
    metadata: dict[str, Any] = Field(default_factory=dict)
    #: a multimodal trace's images, as slime's raw multimodal data: ``{"images": [data URL, ...]}`` in the order of
    #: their placeholders in ``tokens`` (``metadata["images"]`` holds each one's span); None without images
    multimodal_inputs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _aligned(self) -> SlimeSample:
        if not 0 <= self.response_length <= len(self.tokens):
            raise ValueError("response_length must fit in tokens")
        if len(self.loss_mask) != self.response_length or len(self.rollout_log_probs) != self.response_length:
            raise ValueError("loss_mask and rollout_log_probs must have response_length entries")
        return self


def sample_status(status: SessionStatus | str, finish_reason: str | None) -> tuple[SampleStatus, bool]:
    """Slime status of a trace and whether it is masked out entirely.

    Only a COMPLETED session trains: a timeout, an error or a cancellation gives "aborted" samples with an all-zero
    loss mask (exported anyway, so nothing disappears silently). A completed trace whose last turn hit the token
    limit is "truncated" and still trains.
    """
    if SessionStatus(status) is not SessionStatus.COMPLETED:
        return "aborted", True
    return ("truncated" if finish_reason == "length" else "completed"), False


def slime_samples(source: Source, task: TaskMetadata | Mapping[str, Any] | None = None,
                  group_index: int | None = None, index_base: int = 0) -> list[SlimeSample]:
    """One SlimeSample per trace, ``index = index_base + trace index``. ``task`` gives ``group_id`` (else
    ``result.metadata["group_id"]``); ``reward`` is the trace's, else the session's outcome, else 0.0 with
    ``metadata["reward_missing"]`` set; ``metadata["weight"]`` is the session weight (1.0 unless
    :mod:`polar_gym.merge.rewards` set one)."""
    result, traj = _unpack(source)
    group_id = _group_id(result, task)
    samples = []
    for i, trace in enumerate(traj.traces):
        status, masked = sample_status(result.status, trace.finish_reason)
        reward = _reward(trace, result)
        n = len(trace.response_ids)
        logprobs = list(trace.response_logprobs) if trace.response_logprobs else [0.0] * n
        meta = trace.metadata
        spans = _spans(trace)
        samples.append(SlimeSample.model_construct(
            group_index=group_index, index=index_base + i, group_id=group_id, prompt=trace.prompt_messages,
            tokens=[*trace.prompt_ids, *trace.response_ids], response_length=n,
            reward=0.0 if reward is None else reward,
            loss_mask=[0] * n if masked else list(trace.loss_mask), rollout_log_probs=logprobs,
            weight_versions=[str(s.policy_version) for s in spans]
            if any(s.policy_version is not None for s in spans) else [], status=status,
            metadata={
                "session_id": traj.session_id, "task_id": result.task_id, "trace_index": i,
                "builder": traj.builder, "weight": meta.get("weight", 1.0), "finish_reason": trace.finish_reason,
                "completion_ids": meta.get("completion_ids", []), "session_status": SessionStatus(result.status).value,
                "reason": result.reason, "masked": masked, "reward_missing": reward is None,
                "logprobs_missing": not trace.response_logprobs,  # rollout_log_probs then holds placeholder zeros
                "prompt_length": len(trace.prompt_ids),
                "spans": [{"start": s.start, "end": s.end, "policy_version": s.policy_version,
                           "completion_id": s.completion_id} for s in spans],
                **({"images": meta["images"]} if meta.get("images") else {}),
            },
            multimodal_inputs={"images": image_urls_of([*trace.prompt_messages, *trace.response_messages])}
            if meta.get("images") else None))
    return samples


def main_chain(samples: Sequence[SlimeSample]) -> SlimeSample:
    """The sample a one-row-per-session trainer takes from a session's chains (sub-agents, compaction): the one with
    the most trained tokens (the longest response when the session is masked), the first on a tie."""
    if not samples:
        raise ValueError("a session with no chain has no main chain")
    return max(samples, key=lambda s: (sum(s.loss_mask) if not s.metadata["masked"] else s.response_length,
                                       -s.metadata["trace_index"]))


# -- NeMo Gym / NeMo RL -----------------------------------------------------------------------------------------------
class NemoOutputItem(_Export):
    """The token fields of one NeMo Gym ``*ForTraining`` output item (one sampled completion)."""

    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    completion_id: str | None = None
    #: the policy version that sampled this completion (None: not recorded), for staleness and importance weights
    policy_version: int | str | None = None
    #: the capture had no log probs: generation_log_probs holds placeholder zeros, never to be used as pi_old
    logprobs_missing: bool = False


class ContiguityError(ValueError):
    """A list of output items that NeMo RL would reject: a prompt that does not extend what came before it."""

    def __init__(self, message: str, item: int, position: int | None = None) -> None:
        super().__init__(message)
        self.item = item
        self.position = position


class _Span(NamedTuple):
    start: int
    end: int
    completion_id: str | None
    policy_version: int | str | None


def _spans(trace: Trace) -> list[_Span]:
    """Sampled ranges of ``response_ids``: the builder's spans, else the runs of mask 1 (a Trace from elsewhere;
    their version is the trace's when it names exactly one)."""
    spans = trace.metadata.get("spans")
    if spans:
        return sorted((_Span(int(s["start"]), int(s["end"]), s.get("completion_id"), s.get("policy_version"))
                       for s in spans), key=lambda s: (s.start, s.end))
    versions = trace.metadata.get("policy_versions") or []
    version = versions[0] if len(versions) == 1 else None
    runs: list[_Span] = []
    start = None
    for i, m in enumerate([*trace.loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append(_Span(start, i, None, version))
            start = None
    return runs


def nemo_items(trace: Trace) -> list[NemoOutputItem]:
    """One item per sampled completion of ``trace``: item k's prompt is the trace prompt plus ``response_ids`` up to
    the completion's start (cumulative, so the list passes NeMo RL's prefix-contiguity check by construction).

    Under ``on_rerender="merge"`` a later item's prompt holds the sampled tokens rather than the engine's re-rendered
    ones (the paper's approximation); with the default ``"break"`` it is exactly the prompt the engine saw.
    """
    logprobs = list(trace.response_logprobs) if trace.response_logprobs else None
    items = []
    for start, end, completion_id, version in _spans(trace):
        gen = trace.response_ids[start:end]
        items.append(NemoOutputItem.model_construct(
            prompt_token_ids=[*trace.prompt_ids, *trace.response_ids[:start]], generation_token_ids=gen,
            generation_log_probs=logprobs[start:end] if logprobs is not None else [0.0] * len(gen),
            completion_id=completion_id, policy_version=version, logprobs_missing=logprobs is None))
    return items


def nemo_item_chains(source: Source) -> list[list[NemoOutputItem]]:
    """Item lists of every trace, in trace order (index i is ``traj.traces[i]``; a trace with nothing sampled gives
    an empty list). Each list is one contiguous chain: sub-agents and post-compaction chains are separate traces and
    so separate lists; a caller submits each list as its own rollout rather than concatenating them."""
    _, traj = _unpack(source)
    return [nemo_items(t) for t in traj.traces]


def _field(item: NemoOutputItem | Mapping[str, Any], name: str) -> Any:
    return item.get(name) if isinstance(item, Mapping) else getattr(item, name, None)


def check_contiguity(items: Sequence[NemoOutputItem | Mapping[str, Any]]) -> None:
    """NeMo RL's rule: every item carrying ``generation_token_ids`` must have ``prompt_token_ids`` that start with
    every token seen before it (the previous such item's prompt + generation); its log probs must align with its
    generation. Items without tokens (tool outputs) are skipped, as NeMo RL skips them. Raises ContiguityError."""
    seen: list[int] = []
    for i, item in enumerate(items):
        gen = _field(item, "generation_token_ids")
        if not gen:
            continue
        prompt = list(_field(item, "prompt_token_ids") or [])
        logprobs = _field(item, "generation_log_probs")
        if logprobs is None or len(logprobs) != len(gen):
            raise ContiguityError(f"item {i}: generation_log_probs must align with generation_token_ids", i)
        if prompt[:len(seen)] != seen:
            at = next((k for k, (a, b) in enumerate(zip(prompt, seen, strict=False)) if a != b),
                      min(len(prompt), len(seen)))
            raise ContiguityError(
                f"item {i}: prompt_token_ids ({len(prompt)} tokens) do not start with the {len(seen)} tokens seen "
                f"before it; first difference at position {at}", i, at)
        seen = [*prompt, *gen]


# -- JSONL of traces --------------------------------------------------------------------------------------------------
class TraceLine(Trace):
    """A Trace with where it came from, as one JSONL line (``TraceLine.model_validate_json`` reads it back)."""

    session_id: str
    trace_index: int
    builder: str


def trace_lines(source: Source) -> list[TraceLine]:
    _, traj = _unpack(source)
    return [TraceLine.model_construct(**dict(t), session_id=traj.session_id, trace_index=i, builder=traj.builder)
            for i, t in enumerate(traj.traces)]


def trajectory_records(results: Sequence[SessionResult], step: int) -> list[dict[str, Any]]:
    """The lines a training run appends to its trajectories.jsonl for one step: each trace with its session, task,
    the session's reward and the step, as a launch's trajectories.jsonl names them, so ``python -m polar_gym.audit
    OUT_DIR --model VERSION=CHECKPOINT ...`` re-checks any step. Sessions without a trajectory give none."""
    rows: list[dict[str, Any]] = []
    for result in results:
        if result.trajectory is None:
            continue
        reward = result.evaluation.reward if result.evaluation else None
        rows.extend({**line.model_dump(mode="json"), "task_id": result.task_id, "session_reward": reward,
                     "step": step} for line in trace_lines(result))
    return rows


# -- SFT --------------------------------------------------------------------------------------------------------------
class SFTRecord(_Export):
    """One conversation for supervised fine-tuning, in the shape of the paper's released data."""

    instance_id: str
    task_id: str
    session_id: str
    trace_index: int
    builder: str
    reward: float | None = None
    passed: bool | None = None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)


def _content(content: Any) -> Any:
    """All-text parts collapse to one string (what SFT loaders expect); anything else (images) is kept as parts."""
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text") or "") for p in content)
    return content


def openai_message(message: Mapping[str, Any], include_reasoning: bool = True) -> dict[str, Any]:
    """A normalized chat message in OpenAI Chat shape, without empty fields. A ``developer`` message becomes
    ``system``: that is how the chat template rendered it for the model (polar_gym.proxy.tokenizer)."""
    role = "system" if message.get("role") == "developer" else message.get("role")
    out: dict[str, Any] = {"role": role, "content": _content(message.get("content"))}
    if include_reasoning and message.get("reasoning_content"):
        out["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": c.get("type", "function"),
                              "function": {"name": c["function"].get("name"),
                                           "arguments": c["function"].get("arguments", "{}")}}
                             for c in message["tool_calls"]]
    for key in ("tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out


def template_tool(function: Mapping[str, Any]) -> dict[str, Any]:
    """A tool definition as the chat template renders it for the model: ``{type, function: {name, description,
    parameters}}`` in that order, missing fields null. vLLM hands tools to the template this way (``strict`` and any
    other field dropped), and so does the proxy in token_in mode, so an SFT record renders the prompt the policy is
    later sampled with (with pi's ``"strict": false`` kept, it differed by 16 tokens, and a model taught on it
    sampled garbage on the real prompt)."""
    return {"type": "function", "function": {"name": str(function.get("name", "")),
                                             "description": function.get("description"),
                                             "parameters": function.get("parameters")}}


def sft_records(source: Source, instance_id: str | None = None, min_reward: float | None = None,
                include_reasoning: bool = True) -> list[SFTRecord]:
    """One SFTRecord per trace whose reward is at least ``min_reward`` (None: keep all). Use prefix_merging traces:
    a per_request trace repeats the whole history for every call."""
    result, traj = _unpack(source)
    evaluation = result.evaluation
    records = []
    for i, trace in enumerate(traj.traces):
        reward = _reward(trace, result)
        if min_reward is not None and (reward is None or reward < min_reward):
            continue
        messages = [openai_message(m, include_reasoning) for m in [*trace.prompt_messages, *trace.response_messages]
                    if m]
        records.append(SFTRecord(
            instance_id=instance_id or result.task_id, task_id=result.task_id, session_id=traj.session_id,
            trace_index=i, builder=traj.builder, reward=reward,
            passed=evaluation.passed if evaluation is not None else None, messages=messages,
            tools=[template_tool(t.get("function") or {}) for t in trace.tools],
            metadata={"num_messages": len(messages),
                      "num_assistant_turns": sum(m["role"] == "assistant" for m in messages),
                      "finish_reason": trace.finish_reason, "session_status": SessionStatus(result.status).value,
                      "completion_ids": trace.metadata.get("completion_ids", []),
                      "chain_cause": trace.metadata.get("chain_cause")}))
    return records
