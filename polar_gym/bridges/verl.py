"""verl bridge: an agent loop for verl 0.9.1 (``AgentLoopBase``) that runs each sample as one Polar session on the
rollout server, so verl trains any harness polar_gym runs, on prefix-merged traces, instead of its own tool loop.

    # agent_loops.yaml, named by actor_rollout_ref.rollout.agent.agent_loop_config_path
    - name: polar
      _target_: polar_gym.bridges.verl.PolarAgentLoop

    POLAR_SERVER_URL=http://HOST:8700 POLAR_ADMIN_TOKEN=... (the rollout server; gateways registered with it)

A dataset row names its task in ``extra_info["polar_task"]`` (or a top-level ``polar_task`` column): the TaskRequest
fields as a JSON string (or a dict); ``task_id`` and ``num_samples`` are set here. verl repeats each prompt
``rollout.n`` times and calls the agent loop once per copy, so each call is one task with one session; the copies
share verl's ``uid``, which becomes the task's ``metadata.group_id``. verl's temperature / top_p / top_k (its
validation values when validating) replace the harness's on every model call unless the task sets
``metadata.sampling``.

The output is the session's main chain (:func:`verl_row`): ``prompt_ids`` and ``response_ids`` are the trace's
captured token ids, split where the first sampled turn starts, never re-encoded; ``response_mask`` is 1 on sampled
tokens and 0 on tokens the harness or the environment wrote; ``response_logprobs`` the engine's logprobs;
``reward_score`` the evaluator's reward. verl pads every row to ``rollout.prompt_length`` and
``rollout.response_length``, so a row must fit:

- a prompt longer than ``prompt_length`` is never cut (the trained tokens would lose their context): the row is
  masked (``polar_overflow="prompt"``);
- a response longer than ``response_length`` is cut at ``response_length``: ids, mask and logprobs at the same
  position, so every kept token keeps its own mask and logprob (``polar_truncated``, ``polar_dropped_tokens``;
  verl's own tool loop cuts there too). ``overflow="mask"`` masks such a row instead.

A row that is not trained (session not COMPLETED, no reward, overflow, no model call at all) has an all-zero
``response_mask``, ``reward_score`` 0.0 and ``polar_masked`` True with the cause in ``polar_reason``; it keeps the
group size verl expects. Every row carries the same ``extra_fields`` keys (:data:`EXTRA_FIELDS`): verl turns each
into a column of the batch and concatenates the workers' batches.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from polar_gym.bridges.common import BridgeSettings, trainer_sampling
from polar_gym.merge.exports import main_chain, slime_samples
from polar_gym.schema import SessionResult, SessionStatus, TaskRequest
from polar_gym.server.client import RolloutClient

__all__ = ["AGENT_NAME", "EXTRA_FIELDS", "VerlBridgeSettings", "VerlRow", "run_session", "session_task", "task_spec",
           "verl_row"]

log = logging.getLogger(__name__)

#: the agent loop's name in the agent loop config file (the dataset's ``agent_name`` or verl's default_agent_loop)
AGENT_NAME = "polar"

#: the keys of every row's ``extra_fields`` (always all of them: verl's batches concatenate column by column)
EXTRA_FIELDS = ("polar_session_id", "polar_task_id", "polar_status", "polar_masked", "polar_reason",
                "polar_overflow", "polar_truncated", "polar_dropped_tokens", "polar_policy_versions", "polar_spans",
                "polar_extra_chains", "polar_reward_missing", "polar_logprobs_missing")

_AGENT_LOOP_MODULE = "verl.experimental.agent_loop.agent_loop"


class VerlBridgeSettings(BridgeSettings):
    """Where the rollout server is and how samples become tasks (``POLAR_*`` environment variables by default: verl
    builds the agent loop itself, in its Ray workers, so the settings cannot be handed in)."""

    bridge_name: ClassVar[str] = "the verl bridge"

    task_key: str = "polar_task"
    #: a response longer than verl's response_length: "truncate" keeps its first response_length tokens, "mask"
    #: keeps the row untrained
    overflow: Literal["truncate", "mask"] = "truncate"
    #: "trainer": verl's temperature / top_p / top_k replace the harness's on every model call; "harness": the
    #: harness's own (a task's metadata.sampling always wins)
    sampling: Literal["trainer", "harness"] = "trainer"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> VerlBridgeSettings:
        env = os.environ if environ is None else environ
        base = cls.server_env(env, " in the environment of verl's workers (e.g. ray runtime_env env_vars)")
        optional = {"overflow": env.get("POLAR_VERL_OVERFLOW"), "sampling": env.get("POLAR_VERL_SAMPLING"),
                    "task_key": env.get("POLAR_TASK_KEY")}
        return cls.model_validate({**base, **{k: v for k, v in optional.items() if v}})


class VerlRow(BaseModel):
    """The fields of one verl ``AgentLoopOutput``, token ids only (verl never re-encodes them)."""

    model_config = ConfigDict(extra="forbid")

    prompt_ids: list[int] = Field(min_length=1)
    response_ids: list[int] = Field(min_length=1)
    response_mask: list[int]
    response_logprobs: list[float]
    reward_score: float
    num_turns: int
    #: AgentLoopMetrics fields: the session's wall time as generation, its build and evaluation as scoring
    metrics: dict[str, float]
    extra_fields: dict[str, Any]

    @model_validator(mode="after")
    def _aligned(self) -> VerlRow:
        if not len(self.response_mask) == len(self.response_logprobs) == len(self.response_ids):
            raise ValueError("response_mask and response_logprobs must have one entry per response token")
        if set(self.extra_fields) != set(EXTRA_FIELDS):
            raise ValueError("extra_fields must hold exactly EXTRA_FIELDS")
        return self


def _extra(result: SessionResult, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {key: None for key in EXTRA_FIELDS}
    base.update(polar_session_id=result.session_id, polar_task_id=result.task_id,
                polar_status=SessionStatus(result.status).value, polar_masked=False, polar_reason=result.reason,
                polar_truncated=False, polar_dropped_tokens=0, polar_policy_versions=[], polar_spans=[],
                polar_extra_chains=0, polar_reward_missing=False, polar_logprobs_missing=False)
    base.update(fields)
    return base


def _metrics(result: SessionResult) -> dict[str, float]:
    return {"generate_sequences": float(result.timings.get("total", 0.0)),
            "compute_score": float(result.timings.get("postrun", 0.0))}


def verl_row(result: SessionResult, *, prompt_length: int, response_length: int, filler_id: int,
             extra_chains: Literal["main", "fail"] = "main",
             overflow: Literal["truncate", "mask"] = "truncate") -> VerlRow:
    """A session's main chain as one verl row that fits verl's padded lengths (module docstring); ``filler_id``
    (the tokenizer's pad or end token) is the one-token prompt and response of a row with nothing that fits."""
    if prompt_length < 1 or response_length < 1:
        raise ValueError("prompt_length and response_length must be at least 1")
    chains = slime_samples(result)
    if len(chains) > 1 and extra_chains == "fail":
        raise ValueError(f"session {result.session_id} has {len(chains)} chains (extra_chains='fail')")
    if not chains:
        return _placeholder(result, filler_id, result.reason or "the session made no model call")
    main = main_chain(chains)
    meta = main.metadata
    cut = int(meta["prompt_length"])
    prompt, response = main.tokens[:cut], main.tokens[cut:]
    if len(prompt) > prompt_length:
        return _placeholder(result, filler_id, f"prompt of {len(prompt)} tokens exceeds prompt_length="
                            f"{prompt_length} (never cut: the trained tokens would lose their context)",
                            polar_overflow="prompt", polar_extra_chains=len(chains) - 1)
    mask, logprobs = list(main.loss_mask), list(main.rollout_log_probs)
    dropped = max(0, len(response) - response_length)
    reasons = []
    if meta["masked"]:
        reasons.append(f"session {SessionStatus(result.status).value}: {result.reason or 'no reason given'}")
    if meta["reward_missing"]:
        reasons.append("no reward (the evaluator gave none)")
    if main.multimodal_inputs:  # verl would run the placeholders through the model without their pixels
        reasons.append("images in the prompt (the verl bridge carries no pixels yet)")
    if dropped and overflow == "mask":
        reasons.append(f"response of {len(response)} tokens exceeds response_length={response_length}")
    if dropped:
        response, mask, logprobs = response[:response_length], mask[:response_length], logprobs[:response_length]
    if not reasons and not any(mask):
        reasons.append(f"no sampled token within response_length={response_length}")
    trace = result.trajectory.traces[meta["trace_index"]] if result.trajectory else None
    # verl counts messages (user, assistant, tool): the prompt, then each run of sampled or written tokens
    turns = 1 + _runs(trace.loss_mask if trace is not None else main.loss_mask)
    extra = _extra(result, polar_masked=bool(reasons), polar_reason="; ".join(reasons) or result.reason,
                   polar_overflow="response" if dropped else None, polar_truncated=bool(dropped),
                   polar_dropped_tokens=dropped, polar_policy_versions=list(main.weight_versions),
                   polar_spans=meta["spans"], polar_extra_chains=len(chains) - 1,
                   polar_reward_missing=meta["reward_missing"], polar_logprobs_missing=meta["logprobs_missing"])
    return VerlRow(prompt_ids=prompt, response_ids=response, response_mask=[0] * len(mask) if reasons else mask,
                   response_logprobs=logprobs, reward_score=0.0 if reasons else float(main.reward),
                   num_turns=turns, metrics=_metrics(result), extra_fields=extra)


def _runs(mask: list[int]) -> int:
    return sum(1 for i, m in enumerate(mask) if i == 0 or m != mask[i - 1])


def _placeholder(result: SessionResult, filler_id: int, reason: str, **fields: Any) -> VerlRow:
    return VerlRow(prompt_ids=[filler_id], response_ids=[filler_id], response_mask=[0], response_logprobs=[0.0],
                   reward_score=0.0, num_turns=0, metrics=_metrics(result),
                   extra_fields=_extra(result, polar_masked=True, polar_reason=reason, **fields))


def task_spec(sample: Mapping[str, Any], task_key: str = "polar_task") -> dict[str, Any]:
    """The task fields a dataset row carries: ``sample[task_key]``, else ``sample["extra_info"][task_key]``; a JSON
    string (what survives a parquet file whatever the tasks' shapes) or a mapping."""
    raw = sample.get(task_key)
    if raw is None:
        raw = (sample.get("extra_info") or {}).get(task_key)
    if isinstance(raw, str | bytes):
        raw = json.loads(raw)
    if not isinstance(raw, Mapping) or not raw:
        raise ValueError(f"the dataset row has no {task_key!r} (in extra_info or as a column): put the Polar task "
                         "there, TaskRequest fields as a JSON string")
    return dict(raw)


def session_task(spec: Mapping[str, Any], sampling_params: Mapping[str, Any], *, uid: str | None = None,
                 sampling: Literal["trainer", "harness"] = "trainer") -> TaskRequest:
    """One sample's TaskRequest: one session; ``metadata.group_id`` is verl's ``uid`` (the GRPO group)."""
    task_id = f"verl-{uuid.uuid4().hex[:12]}"
    request = TaskRequest.model_validate({**spec, "task_id": task_id, "num_samples": 1})
    update: dict[str, Any] = {"group_id": f"verl-{uid}" if uid else task_id}
    if sampling == "trainer" and request.metadata.sampling is None:
        update["sampling"] = trainer_sampling(sampling_params.get("temperature"), sampling_params.get("top_p"),
                                              sampling_params.get("top_k"))
    return request.model_copy(update={"metadata": request.metadata.model_copy(update=update)})


async def run_session(task: TaskRequest, settings: VerlBridgeSettings,
                      transport: httpx.AsyncBaseTransport | None = None) -> SessionResult:
    """Submit ``task`` (one session) and wait for its result. Past ``settings.timeout_seconds`` the task is
    cancelled and an ERROR result stands in for it (one slow session does not fail verl's step)."""
    async with RolloutClient(settings.server_url, settings.admin_token, transport=transport) as client:
        await client.submit(task)
        try:
            async for result in client.results([task.task_id], timeout=settings.timeout_seconds):
                return result
        except TimeoutError:
            await client.cancel(task.task_id)
            return SessionResult(session_id=f"{task.task_id}-timeout", task_id=task.task_id,
                                 status=SessionStatus.ERROR,
                                 reason=f"no result after {settings.timeout_seconds} s (the task was cancelled)")
    raise RuntimeError(f"task {task.task_id} ended without a session result")


def _filler_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def _agent_loop_class() -> type:
    """verl's AgentLoopBase subclass, built on first use so this module imports without verl."""
    agent_loop = importlib.import_module(_AGENT_LOOP_MODULE)

    class PolarAgentLoop(agent_loop.AgentLoopBase):  # type: ignore[misc,name-defined]
        """verl's agent loop for one Polar session per sample (polar_gym.bridges.verl)."""

        #: tests put an httpx transport here; None: the network
        transport: httpx.AsyncBaseTransport | None = None

        async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
            settings = VerlBridgeSettings.from_env()
            uid = kwargs.get("uid")
            task = session_task(task_spec(kwargs, settings.task_key), sampling_params,
                                uid=str(uid) if uid is not None else None, sampling=settings.sampling)
            result = await run_session(task, settings, self.transport)
            row = verl_row(result, prompt_length=int(self.rollout_config.prompt_length),
                           response_length=int(self.rollout_config.response_length),
                           filler_id=_filler_id(self.tokenizer), extra_chains=settings.extra_chains,
                           overflow=settings.overflow)
            if row.extra_fields["polar_masked"]:
                log.warning("session %s not trained: %s", result.session_id, row.extra_fields["polar_reason"])
            return agent_loop.AgentLoopOutput(
                prompt_ids=row.prompt_ids, response_ids=row.response_ids, response_mask=row.response_mask,
                response_logprobs=row.response_logprobs, reward_score=row.reward_score, num_turns=row.num_turns,
                metrics=agent_loop.AgentLoopMetrics(**row.metrics), extra_fields=dict(row.extra_fields))

    PolarAgentLoop.__module__ = __name__
    PolarAgentLoop.__qualname__ = "PolarAgentLoop"
    agent_loop.register(AGENT_NAME)(PolarAgentLoop)
    return PolarAgentLoop


_built: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    """``PolarAgentLoop``: verl's class, built (and registered as "polar") on first access; hydra's
    ``_target_: polar_gym.bridges.verl.PolarAgentLoop`` reaches it this way."""
    if name == "PolarAgentLoop":
        if name not in _built:
            _built[name] = _agent_loop_class()
        return _built[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
