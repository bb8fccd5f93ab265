"""What every trajectory builder shares: its configuration, which completions are trainable, and how a trace's
token arrays, messages and provenance are assembled. Pure: token data in, traces out (no I/O, no tokenizer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from polar_gym.merge.tool_calls import MALFORMED_POLICIES, MalformedToolCallPolicy
from polar_gym.schema import CompletionRecord, CompletionSession, Trace, Trajectory

__all__ = [
    "QWEN_END_OF_TURN_IDS",
    "Builder",
    "MergeConfig",
    "TraceBuilder",
    "partition",
    "trajectory",
]

#: ``<|im_end|>`` and ``<|endoftext|>`` of Qwen2/Qwen3 tokenizers
QWEN_END_OF_TURN_IDS = (151645, 151643)


@dataclass(frozen=True)
class MergeConfig:
    """How to read turn boundaries and what to do with completions that do not chain cleanly.

    ``end_of_turn_ids`` come from the tokenizer / engine configuration (any of them ends a turn).
    ``on_rerender``: when the next prompt re-renders a reply differently from the sampled tokens (retokenization
    drift, a template that drops thinking), ``"break"`` starts a new chain so nothing is trained out of context;
    ``"merge"`` keeps the chain as the paper does (sampled tokens trained, re-rendered ones ignored).
    ``keep_superseded``: a retried prompt's discarded first attempt is reported in diagnostics; set this to also
    emit it as a trace.
    """

    end_of_turn_ids: tuple[int, ...] = QWEN_END_OF_TURN_IDS
    on_rerender: Literal["break", "merge"] = "break"
    keep_superseded: bool = False
    include_side_requests: bool = True
    #: what trainers get from a trace with a malformed tool call (polar_gym.merge.tool_calls)
    malformed_tool_calls: MalformedToolCallPolicy = "reward_zero_keep"

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> MergeConfig:
        data = dict(data or {})
        if "end_of_turn_ids" in data:
            data["end_of_turn_ids"] = tuple(int(t) for t in data["end_of_turn_ids"])
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown builder config keys: {sorted(unknown)}")
        if data.get("malformed_tool_calls", MALFORMED_POLICIES[0]) not in MALFORMED_POLICIES:
            raise ValueError(f"builder config malformed_tool_calls {data['malformed_tool_calls']!r} is not one of "
                             f"{', '.join(MALFORMED_POLICIES)}")
        return cls(**data)


Builder = Callable[[CompletionSession, MergeConfig], Trajectory]


def partition(session: CompletionSession, config: MergeConfig) -> tuple[list[CompletionRecord], dict[str, list[str]]]:
    """The completions a builder may train on, in journal order, and the others by reason (never silently lost)."""
    usable: list[CompletionRecord] = []
    excluded: dict[str, list[str]] = {}
    for rec in sorted(session.completions, key=lambda r: r.index):
        if rec.status != "ok":
            excluded.setdefault("error", []).append(rec.completion_id)
        elif not rec.token_faithful:
            excluded.setdefault("not_token_faithful", []).append(rec.completion_id)
        elif not rec.prompt_ids or not rec.response_ids:
            excluded.setdefault("empty", []).append(rec.completion_id)
        elif rec.side_request and not config.include_side_requests:
            excluded.setdefault("side_request", []).append(rec.completion_id)
        else:
            usable.append(rec)
    return usable, excluded


def _messages(rec: CompletionRecord) -> list[dict[str, Any]]:
    msgs = rec.normalized_request.get("messages")
    return msgs if isinstance(msgs, list) else []


@dataclass
class TraceBuilder:
    """Accumulates one chain: p1, then per completion the unsampled bridge (mask 0) and the sampled reply (mask 1)."""

    first: CompletionRecord
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    records: list[CompletionRecord] = field(default_factory=list)
    spans: list[dict[str, Any]] = field(default_factory=list)
    without_logprobs: list[str] = field(default_factory=list)
    #: each malformed tool-call block sampled in this chain, at its tokens in ``response_ids``
    malformed: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.add(self.first, [])

    @property
    def last(self) -> CompletionRecord:
        return self.records[-1]

    def add(self, rec: CompletionRecord, bridge: list[int]) -> None:
        """Append ``bridge`` (tokens the policy did not sample: tool results, next user turn) and ``rec``'s reply."""
        self.response_ids += bridge
        self.loss_mask += [0] * len(bridge)
        self.logprobs += [0.0] * len(bridge)
        start = len(self.response_ids)
        self.response_ids += rec.response_ids
        self.loss_mask += [1] * len(rec.response_ids)
        if rec.response_logprobs:
            self.logprobs += rec.response_logprobs
        else:  # placeholders keep the spans aligned; build() drops them all: a trace never trains on made-up 0.0s
            self.logprobs += [0.0] * len(rec.response_ids)
            self.without_logprobs.append(rec.completion_id)
        self.records.append(rec)
        span = {"completion_id": rec.completion_id, "start": start, "end": len(self.response_ids),
                "policy_version": rec.policy_version, "engine": rec.engine, "server": rec.server,
                "prompt_mode": rec.prompt_mode}
        if rec.unparseable_tool_calls:  # sampled tool calls the proxy answered as text: a trainer may mask the span
            span["unparseable_tool_calls"] = rec.unparseable_tool_calls
            self.malformed += malformed_calls(rec, start)
        if rec.version_spans:  # a generation weight updates cut: one span per version, each token its own version
            self.spans += [{**span, "start": start + part["start"], "end": start + part["end"],
                            "policy_version": part["policy_version"], "cut": True} for part in rec.version_spans]
        else:
            self.spans.append(span)

    def build(self, chain_index: int, extra: dict[str, Any] | None = None) -> Trace:
        first_msgs = _messages(self.first)
        last_msgs = _messages(self.last)
        response_messages = [*last_msgs[len(first_msgs):], self.last.response.get("message") or {}]
        tools = self.first.normalized_request.get("tools") or []
        versions = {s["policy_version"] for s in self.spans}
        unparseable = [r.completion_id for r in self.records if r.unparseable_tool_calls]
        metadata: dict[str, Any] = {
            "session_id": self.first.session_id,
            "chain": chain_index,
            "completion_ids": [r.completion_id for r in self.records],
            "completion_indices": [r.index for r in self.records],
            "engine": self.first.engine,
            "spans": self.spans,
            "policy_versions": sorted(versions, key=str) if versions != {None} else [],
            "side_request": self.first.side_request,
            "has_logprobs": not self.without_logprobs,
            **({"without_logprobs": list(self.without_logprobs)} if self.without_logprobs else {}),
            **({"unparseable_tool_calls": unparseable} if unparseable else {}),
            "tool_call_parse": "malformed" if unparseable else "ok",
            **({"malformed_tool_calls": list(self.malformed)} if unparseable else {}),
            # the last call's prompt holds every image of the chain, its spans in this trace's token positions
            # (prompt then response: each call's prompt is the chain's tokens so far)
            **({"images": [dict(image) for image in self.last.images]} if self.last.images else {}),
            **(extra or {}),
        }
        return Trace.model_construct(
            prompt_ids=self.first.prompt_ids,
            response_ids=self.response_ids,
            loss_mask=self.loss_mask,
            response_logprobs=[] if self.without_logprobs else list(self.logprobs),
            prompt_messages=first_msgs,
            response_messages=response_messages,
            tools=tools,
            finish_reason=self.last.finish_reason,
            reward=None,
            metadata=metadata,
        )


