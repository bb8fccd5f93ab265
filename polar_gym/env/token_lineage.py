"""Token lineage of a session's model calls, the way NeMo Gym 0.7's token capture records it: each call's parent is
the earlier call whose whole sequence (prompt + generation) its prompt starts with, exactly. That is the link Gym's
builder verifies by digest, and the one polar_gym's exact-prefix token-in keeps for every turn of one conversation.

Every chain stays: a sub-agent or a post-compaction context is a root of its own chain; a retry (or any second
child of one parent) starts a branch chain that keeps its parent link. Gym's own builder delivers one chain per
rollout and drops the others; :mod:`polar_gym.env.nemo_transport` hands them all over.

Pure and free of NeMo Gym, so it runs (and is tested) in polar_gym's interpreter as well as in Gym's, where
:mod:`polar_gym.env.nemo_transport` turns its output into ``TokenEntry`` records.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from polar_gym.schema import CompletionRecord
from polar_gym.schema.images import image_data_of

__all__ = ["CallTokens", "Link", "Resolution", "calls_from_nemo_payload", "calls_from_records", "has_model_history",
           "link_calls"]

Resolution = Literal["root", "resolved", "unresolved"]
_CONVERSATION_FIELDS = ("messages", "input", "contents")
_MODEL_ROLES = frozenset({"assistant", "model"})
_MODEL_ITEM_TYPES = frozenset({"function_call", "reasoning", "custom_tool_call"})


@dataclass(frozen=True)
class CallTokens:
    """One sampled model call: its exact tokens and what the harness sent and got (for Gym's lookup metadata)."""

    call_id: str
    prompt: list[int]
    generation: list[int]
    logprobs: list[float]
    #: the conversation the harness sent, in its own dialect (empty: not known)
    request_items: list[Any] = field(default_factory=list)
    #: the answer: ``{"message": {...}, "id": ...}`` (one assistant message in chat form, as the proxy journals
    #: it), or a provider-shaped body
    response: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    created_at: float = 0.0
    #: polar_gym's own labels (session, chain cause), carried as extra fields of the entry
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Link:
    """Where one call sits: its parent (None for a chain's root), the decision as Gym names it, its chain and the
    chain its own chain branched from."""

    call_id: str
    parent_call_id: str | None
    resolution: Resolution
    chain: int
    parent_chain: int | None


def has_model_history(items: Iterable[Any]) -> bool:
    """Whether a request's conversation holds a turn the model wrote (then a call without a parent in the capture
    is a boundary Gym must not cross: ``unresolved``, not a ``root``)."""
    for item in items:
        if not isinstance(item, Mapping):
            continue
        if item.get("role") in _MODEL_ROLES or item.get("type") in _MODEL_ITEM_TYPES:
            return True
    return False


def _tokens(ids: Sequence[int]) -> bytes:
    return array("I", ids).tobytes()


def link_calls(calls: Sequence[CallTokens]) -> list[Link]:
    """Parent, decision and chain of every call, in the order given (a parent must come before its children).

    The parent is the longest earlier whole sequence the prompt starts with (the latest one among equal ones: they
    hold the same tokens). Of a parent's children, the one the conversation went on from (the most tokens sampled
    below it; the latest on a tie, as a retry supersedes what it retried) continues the parent's chain; each other
    child (a retry's lost answer, a fork) opens a branch chain linked to its parent's.
    """
    whole: list[bytes] = []
    parents: list[int | None] = []
    for call in calls:
        prompt = _tokens(call.prompt)
        parent: int | None = None
        for k, sequence in enumerate(whole):
            if (parent is None or len(sequence) >= len(whole[parent])) and prompt.startswith(sequence):
                parent = k
        parents.append(parent)
        whole.append(prompt + _tokens(call.generation))
    below = [len(call.generation) for call in calls]  # tokens sampled by a call and every call below it
    for k in range(len(calls) - 1, -1, -1):
        if (parent := parents[k]) is not None:
            below[parent] += below[k]
    continuing: dict[int, int] = {}
    for k, parent in enumerate(parents):
        if parent is not None and (parent not in continuing or below[k] >= below[continuing[parent]]):
            continuing[parent] = k
    out: list[Link] = []
    chains = 0
    for k, (call, parent) in enumerate(zip(calls, parents, strict=True)):
        if parent is None:
            resolution: Resolution = "unresolved" if has_model_history(call.request_items) else "root"
            link = Link(call.call_id, None, resolution, chains, None)
        elif continuing[parent] == k:
            link = Link(call.call_id, calls[parent].call_id, "resolved", out[parent].chain, None)
        else:
            link = Link(call.call_id, calls[parent].call_id, "resolved", chains, out[parent].chain)
        chains += link.chain == chains
        out.append(link)
    return out


def _conversation(body: Mapping[str, Any]) -> list[Any]:
    for name in _CONVERSATION_FIELDS:
        value = body.get(name)
        if isinstance(value, list):
            return list(value)
    return []


def _image_extras(images: Sequence[Mapping[str, Any]], data: Mapping[str, str], sent: set[str]) -> dict[str, Any]:
    """A call's images as extra fields of its entry: ``polar_images`` (each one's SHA-256, type, size and its
    placeholders' span in the call's prompt) and ``polar_image_data`` (the pixels, by SHA-256, of the images no
    earlier call of the rollout carried: each is stored once, on the first call that saw it)."""
    if not images:
        return {}
    new = {sha: data[sha] for image in images if (sha := str(image["sha256"])) in data and sha not in sent}
    sent.update(new)
    return {"polar_images": [dict(image) for image in images], **({"polar_image_data": new} if new else {})}


def calls_from_records(records: Iterable[CompletionRecord]) -> tuple[list[CallTokens], list[str]]:
    """The proxy's journal records as calls, and the ids of calls that cannot become training records (sampled
    tokens the engine did not report faithfully, or without aligned logprobs): a rollout with such a call has a
    hole, and Gym's contract is to mask it. Failed calls sampled nothing and are left out."""
    calls: list[CallTokens] = []
    holes: list[str] = []
    sent: set[str] = set()
    for record in records:
        if record.status != "ok":
            continue
        if not record.token_faithful or len(record.response_logprobs) != len(record.response_ids):
            holes.append(record.completion_id)
            continue
        extras: dict[str, Any] = {"polar_session_id": record.session_id, "polar_index": record.index}
        if record.side_request:
            extras["polar_side_request"] = True
        if record.policy_version is not None:
            extras["polar_policy_version"] = record.policy_version
        messages = record.normalized_request.get("messages")
        extras.update(_image_extras(record.images, image_data_of(
            record.images, messages if isinstance(messages, list) else []), sent))
        calls.append(CallTokens(
            call_id=record.completion_id, prompt=list(record.prompt_ids), generation=list(record.response_ids),
            logprobs=list(record.response_logprobs),
            request_items=_conversation(record.normalized_request) or _conversation(record.request),
            response=dict(record.response), model=record.model or "", created_at=record.started_at, extras=extras))
    return calls, holes


def calls_from_nemo_payload(payload: Mapping[str, Any]) -> list[CallTokens]:
    """The calls of a ``GET /sessions/{id}/nemo`` payload (every prefix-merged chain's items: cumulative prompts,
    the sampled tokens, the assistant turn), each once, ordered so parents come first (a parent's whole sequence is
    shorter than its children's prompts). What the NeMo Gym agent delivers through a token sink."""
    calls: dict[str, CallTokens] = {}
    seen: dict[str, tuple[list[Mapping[str, Any]], Mapping[str, str]]] = {}  # each call's images and their pixels
    for chain in payload.get("chains") or []:
        images = [image for image in chain.get("images") or [] if isinstance(image, Mapping)]
        data = chain.get("image_data") if isinstance(chain.get("image_data"), Mapping) else {}
        for item in chain.get("items") or []:
            if not item.get("generation_token_ids"):
                continue
            call_id = str(item.get("completion_id") or f"{payload.get('session_id')}-{len(calls)}")
            same = calls.get(call_id)
            if same is not None and (same.prompt, same.generation) == (item.get("prompt_token_ids"),
                                                                      item["generation_token_ids"]):
                continue  # one call in two chains' items
            if same is not None:  # an id two different calls share: keep both, apart
                call_id = f"{call_id}@{chain.get('trace_index')}"
            turn = item.get("turn")
            message = {k: v for k, v in turn.items() if k != "tool_results"} if isinstance(turn, Mapping) else None
            calls[call_id] = CallTokens(
                call_id=call_id, prompt=list(item.get("prompt_token_ids") or []),
                generation=list(item["generation_token_ids"]), logprobs=list(item.get("generation_log_probs") or []),
                response={"message": message} if message else {},
                extras={"polar_session_id": payload.get("session_id"), "polar_trace_index": chain.get("trace_index"),
                        "polar_chain_cause": chain.get("chain_cause")})
            # the chain's images (spans in its token positions) that lie in this call's prompt
            seen[call_id] = ([i for i in images if _span_end(i) <= len(calls[call_id].prompt)], data)
    ordered = sorted(calls.values(), key=lambda c: len(c.prompt))
    sent: set[str] = set()
    for call in ordered:
        call.extras.update(_image_extras(*seen[call.call_id], sent))
    return ordered


def _span_end(image: Mapping[str, Any]) -> float:
    span = image.get("prompt_span")
    return float(span["end"]) if isinstance(span, Mapping) and isinstance(span.get("end"), int) else float("inf")
