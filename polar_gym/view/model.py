"""The viewer's answers, built from plain data: a run's session rows (with filters) and one session opened (its
traces' messages, per-call timings, and each trace's token stream as parallel arrays).

Pure: dicts in, dicts out. The rows come from results.jsonl lines (or the rollout server's store), the traces from
trajectories.jsonl lines (or a stored SessionResult), the calls from the capture journal's CompletionRecords. The
token stream is sent as arrays (ids, mask, logprobs), never one object per token: a 200-turn session is tens of
thousands of tokens, and the page builds its DOM from the arrays in one pass.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from polar_gym.causes import cause_of
from polar_gym.schema.images import image_urls_of

__all__ = ["MAX_ROWS", "SESSION_ID", "RowFilter", "SessionData", "call_rows", "error_cause", "filter_rows",
           "session_payload", "session_row", "trace_prompt", "trace_tokens", "valid_session_id"]

#: the most session rows one answer carries (a run of 100k sessions is paged, not sent whole)
MAX_ROWS = 5000
#: a session id the viewer accepts: what polar_gym's ids are made of; anything else (``..``, ``/``) is a 404
SESSION_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@+=-]{0,255}")


def valid_session_id(session_id: str) -> bool:
    return SESSION_ID.fullmatch(session_id) is not None and ".." not in session_id


@dataclass
class SessionData:
    """One session as a source has it: its result row (results.jsonl's shape), its traces (trajectories.jsonl's
    shape) and its captured calls (CompletionRecord dicts; empty when the source has no journal)."""

    row: dict[str, Any]
    traces: list[dict[str, Any]]
    calls: list[dict[str, Any]]


def error_cause(result: dict[str, Any]) -> str | None:
    """The run's ``error_cause`` when the row carries it (launch writes it); else the same rule the launch uses
    (:func:`polar_gym.causes.cause_of`), for a stored result of a live run."""
    if "error_cause" in result:
        return result["error_cause"] if isinstance(result["error_cause"], str) else None
    metadata = result.get("metadata")
    reason = result.get("reason")
    return cause_of(str(result.get("status") or ""), reason if isinstance(reason, str) else None,
                    metadata if isinstance(metadata, dict) else {})


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def session_row(result: dict[str, Any]) -> dict[str, Any]:
    """A table row: what the filters and the table need, nothing of the traces."""
    evaluation = result.get("evaluation") or {}
    diagnostics = result.get("trajectory_diagnostics") or {}
    metadata = result.get("metadata") or {}
    harness = result.get("harness")
    if not isinstance(harness, str):
        harness_meta = metadata.get("harness")
        harness = harness_meta.get("name") if isinstance(harness_meta, dict) else None
    completions = result.get("completions")
    if completions is None:
        completions = diagnostics.get("completions")
    return {
        "session_id": str(result.get("session_id", "")),
        "task_id": str(result.get("task_id", "")),
        "sample_index": metadata.get("sample_index"),
        "status": str(result.get("status", "")),
        "harness": harness if isinstance(harness, str) else "",
        "reward": _number(evaluation.get("reward")) if isinstance(evaluation, dict) else None,
        "error_cause": error_cause(result),
        "reason": str(result["reason"])[:300] if result.get("reason") else None,
        "traces": result.get("traces", diagnostics.get("traces")),
        "completions": completions,
        "seconds": _number(result.get("seconds", (result.get("timings") or {}).get("total"))),
    }


@dataclass(frozen=True)
class RowFilter:
    """The table's filters; ``None`` matches everything. A reward filter drops rows without a reward."""

    status: str | None = None
    task: str | None = None
    harness: str | None = None
    cause: str | None = None
    reward: float | None = None
    reward_min: float | None = None
    reward_max: float | None = None

    def admits(self, row: dict[str, Any]) -> bool:
        if self.status and row["status"] != self.status:
            return False
        if self.task and self.task not in row["task_id"]:
            return False
        if self.harness and row["harness"] != self.harness:
            return False
        if self.cause and (row["error_cause"] or "none") != self.cause:
            return False
        if self.reward is None and self.reward_min is None and self.reward_max is None:
            return True
        reward = row["reward"]
        if reward is None:
            return False
        if self.reward is not None and not math.isclose(reward, self.reward, abs_tol=1e-9):
            return False
        if self.reward_min is not None and reward < self.reward_min:
            return False
        return self.reward_max is None or reward <= self.reward_max


