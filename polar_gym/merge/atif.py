"""A built session as an ATIF trajectory (Agent Trajectory Interchange Format v1.8, the `atif` package's models:
Harbor's trajectory format). Pure: a SessionResult or Trajectory in, an ``atif.Trajectory`` out, built from the
package's own models so what we write validates by construction.

Mapping (one ATIF document per session):

- Each trace (one chain of completions) becomes one ATIF trajectory of steps, from its messages in order:
  ``system``/``developer`` -> a system step, ``user`` -> a user step, ``assistant`` -> an agent step (text,
  ``reasoning_content``, ``tool_calls``), and the ``tool`` messages that follow an agent step -> that step's
  observation, each result paired with its call by ``source_call_id``.
- An agent step the chain sampled carries its completion's token data in ``metrics``: ``prompt_token_ids`` (the
  exact prompt the engine saw: the trace prompt and every response token before the reply), ``completion_token_ids``
  and ``logprobs`` (omitted when the capture had none), token counts, and in ``metrics.extra`` the completion id, the
  policy version and the chain. An assistant message the chain did not sample (history a harness re-sent from an
  earlier chain) is an agent step with no metrics and ``is_copied_context``.
- polar_gym keeps every chain: the main conversation is the root (the first trace that is not a side request) and
  every other chain (a sub-agent, the history after a compaction, a side request such as a title) is embedded in
  ``subagent_trajectories`` with ``trajectory_id = "<session>/chain-<i>"``, referenced by a
  ``SubagentTrajectoryRef`` from the root's agent step that was running when it began (on the tool call whose result
  holds the chain's last answer, else the step's only tool call, else a result of its own), cause in ``extra``.
- Session status, reason, reward and the builder's diagnostics go to the root's ``extra``; an errored session with no
  completions is a trajectory with no steps and the reason in ``notes``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import atif

from polar_gym.schema import SessionResult, SessionStatus, Trace, Trajectory

__all__ = ["ATIF_SCHEMA_VERSION", "atif_json", "atif_trajectory"]

ATIF_SCHEMA_VERSION = "ATIF-v1.8"
_IMAGE_TYPES: dict[str, atif.ImageMediaType] = {"jpeg": "image/jpeg", "jpg": "image/jpeg", "png": "image/png",
                                                "gif": "image/gif", "webp": "image/webp"}


# -- content ----------------------------------------------------------------------------------------------------------
def _image(url: str) -> atif.ContentPart | None:
    """An image part of a normalized message as ATIF's image reference (a data: URL or a link), when its media type
    is one ATIF knows."""
    if url.startswith("data:"):
        kind = url[5:].split(";", 1)[0].split(",", 1)[0].lower()
        media = next((m for m in _IMAGE_TYPES.values() if m == kind), None)
    else:
        media = _IMAGE_TYPES.get(url.rsplit("?", 1)[0].rsplit(".", 1)[-1].lower())
    if media is None:
        return None
    return atif.ContentPart(type="image", source=atif.ImageSource(media_type=media, path=url))


def _text_of(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def _content(content: Any) -> str | list[atif.ContentPart]:
    """A normalized message's content as ATIF's: text stays text, all-text parts join into one string, images become
    image parts, anything else (a JSON value a tool returned) is written as its JSON text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return _text_of(content)
    parts: list[atif.ContentPart] = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") == "text":
            parts.append(atif.ContentPart(type="text", text=_text_of(part.get("text") or "")))
            continue
        image = part.get("image_url") if isinstance(part, Mapping) else None
        url = image.get("url") if isinstance(image, Mapping) else image
        made = _image(url) if isinstance(url, str) else None
        parts.append(made or atif.ContentPart(type="text", text=_text_of(part)))
    if all(p.type == "text" for p in parts):
        return "".join(p.text or "" for p in parts)
    return parts