def malformed_calls(rec: CompletionRecord, start: int) -> list[dict[str, Any]]:
    """``rec``'s malformed tool-call blocks at their tokens in a trace whose reply from ``rec`` starts at ``start``;
    a record that counts blocks but has no spans (chat mode, an older journal) gives its whole reply once."""
    spans = rec.malformed_tool_call_spans or [{"start": 0, "end": len(rec.response_ids)}]
    return [{"completion_id": rec.completion_id, "start": start + s["start"], "end": start + s["end"],
             "located": bool(rec.malformed_tool_call_spans)} for s in spans]


def trajectory(session: CompletionSession, builder: str, traces: list[Trace],
               diagnostics: dict[str, Any]) -> Trajectory:
    """Wrap ``traces`` with the diagnostics every builder reports: token counts and which traces have no logprobs
    (a record captured without them makes its whole trace say so, ``response_logprobs == []``, never zeros)."""
    trainable = sum(sum(t.loss_mask) for t in traces)
    total = sum(len(t.response_ids) for t in traces)
    diagnostics = {**diagnostics, "traces": len(traces), "trainable_tokens": trainable,
                   "masked_tokens": total - trainable, "prompt_tokens": sum(len(t.prompt_ids) for t in traces),
                   "traces_without_logprobs": sum(1 for t in traces if t.metadata.get("has_logprobs") is False),
                   "completions_without_logprobs": [c for t in traces for c in t.metadata.get("without_logprobs", [])],
                   "completions_with_unparseable_tool_calls": [
                       c for t in traces for c in t.metadata.get("unparseable_tool_calls", [])],
                   "malformed_tool_calls": sum(len(t.metadata.get("malformed_tool_calls", [])) for t in traces)}
    return Trajectory.model_construct(session_id=session.session_id, traces=traces, builder=builder,
                                      diagnostics=diagnostics)
