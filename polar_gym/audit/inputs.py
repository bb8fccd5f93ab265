"""What the audit reads: traces with their token IDs, loss mask, captured logprobs and the policy version of every
sampled span, from any file polar_gym writes.

- a launch output folder: its ``trajectories.jsonl`` (one Trace per line plus session/task fields);
- a JSONL of traces: ``python -m polar_gym.merge --format traces`` (TraceLine) or a launch's trajectories.jsonl;
- a JSONL of Slime samples: ``--format slime`` (``tokens``, ``response_length``, ``rollout_log_probs``).

Pure apart from reading the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_gym.schema import Trace
from polar_gym.schema.images import image_urls_of

__all__ = ["AuditTrace", "Span", "read_traces", "resolve_input", "trace_from_row"]

RUN_FILE = "trajectories.jsonl"
TRACES_FILE = "traces.jsonl"


@dataclass(frozen=True)
class Span:
    """A sampled range ``[start, end)`` of the response and the policy version that sampled it."""

    start: int
    end: int
    policy_version: int | str | None = None


@dataclass
class AuditTrace:
    """One trace as the audit needs it. ``logprobs`` is empty when the capture had none (the trace is skipped)."""

    session_id: str
    trace_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    spans: list[Span] = field(default_factory=list)
    task_id: str | None = None
    #: the images of a multimodal trace, in order, as its metadata records them (``ImageRef``: the placeholders'
    #: ``prompt_span`` in prompt + response positions)
    images: list[dict[str, Any]] = field(default_factory=list)
    #: the same images' data URLs, from the trace's messages (what the model saw, pixels included)
    image_urls: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.session_id}#{self.trace_index}"

    def version_at(self, index: int) -> int | str | None:
        """Policy version of response token ``index`` (None: no span covers it or the span has none)."""
        for span in self.spans:
            if span.start <= index < span.end:
                return span.policy_version
        return None

    def trained_positions(self) -> list[int]:
        """Response indices with loss mask 1."""
        return [i for i, m in enumerate(self.loss_mask) if m]


def _mask_runs(mask: list[int], version: int | str | None = None) -> list[Span]:
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append(Span(start, i, version))
            start = None
    return runs


def _spans(raw: Any, mask: list[int], versions: list[Any]) -> list[Span]:
    if isinstance(raw, list) and raw:
        return [Span(int(s["start"]), int(s["end"]), s.get("policy_version")) for s in raw]
    # no spans recorded: the mask's runs, with the version when the trace names exactly one
    return _mask_runs(mask, versions[0] if len(set(map(str, versions))) == 1 else None)


def _slime(row: Mapping[str, Any], line: int) -> AuditTrace:
    meta = dict(row.get("metadata") or {})
    n = int(row["response_length"])
    tokens = [int(t) for t in row["tokens"]]
    mask = [int(m) for m in row.get("loss_mask") or [0] * n]
    logprobs = [] if meta.get("logprobs_missing") else [float(v) for v in row.get("rollout_log_probs") or []]
    return AuditTrace(
        session_id=str(meta.get("session_id") or f"line{line}"), trace_index=int(meta.get("trace_index") or 0),
        prompt_ids=tokens[:len(tokens) - n], response_ids=tokens[len(tokens) - n:], loss_mask=mask,
        logprobs=logprobs, spans=_spans(meta.get("spans"), mask, list(row.get("weight_versions") or [])),
        task_id=meta.get("task_id"))


def trace_from_row(row: Mapping[str, Any], line: int = 0) -> AuditTrace:
    """An AuditTrace from one JSON line (a Trace with extra fields, or a Slime sample)."""
    if "tokens" in row and "response_length" in row:
        return _slime(row, line)
    trace = Trace.model_validate({k: v for k, v in row.items() if k in Trace.model_fields})
    meta = trace.metadata
    logprobs = [] if meta.get("has_logprobs") is False else list(trace.response_logprobs)
    return AuditTrace(
        session_id=str(row.get("session_id") or meta.get("session_id") or f"line{line}"),
        trace_index=int(row.get("trace_index", meta.get("chain", 0)) or 0),
        prompt_ids=list(trace.prompt_ids), response_ids=list(trace.response_ids), loss_mask=list(trace.loss_mask),
        logprobs=logprobs,
        spans=_spans(meta.get("spans"), list(trace.loss_mask), list(meta.get("policy_versions") or [])),
        task_id=row.get("task_id"), images=list(meta.get("images") or []),
        image_urls=image_urls_of([*trace.prompt_messages, *trace.response_messages]) if meta.get("images") else [])


def resolve_input(path: str | Path) -> Path:
    """The JSONL file behind ``path``: the file itself, or a folder's trajectories.jsonl (a launch) or
    traces.jsonl."""
    p = Path(path)
    if p.is_dir():
        for name in (RUN_FILE, TRACES_FILE):
            if (p / name).is_file():
                return p / name
        raise FileNotFoundError(f"{p}: a folder without {RUN_FILE} or {TRACES_FILE} (expected a launch output "
                                "folder)")
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file or folder")
    return p


def read_traces(path: str | Path) -> Iterator[AuditTrace]:
    """Every trace of a run folder or JSONL file, in file order."""
    with resolve_input(path).open() as f:
        for n, text in enumerate(f, 1):
            if text.strip():
                yield trace_from_row(json.loads(text), n)