def _plain(content: str | list[atif.ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text or "" for p in content)


def _arguments(raw: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Call arguments as the JSON object ATIF wants; text that is not one is kept whole under ``extra``."""
    if isinstance(raw, Mapping):
        return dict(raw), None
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw) if raw.strip() else {}
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed, None
    return {}, {"raw_arguments": raw if isinstance(raw, str) else _text_of(raw)}


# -- one chain --------------------------------------------------------------------------------------------------------
#: the ``extra`` of a system step holding tool outputs that follow no agent step (a history that starts mid-loop)
_ORPHANS = {"orphan_tool_results": True}


@dataclass
class _Sampled:
    """The token data of one completion of a chain, from the trace's span."""

    completion_id: str | None
    completion_index: int | None
    metrics: atif.Metrics


@dataclass
class _Chain:
    steps: list[atif.Step] = field(default_factory=list)
    #: (step position, completion index) of every agent step the chain sampled
    sampled: list[tuple[int, int | None]] = field(default_factory=list)
    unmatched: list[str | None] = field(default_factory=list)


def _per_completion(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One span per completion: a generation a weight update cut has one per version (ATIF's step is the whole
    call; it names the version of the last token, as the completion's record does)."""
    out: list[dict[str, Any]] = []
    for span in spans:
        if out and span.get("cut") and out[-1].get("completion_id") == span.get("completion_id"):
            out[-1] = {**out[-1], "end": span["end"], "policy_version": span.get("policy_version")}
        else:
            out.append(span)
    return out


def _sampled(trace: Trace, prompt_ids: bool) -> list[_Sampled]:
    meta = trace.metadata
    spans = _per_completion(sorted(meta.get("spans") or [], key=lambda s: int(s["start"])))
    indices = dict(zip(meta.get("completion_ids") or [], meta.get("completion_indices") or [], strict=False))
    logprobs = trace.response_logprobs or None
    out = []
    for span in spans:
        start, end = int(span["start"]), int(span["end"])
        extra = {"completion_id": span.get("completion_id"), "policy_version": span.get("policy_version"),
                 "chain": meta.get("chain"), "response_start": start, "response_end": end}
        if span.get("unparseable_tool_calls"):
            extra["unparseable_tool_calls"] = span["unparseable_tool_calls"]
        out.append(_Sampled(span.get("completion_id"), indices.get(span.get("completion_id")), atif.Metrics(
            prompt_tokens=len(trace.prompt_ids) + start, completion_tokens=end - start,
            prompt_token_ids=[*trace.prompt_ids, *trace.response_ids[:start]] if prompt_ids else None,
            completion_token_ids=trace.response_ids[start:end],
            logprobs=logprobs[start:end] if logprobs is not None else None,
            extra={k: v for k, v in extra.items() if v is not None})))
    return out


def _agent_step(step_id: int, message: Mapping[str, Any], sampled: _Sampled | None) -> atif.Step:
    calls = []
    for k, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") if isinstance(call, Mapping) else None
        function = function if isinstance(function, Mapping) else {}
        arguments, extra = _arguments(function.get("arguments"))
        call_id = call.get("id") if isinstance(call, Mapping) else None
        calls.append(atif.ToolCall(tool_call_id=str(call_id or f"call-{step_id}-{k}"),
                                   function_name=str(function.get("name") or ""), arguments=arguments, extra=extra))
    reasoning = message.get("reasoning_content")
    return atif.Step(step_id=step_id, source="agent", message=_content(message.get("content")),
                     reasoning_content=_text_of(reasoning) if reasoning else None, tool_calls=calls or None,
                     metrics=sampled.metrics if sampled else None, llm_call_count=1 if sampled else None,
                     is_copied_context=None if sampled else True)


def _result(message: Mapping[str, Any], step: atif.Step | None) -> atif.ObservationResult:
    """A tool message as an observation result, paired with its call when the step made it."""
    call_id = message.get("tool_call_id")
    ids = {c.tool_call_id for c in (step.tool_calls or [])} if step is not None else set()
    paired = str(call_id) if call_id is not None and str(call_id) in ids else None
    extra = {k: message[k] for k in ("name",) if message.get(k)}
    if call_id is not None and paired is None:
        extra["tool_call_id"] = str(call_id)  # a result whose call is not in this step: kept, unpaired
    return atif.ObservationResult(source_call_id=paired, content=_content(message.get("content")),
                                  extra=extra or None)


def _chain_steps(trace: Trace, prompt_ids: bool) -> _Chain:
    prompt = [m for m in trace.prompt_messages if m]
    messages = [*prompt, *(m for m in trace.response_messages if m)]
    sampled = _sampled(trace, prompt_ids)
    replies = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and i >= len(prompt)]
    # the chain's replies are its last assistant messages, one per completion (paired from the end)
    by_position = dict(zip(reversed(replies), reversed(sampled), strict=False))
    chain = _Chain(unmatched=[s.completion_id for s in sampled[:max(0, len(sampled) - len(replies))]])
    for position, message in enumerate(messages):
        role = message.get("role")
        step_id = len(chain.steps) + 1
        if role in ("tool", "function"):  # "function": the legacy OpenAI name of a tool output
            last = chain.steps[-1] if chain.steps else None
            if last is None or (last.source != "agent" and last.extra != _ORPHANS):
                last = atif.Step(step_id=step_id, source="system", message="", extra=dict(_ORPHANS),
                                 observation=atif.Observation(results=[]))
                chain.steps.append(last)
            observation = last.observation or atif.Observation(results=[])
            observation.results.append(_result(message, last))
            last.observation = observation
        elif role == "assistant":
            taken = by_position.get(position)
            chain.steps.append(_agent_step(step_id, message, taken))
            if taken is not None:
                chain.sampled.append((len(chain.steps) - 1, taken.completion_index))
        else:
            extra = {"role": role} if role not in ("system", "user") else None
            chain.steps.append(atif.Step(step_id=step_id, source="system" if role in ("system", "developer")
                                         else "user", message=_content(message.get("content")), extra=extra))
    return chain


def _final_metrics(steps: Sequence[atif.Step], extra: dict[str, Any] | None = None) -> atif.FinalMetrics:
    metrics = [s.metrics for s in steps if s.metrics is not None]
    return atif.FinalMetrics(total_prompt_tokens=sum(m.prompt_tokens or 0 for m in metrics),
                             total_completion_tokens=sum(m.completion_tokens or 0 for m in metrics),
                             total_steps=len(steps), extra=extra)


# -- sub-chains -------------------------------------------------------------------------------------------------------
def _attach(root: _Chain, ref: atif.SubagentTrajectoryRef, started_at: int | None, answer: str) -> None:
    """Reference a chain from the root's agent step that was running when it began (the last one sampled before
    its first completion; the root's first step when none was)."""
    before = [pos for pos, index in root.sampled if index is not None and started_at is not None
              and index < started_at]
    if not root.steps:
        return
    step = root.steps[before[-1] if before else 0]
    observation = step.observation or atif.Observation(results=[])
    step.observation = observation
    calls = [c.tool_call_id for c in step.tool_calls or []]
    results = {r.source_call_id: r for r in observation.results if r.source_call_id is not None}
    target = next((results[c] for c in calls if c in results and answer
                   and answer in _plain(results[c].content or "")), None)
    if target is None and len(calls) == 1 and calls[0] in results:
        target = results[calls[0]]
    if target is None:
        observation.results.append(atif.ObservationResult(subagent_trajectory_ref=[ref]))
    else:
        target.subagent_trajectory_ref = [*(target.subagent_trajectory_ref or []), ref]


def _last_answer(chain: _Chain) -> str:
    agent = [s for s in chain.steps if s.source == "agent"]
    return _plain(agent[-1].message).strip() if agent else ""


# -- the session ------------------------------------------------------------------------------------------------------
def _unpack(source: SessionResult | Trajectory) -> tuple[SessionResult, Trajectory]:
    if isinstance(source, Trajectory):
        return SessionResult(session_id=source.session_id, task_id=source.session_id,
                             status=SessionStatus.COMPLETED, trajectory=source), source
    return source, source.trajectory or Trajectory(session_id=source.session_id)


def _session_extra(result: SessionResult, traj: Trajectory) -> dict[str, Any]:
    d = traj.diagnostics
    evaluation = result.evaluation
    extra: dict[str, Any] = {
        "task_id": result.task_id, "status": SessionStatus(result.status).value, "reason": result.reason,
        "builder": traj.builder, "traces": len(traj.traces),
        "reward": evaluation.reward if evaluation is not None else None,
        "passed": evaluation.passed if evaluation is not None else None,
        "diagnostics": {k: d[k] for k in ("completions", "breaks", "excluded", "superseded", "trainable_tokens",
                                          "masked_tokens", "completions_without_logprobs") if k in d},
    }
    return {k: v for k, v in extra.items() if v is not None}


def atif_trajectory(source: SessionResult | Trajectory, agent_name: str | None = None,
                    agent_version: str | None = None, model_name: str | None = None,
                    prompt_token_ids: bool = True) -> atif.Trajectory:
    """One session as an ATIF trajectory (see the module docstring for the mapping). ``agent_name`` is the harness
    when the caller knows it; ``prompt_token_ids=False`` leaves out each step's prompt IDs (they repeat the whole
    chain so far: a long session's are most of the document)."""
    result, traj = _unpack(source)
    agent = atif.Agent(name=agent_name or "unknown", version=agent_version or "unknown", model_name=model_name,
                       extra={"captured_by": "polar_gym"})
    chains = [_chain_steps(t, prompt_token_ids) for t in traj.traces]
    main = next((i for i, t in enumerate(traj.traces) if not t.metadata.get("side_request")), 0)
    extra = _session_extra(result, traj)
    if not chains:
        notes = f"session {SessionStatus(result.status).value}" + (f": {result.reason}" if result.reason else "")
        return atif.Trajectory(schema_version=ATIF_SCHEMA_VERSION, session_id=traj.session_id,
                               trajectory_id=traj.session_id, agent=agent, steps=[], notes=notes,
                               final_metrics=_final_metrics([]), extra=extra)
    root = chains[main]
    subs = []
    for i, (trace, chain) in enumerate(zip(traj.traces, chains, strict=True)):
        if i == main:
            continue
        sub_id = f"{traj.session_id}/chain-{i}"
        cause = trace.metadata.get("chain_cause")
        info = {k: v for k, v in {"chain_cause": cause, "trace_index": i,
                                  "side_request": trace.metadata.get("side_request") or None}.items() if v is not None}
        indices = trace.metadata.get("completion_indices") or [None]
        _attach(root, atif.SubagentTrajectoryRef(trajectory_id=sub_id, session_id=traj.session_id, extra=info),
                indices[0], _last_answer(chain))
        subs.append(atif.Trajectory(
            schema_version=ATIF_SCHEMA_VERSION, session_id=traj.session_id, trajectory_id=sub_id,
            agent=agent.model_copy(update={"tool_definitions": _tools(trace)}), steps=chain.steps,
            final_metrics=_final_metrics(chain.steps), extra={**_chain_extra(trace, chain), **info}))
    return atif.Trajectory(
        schema_version=ATIF_SCHEMA_VERSION, session_id=traj.session_id, trajectory_id=traj.session_id,
        agent=agent.model_copy(update={"tool_definitions": _tools(traj.traces[main])}), steps=root.steps,
        final_metrics=_final_metrics(root.steps), subagent_trajectories=subs or None,
        extra={**extra, "trace_index": main, **_chain_extra(traj.traces[main], root)})


def _tools(trace: Trace) -> list[dict[str, Any]] | None:
    return [dict(t) for t in trace.tools] or None


def _chain_extra(trace: Trace, chain: _Chain) -> dict[str, Any]:
    out: dict[str, Any] = {"chain_cause": trace.metadata.get("chain_cause"), "finish_reason": trace.finish_reason,
                           "reward": trace.reward,
                           "has_logprobs": trace.metadata.get("has_logprobs")}
    if chain.unmatched:  # completions no assistant message of the chain showed (their tokens are in the trace)
        out["completions_without_a_message"] = chain.unmatched
    return {k: v for k, v in out.items() if v is not None}


def atif_json(source: SessionResult | Trajectory, **options: Any) -> dict[str, Any]:
    """:func:`atif_trajectory` as JSON (unset fields left out), as the CLI and the routes write it."""
    return atif_trajectory(source, **options).to_json_dict()
