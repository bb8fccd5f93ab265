"""``prefix_merging``: one trace per chain of completions that extend each other, as in the Polar paper, made
robust to what real sessions do.

A completion joins the chain whose last prompt is a strict token prefix of its prompt (longest wins), provided its
messages also extend that completion's messages (no false matches). The tokens between the chain's last sampled
reply and the new reply (tool results, the next user turn) are appended with mask 0 and synthetic logprobs.
The new prompt must re-render the chain's last reply token for token; when it does not (retokenization drift, a
template that drops thinking) the chain breaks, unless ``on_rerender="merge"`` asks for the paper's behaviour.
Ties between chains (parallel sub-agents that began from one prompt) are decided by which last reply the new prompt
actually contains, so chains are never cross-wired.

Unlike the public reference, nothing is dropped: a completion that fits no chain starts a new one, with the cause
recorded (compaction, new context such as a sub-agent, drift, fork). A prompt sent again after its first answer
came back (a harness retry) replaces that answer in its chain; the discarded attempt is reported, not trained on.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from polar_gym.merge.base import MergeConfig, TraceBuilder, partition, trajectory
from polar_gym.schema import CompletionRecord, CompletionSession, Trajectory

__all__ = ["common_prefix_len", "prefix_merging"]


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix, by binary search over C-level slice comparisons."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _messages(rec: CompletionRecord) -> list[Any]:
    msgs = rec.normalized_request.get("messages")
    return msgs if isinstance(msgs, list) else []


def _starts_with(seq: list[Any], prefix: list[Any], at: int = 0) -> bool:
    n = len(prefix)
    if len(seq) < at + n:
        return False
    for i in (n - 1, n // 2) if n else ():  # O(1) rejection of unrelated chains before the O(n) slice comparison
        if seq[at + i] is not prefix[i] and seq[at + i] != prefix[i]:
            return False
    return seq[at:at + n] == prefix


@dataclass
class _Chain:
    trace: TraceBuilder
    cause: str


@dataclass
class _Match:
    chain: _Chain
    prefix: int
    exact: bool
    bridge: list[int] | None
    cause: str


def _first_end_of_turn(prompt: list[int], start: int, eot: frozenset[int]) -> int | None:
    for i in range(start, len(prompt)):
        if prompt[i] in eot:
            return i
    return None


def _candidate(chain: _Chain, rec: CompletionRecord, eot: frozenset[int]) -> _Match | str | None:
    """How ``rec`` would extend ``chain``: a match, a reason it cannot (a string), or None if unrelated."""
    last = chain.trace.last
    p, a, q = last.prompt_ids, last.response_ids, rec.prompt_ids
    if len(q) <= len(p) or not _starts_with(q, p):
        return None
    last_msgs, msgs = _messages(last), _messages(rec)
    if last_msgs and msgs and not _starts_with(msgs, last_msgs):
        return "message_mismatch"
    n = len(p)
    if _starts_with(q, a, n):
        return _Match(chain, n, True, q[n + len(a):], "")
    # The next prompt renders the last reply differently from what was sampled.
    end = _first_end_of_turn(q, n, eot)
    if end is None:
        return _Match(chain, n, False, None, "drift")
    rendered = q[n:end + 1] if a[-1] in eot else q[n:end]
    cause = "thinking_dropped" if len(rendered) < len(a) and a[len(a) - len(rendered):] == rendered else "drift"
    bridge = q[end + 1:] if a[-1] in eot else q[end:]
    return _Match(chain, n, False, bridge, cause)


def _classify_new(rec: CompletionRecord, chains: list[_Chain]) -> str:
    """Why a completion that extends no chain starts its own."""
    if not chains:
        return "first"
    q = rec.prompt_ids
    best, best_chain = 0, None
    for chain in chains:
        shared = common_prefix_len(q, chain.trace.last.prompt_ids)
        if shared >= best and shared > 0:
            best, best_chain = shared, chain
    if best_chain is None:
        return "new_context"
    first_prompt = best_chain.trace.first.prompt_ids
    if best == len(q) == len(best_chain.trace.last.prompt_ids):
        return "fork"  # the same prompt again, while the first attempt was still running
    if best >= len(first_prompt) // 2 and len(q) < len(best_chain.trace.last.prompt_ids):
        return "compaction"  # same system prompt and tools, a shorter history
    if best >= len(first_prompt) // 2:
        return "history_rewritten"
    return "new_context"  # a sub-agent, a side request, another system prompt


def _is_retry(chain: _Chain, rec: CompletionRecord) -> bool:
    """``rec`` re-sends the prompt of the chain's last completion after that completion had come back."""
    last = chain.trace.last
    return (len(rec.prompt_ids) == len(last.prompt_ids) and rec.prompt_ids == last.prompt_ids
            and rec.started_at >= last.started_at + last.total_seconds)