def filter_rows(rows: list[dict[str, Any]], flt: RowFilter, *, offset: int = 0,
                limit: int = MAX_ROWS) -> dict[str, Any]:
    """The rows that pass ``flt`` (a page of at most ``limit``), their total, and the values each filter offers."""
    kept = [row for row in rows if flt.admits(row)]
    options = {key: sorted({str(row[key] or "none") if key == "error_cause" else str(row[key]) for row in rows})
               for key in ("status", "task_id", "harness", "error_cause")}
    return {"total": len(rows), "matched": len(kept), "offset": offset,
            "sessions": kept[offset: offset + min(limit, MAX_ROWS)], "options": options}


def _spans(trace: dict[str, Any]) -> list[dict[str, Any]]:
    spans = (trace.get("metadata") or {}).get("spans")
    return [s for s in spans if isinstance(s, dict)] if isinstance(spans, list) else []


def call_rows(traces: list[dict[str, Any]], calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per model call: the journal's record (timings, engine, policy version, status) joined with the
    trace span that holds its sampled tokens; a span without a record (no journal) still gets a row."""
    where: dict[str, tuple[int, dict[str, Any]]] = {}
    for index, trace in enumerate(traces):
        for span in _spans(trace):
            cid = str(span.get("completion_id"))
            if cid not in where:
                where[cid] = (index, dict(span))
            elif where[cid][0] == index and "end" in span:  # a generation cut by weight updates: one span a version
                where[cid][1]["end"] = span["end"]
    rows, seen = [], set()
    t0 = min((c["started_at"] for c in calls if _number(c.get("started_at")) is not None), default=None)
    for call in calls:
        cid = str(call.get("completion_id"))
        seen.add(cid)
        trace_index, span = where.get(cid, (None, {}))
        started = _number(call.get("started_at"))
        rows.append({
            "completion_id": cid, "index": call.get("index"), "trace": trace_index,
            "span": [span["start"], span["end"]] if "start" in span else None,
            "engine": call.get("engine"), "server": call.get("server"), "policy_version": call.get("policy_version"),
            "prompt_mode": call.get("prompt_mode"), "side_request": bool(call.get("side_request")),
            "status": call.get("status", "ok"), "error": call.get("error"), "finish_reason": call.get("finish_reason"),
            "prompt_tokens": call.get("prompt_tokens"), "response_tokens": call.get("response_tokens"),
            "offset_seconds": None if started is None or t0 is None else round(started - t0, 4),
            "upstream_seconds": _number(call.get("upstream_seconds")),
            "total_seconds": _number(call.get("total_seconds"))})
    for index, trace in enumerate(traces):
        for span in _spans(trace):
            cid = str(span.get("completion_id"))
            if cid in seen:
                continue
            seen.add(cid)
            rows.append({"completion_id": cid, "index": None, "trace": index, "span": [span.get("start"),
                         span.get("end")], "engine": span.get("engine"), "server": span.get("server"),
                         "policy_version": span.get("policy_version"), "prompt_mode": span.get("prompt_mode"),
                         "side_request": False, "status": None, "error": None, "finish_reason": None,
                         "prompt_tokens": None, "response_tokens": None, "offset_seconds": None,
                         "upstream_seconds": None, "total_seconds": None})
    return rows


def _trace_head(index: int, trace: dict[str, Any]) -> dict[str, Any]:
    metadata = trace.get("metadata") or {}
    return {
        "index": index, "chain": metadata.get("chain"), "chain_cause": metadata.get("chain_cause"),
        "finish_reason": trace.get("finish_reason"), "reward": _number(trace.get("reward")),
        "side_request": bool(metadata.get("side_request")), "policy_versions": metadata.get("policy_versions"),
        "prompt_tokens": len(trace.get("prompt_ids") or ()), "response_tokens": len(trace.get("response_ids") or ()),
        "trainable_tokens": sum(1 for m in trace.get("loss_mask") or () if m == 1),
        "prompt_messages": len(trace.get("prompt_messages") or ()),
        "response_messages": trace.get("response_messages") or [], "spans": _spans(trace)}


def session_payload(data: SessionData) -> dict[str, Any]:
    """One session opened: its row, result details, traces (response messages, chain, spans; a trace's prompt
    messages and tokens are fetched when shown: with the per_request builder every trace repeats the conversation
    so far, and sending every prompt would grow with turns squared) and its calls."""
    result = data.row
    diagnostics = result.get("trajectory_diagnostics") or {}
    evaluation = result.get("evaluation")
    metadata = result.get("metadata") or {}
    return {
        "row": session_row(result), "reason": result.get("reason"), "timings": result.get("timings") or {},
        "status_history": metadata.get("status_history") or [], "evaluation": evaluation,
        "harness_run": metadata.get("harness") if isinstance(metadata.get("harness"), dict) else None,
        "diagnostics": {k: diagnostics.get(k) for k in ("chains", "breaks", "completions", "completions_merged",
                                                          "trainable_tokens", "masked_tokens", "superseded",
                                                          "excluded", "rerender_merged") if k in diagnostics},
        "traces": [_trace_head(i, t) for i, t in enumerate(data.traces)],
        "calls": call_rows(data.traces, data.calls)}


def trace_prompt(trace: dict[str, Any]) -> dict[str, Any]:
    """One trace's prompt messages and tools."""
    return {"prompt_messages": trace.get("prompt_messages") or [], "tools": trace.get("tools") or []}


def trace_images(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """A multimodal trace's images where their placeholders sit (``start``, ``end`` in prompt + response), each with
    its SHA-256 and its pixels as the data URL its messages hold (null when they hold none, or not an image's)."""
    images = [image for image in (trace.get("metadata") or {}).get("images") or [] if isinstance(image, dict)]
    urls = image_urls_of([m for m in [*(trace.get("prompt_messages") or []), *(trace.get("response_messages") or [])]
                          if isinstance(m, dict)])
    if len(urls) != len(images):
        urls = [""] * len(images)
    out = []
    for image, url in zip(images, urls, strict=True):
        span = image.get("prompt_span") if isinstance(image.get("prompt_span"), dict) else None
        if span is None:
            continue
        out.append({"start": span.get("start"), "end": span.get("end"), "sha256": image.get("sha256"),
                    "url": url if url.startswith("data:image/") else None})
    return out


def trace_tokens(trace: dict[str, Any], vocab: dict[int, str] | None) -> dict[str, Any]:
    """One trace's token stream: prompt then response ids, the mask over all of them (the prompt is 0), the
    response's logprobs aligned to it (null where absent; the wire's ``{token, token_id, logprob}`` or floats),
    and the text of each distinct id when a tokenizer is known."""
    prompt = list(trace.get("prompt_ids") or ())
    response = list(trace.get("response_ids") or ())
    mask = list(trace.get("loss_mask") or ())
    logprobs = [x.get("logprob") if isinstance(x, dict) else x for x in trace.get("response_logprobs") or ()]
    ids = prompt + response
    out = {"prompt_len": len(prompt), "ids": ids, "mask": [0] * len(prompt) + mask,
           "logprobs": [None] * len(prompt) + [_number(x) for x in logprobs]
           + [None] * max(0, len(response) - len(logprobs)),
           "spans": _spans(trace), "images": trace_images(trace), "vocab": None}
    if vocab is not None:
        out["vocab"] = {str(i): vocab[i] for i in set(ids) if i in vocab}
    return out