def _retried_chain(chains: list[_Chain], rec: CompletionRecord, later: list[CompletionRecord]) -> _Chain | None:
    """The chain whose last answer ``rec`` retries. When twins share the prompt, it is the one whose answer no
    later prompt goes on from: the other twin's answer was used, so it was not the one thrown away."""
    found = [c for c in chains if _is_retry(c, rec)]
    if len(found) > 1:
        unused = [c for c in found if not any(
            _starts_with(r.prompt_ids, c.trace.last.prompt_ids + c.trace.last.response_ids) for r in later)]
        found = unused or found
    return found[-1] if found else None


def _rank(match: _Match, rec: CompletionRecord) -> tuple[int, bool, int, int]:
    """Longest prefix first; then an exact re-rendering; then how much of the last reply the new prompt shows
    (so a drifted twin is told from its sibling); then the latest chain."""
    last = match.chain.trace.last
    n, a = match.prefix, last.response_ids
    overlap = len(a) if match.exact else common_prefix_len(rec.prompt_ids[n:n + len(a)], a)
    return (n, match.exact, overlap, last.index)


def prefix_merging(session: CompletionSession, config: MergeConfig | None = None) -> Trajectory:
    config = config or MergeConfig()
    eot = frozenset(config.end_of_turn_ids)
    usable, excluded = partition(session, config)
    chains: list[_Chain] = []
    breaks: Counter[str] = Counter()
    superseded: list[CompletionRecord] = []
    rejected: Counter[str] = Counter()
    rerender_merged = 0

    for position, rec in enumerate(usable):
        retry = _retried_chain(chains, rec, usable[position + 1:])
        if retry is not None:
            discarded, bridge = retry.trace.pop()
            superseded.append(discarded)
            if retry.trace.records:
                retry.trace.add(rec, bridge)  # the same prompt, so the same bridge from the turn before
            else:
                retry.trace = TraceBuilder(rec)
            continue
        best: _Match | None = None
        for chain in chains:
            found = _candidate(chain, rec, eot)
            if isinstance(found, str):
                rejected[found] += 1
                continue
            if found is None:
                continue
            if best is None or _rank(found, rec) > _rank(best, rec):
                best = found
        if best is not None and best.exact and best.bridge is not None:
            best.chain.trace.add(rec, best.bridge)
        elif best is not None and config.on_rerender == "merge" and best.bridge is not None:
            best.chain.trace.add(rec, best.bridge)
            rerender_merged += 1
        else:
            cause = best.cause if best is not None else _classify_new(rec, chains)
            if cause != "first":
                breaks[cause] += 1
            chains.append(_Chain(TraceBuilder(rec), cause))

    traces = [c.trace.build(i, {"chain_cause": c.cause}) for i, c in enumerate(chains) if c.trace.records]
    if config.keep_superseded:
        traces += [TraceBuilder(r).build(len(traces) + i, {"chain_cause": "superseded", "superseded": True})
                   for i, r in enumerate(superseded)]
    diagnostics: dict[str, Any] = {
        "completions": len(session.completions),
        "chains": len(chains),
        "completions_merged": sum(len(c.trace.records) - 1 for c in chains if c.trace.records),
        "breaks": dict(breaks),
        "rejected_candidates": dict(rejected),
        "rerender_merged": rerender_merged,
        "superseded": [r.completion_id for r in superseded],
        "excluded": excluded,
    }
    return trajectory(session, "prefix_merging", traces, diagnostics)
