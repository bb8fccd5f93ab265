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
recorded (compaction, new context such as a sub-agent, drift, fork).

Retries and forks. Completions sent with one prompt are attempts at one turn (a harness retry) or forks (parallel
sub-agents, two conversations that begin alike). Which it is shows in what follows: an attempt is *used* when a
later completion goes on from its answer (its messages repeat that answer's text, else its prompt shows that answer
exactly or the most of it among the attempts, else it is the latest attempt sent before it). An attempt is
*superseded* (reported in diagnostics, not trained) when it was not used and another attempt was sent after it had
come back, or while it still ran but not together with it (a client timeout; parallel twins start within
``_SENT_TOGETHER_SECONDS``): whatever the journal order, so an abandoned attempt that finishes last is still
superseded, never a new chain (also when the retry's own answer cannot be trained: it carries no token IDs, and
is matched to the attempt by its messages). Every used attempt is trained in its own chain (a fork), so a second
conversation from the first one's prompt never costs the first its answer, and merge mode never splices the two.
A one-call conversation followed, after its answer, by another from the same prompt (a sub-agent delegated twice)
is told from a retry by what the harness did with the first answer: it reached the harness (the proxy journals
``delivered``: the client was still connected when the answer was ready) and another call answered before the
second one carries its text (the parent's turn that got the sub-agent's result and delegated again). A harness that
rejects an answer uses it nowhere, whatever side requests (a title, a next-speaker check) it sends before re-sending
the prompt. Without the flag (journals older than it, callers that are not HTTP clients), without messages, or with
no call carrying the answer, the pair reads as a retry: tokens cannot tell them apart.

Cost. Chains are indexed by their last prompt's length and last tokens; a completion looks itself up cut at those
lengths, longest first, and stops at the first that matches, so the chains a drift leaves behind (shorter prompts)
are never visited: finding a chain costs about the same whatever their number.
"""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right, insort
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from polar_gym.merge.base import MergeConfig, TraceBuilder, partition, trajectory
from polar_gym.schema import CompletionRecord, CompletionSession, Trajectory

__all__ = ["common_prefix_len", "prefix_merging", "superseded_attempts"]

_TAIL = 16  # prompt tokens in a chain's index key, besides the prompt's length
_SENT_TOGETHER_SECONDS = 0.2  # same-prompt calls started closer than this are parallel twins, not a retry


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


def _prompt_settings(rec: CompletionRecord) -> tuple[Any, Any]:
    """What renders a prompt besides its messages: the tools and the chat template's arguments (two sub-agents may
    open with the same messages and different tools)."""
    request = rec.normalized_request
    extra = request.get("extra")
    return request.get("tools"), extra.get("chat_template_kwargs") if isinstance(extra, dict) else None


def _starts_with(seq: list[Any], prefix: list[Any], at: int = 0) -> bool:
    n = len(prefix)
    if len(seq) < at + n:
        return False
    for i in (n - 1, n // 2) if n else ():  # O(1) rejection of unrelated chains before the O(n) slice comparison
        probe = seq[at + i]
        if probe is not prefix[i] and probe != prefix[i]:
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


def _classify_new(rec: CompletionRecord, chains: list[_Chain], forked: bool) -> str:
    """Why a completion that extends no chain starts its own."""
    if not chains:
        return "first"
    if forked:
        return "fork"  # the same prompt as another completion whose answer was used too
    q = rec.prompt_ids
    best, best_chain = 0, None
    for chain in chains:
        last = chain.trace.last.prompt_ids
        if not last or last[0] != q[0]:
            continue  # a different system prompt: it shares nothing, skip the O(n) comparison
        shared = common_prefix_len(q, last)
        if shared >= best and shared > 0:
            best, best_chain = shared, chain
    if best_chain is None:
        return "new_context"
    first_prompt, measure = best_chain.trace.first.prompt_ids, best_chain.trace.last
    if best == len(q) == len(measure.prompt_ids):
        return "fork"
    last_msgs, msgs = _messages(measure), _messages(rec)
    if last_msgs and len(msgs) > len(last_msgs) and _starts_with(msgs, last_msgs):
        # the harness sent its history on unchanged, the chat template rendered it anew (Qwen3 drops the earlier
        # turns' thinking, empty with thinking off, at each new user turn): not an edit, not a compaction
        return "template_rerendered"
    if best >= len(first_prompt) // 2 and len(q) < len(measure.prompt_ids):
        return "compaction"  # same system prompt and tools, a shorter history
    if best >= len(first_prompt) // 2:
        return "history_rewritten"
    return "new_context"  # a sub-agent, a side request, another system prompt


def _prompt_key(prompt: list[int], length: int | None = None) -> tuple[int, tuple[int, ...]]:
    """A cheap key for ``prompt[:length]``: its length and last ``_TAIL`` tokens (equality is checked after)."""
    n = len(prompt) if length is None else length
    return n, tuple(prompt[max(0, n - _TAIL):n])


def _continues(later: CompletionRecord, attempts: list[CompletionRecord]) -> CompletionRecord | None:
    """Which of ``attempts`` (completions sent with one prompt) ``later`` goes on from, if it extends that prompt:
    the one whose reply its prompt shows most of (exactly, else the longest shared start), then the latest sent."""
    prompt = attempts[0].prompt_ids
    n = len(prompt)
    q = later.prompt_ids
    if len(q) <= n or not _starts_with(q, prompt):
        return None
    # a harness goes on only from an answer it got: one it had hung up on (not delivered) is never continued
    sent_before = [a for a in attempts if a.started_at <= later.started_at and a.delivered is not False]
    if not sent_before:
        return None

    def shown(a: CompletionRecord) -> tuple[bool, int, float, int]:
        reply = a.response_ids
        seen = q[n:n + len(reply)]
        return seen == reply, common_prefix_len(seen, reply), a.started_at, a.index

    msgs = _messages(later)
    at = len(_messages(attempts[0]))
    said = _said(msgs[at]) if at < len(msgs) else None
    answers = [_said(a.response.get("message")) for a in sent_before]
    faithful = [a for a in sent_before if a.token_faithful and a.response_ids]  # only their tokens can be shown
    if said is not None and None not in answers:  # the messages tell which answer the harness went on with
        matching = [a for a, answer in zip(sent_before, answers, strict=True) if answer == said]
        tied = [a for a in matching if a in faithful]
        if len(matching) > 1 and tied:  # the same text and calls: the tokens the prompt shows decide
            return max(tied, key=shown)
        return matching[-1] if matching else None  # None: an answer not captured here (no usable record)
    return max(faithful, key=shown) if faithful else None


def _said(message: Any) -> tuple[str, tuple[tuple[str, str], ...]] | None:
    """What an assistant message says: its text (a string or text parts, stripped) and its tool calls (name and
    arguments, canonical JSON; ids are left out, harnesses rename them); None if it says nothing."""
    if not isinstance(message, dict):
        return None
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    text = content.strip() if isinstance(content, str) else ""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        calls.append((str(function.get("name")), json.dumps(arguments, sort_keys=True, ensure_ascii=False)))
    return (text, tuple(calls)) if text or calls else None


def _retries(later: CompletionRecord, first: CompletionRecord) -> bool:
    """``later`` (same prompt) may be a retry of ``first``: sent after ``first`` came back, or while it ran but not
    together with it (parallel twins are sent at once; a client gives up on an attempt only after a timeout)."""
    return (later.started_at >= first.started_at + first.total_seconds
            or later.started_at - first.started_at >= _SENT_TOGETHER_SECONDS)


def _another_conversation(first: CompletionRecord, later: CompletionRecord,
                          calls: list[tuple[float, float, int]], records: dict[int, CompletionRecord]) -> bool:
    """``later`` (same prompt, sent after ``first`` came back) starts a second conversation rather than retrying
    ``first``: ``first``'s answer reached the harness, and the harness went on with it before sending ``later``: a
    call answered in between carries that answer (the parent agent's turn that got the sub-agent's result and
    delegated again; the sub-agent's own next turn). A harness that rejects an answer re-sends the prompt without
    using the answer anywhere: at once (Qwen Code re-sent an unparseable tool-call block within 0.3 s), or after
    side requests of its own (a title, a next-speaker check), which carry the history, never the rejected answer,
    and are not another conversation's turn anyway (``side_request``). ``calls``: (sent, came back, key) of the
    session's answered calls, by time sent; ``records``: the calls by key."""
    if not first.delivered:
        return False
    answer = _said(first.response.get("message"))
    if answer is None:
        return False  # nothing another call could show: tokens alone cannot tell the two apart
    came_back, sent = first.started_at + first.total_seconds, later.started_at
    for _, end, key in calls[bisect_right(calls, (came_back, float("inf"), 0)):
                             bisect_left(calls, (sent, float("-inf"), 0))]:
        between = records[key]
        if end < sent and not between.side_request and _carries(between, answer):
            return True
    return False


def _carries(rec: CompletionRecord, answer: tuple[str, tuple[tuple[str, str], ...]]) -> bool:
    """Whether ``rec``'s messages hold ``answer`` (what :func:`_said` reads from an assistant message): as an
    assistant turn of its history (the conversation went on with it), or its text in a tool result or user turn
    (another conversation was given it)."""
    text = answer[0]
    for message in _messages(rec):
        if not isinstance(message, dict):
            continue
        if message.get("role") == "assistant":
            if _said(message) == answer:
                return True
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        if text and isinstance(content, str) and text in content:
            return True
    return False


def _used_attempts(usable: list[CompletionRecord], retried: list[list[CompletionRecord]]) -> set[int]:
    """The ids of the attempts (of prompts sent more than once) that some later completion goes on from.

    Each completion is asked only about the longest retried prompt its own prompt extends: a shorter one it extends
    is extended by that prompt's attempts too, with the same tokens and messages in between, and they are asked
    about it in turn. Found as :class:`_ChainIndex` finds chains (cut at the retried prompts' lengths, longest
    first), so a session costs about one look-up per completion however many of its turns were retried."""
    by_key: dict[tuple[int, tuple[int, ...]], list[list[CompletionRecord]]] = {}
    for attempts in retried:
        by_key.setdefault(_prompt_key(attempts[0].prompt_ids), []).append(attempts)
    lengths = sorted({key[0] for key in by_key})
    used: set[int] = set()
    for later in usable:
        q = later.prompt_ids
        for i in range(bisect_left(lengths, len(q)) - 1, -1, -1):
            extended = [attempts for attempts in by_key.get(_prompt_key(q, lengths[i]), ())
                        if _starts_with(q, attempts[0].prompt_ids)]
            for attempts in extended:
                if (chosen := _continues(later, attempts)) is not None:
                    used.add(id(chosen))
            if extended:
                break
    return used


def _nearest_before(attempts: list[CompletionRecord], retry: CompletionRecord) -> tuple[bool, float]:
    """How closely ``retry`` follows ``attempts``: a retry retries the latest attempt sent before it (else it was
    the first attempt, of the group that began soonest after it)."""
    before = [a.started_at for a in attempts if a.started_at <= retry.started_at]
    return (True, max(before)) if before else (False, -min(a.started_at for a in attempts))


def superseded_attempts(usable: list[CompletionRecord],
                        untrainable: Sequence[CompletionRecord] = ()) -> tuple[set[str], set[str]]:
    """The attempts a harness threw away, and the completions that share their prompt with a used one (forks).

    Completions sent with one prompt are attempts at one turn, or forks (parallel sub-agents, or two conversations
    that begin alike). An attempt is superseded when no later completion goes on from its answer and another
    attempt was sent after it (whether the first had come back or was still running: a client timeout), unless its
    answer reached the harness and another call answered before the later one carries it
    (``_another_conversation``); every attempt some later completion goes on from was used, so each is trained in
    its own chain. The latest attempt of a final turn is kept. Cost: one pass over the prompts' keys, and one
    look-up per completion (:func:`_used_attempts`).

    ``untrainable`` are answered completions no trace may use (no token IDs, no reply tokens): they join the attempts
    of the usable completion sent with the same messages and tools, so the retry that answered a timed-out attempt still
    supersedes it when its own answer cannot be trained (else the abandoned attempt would read as its own turn). When
    several prompts were sent with those messages and tools (one request rendered differently: a drifted history),
    it joins the one whose latest attempt it follows most closely (:func:`_nearest_before`).
    """
    groups: dict[tuple[int, tuple[int, ...]], list[list[CompletionRecord]]] = {}
    for rec in usable:
        same = groups.setdefault(_prompt_key(rec.prompt_ids), [])
        for group in same:
            if group[0].prompt_ids == rec.prompt_ids:
                group.append(rec)
                break  # prompts differ between groups: no other one can match
        else:
            same.append([rec])
    if untrainable:
        by_length: dict[int, list[list[CompletionRecord]]] = {}
        for same in groups.values():
            for attempts in same:
                by_length.setdefault(len(_messages(attempts[0])), []).append(attempts)
        for rec in untrainable:
            msgs = _messages(rec)
            same = [attempts for attempts in by_length.get(len(msgs), []) if msgs
                    and _messages(attempts[0]) == msgs and _prompt_settings(attempts[0]) == _prompt_settings(rec)]
            if same:  # several when one request was rendered to different prompts (a drifted history)
                max(same, key=lambda attempts: _nearest_before(attempts, rec)).append(rec)
    records = {id(rec): rec for rec in [*usable, *untrainable]}
    calls = sorted((rec.started_at, rec.started_at + rec.total_seconds, key) for key, rec in records.items())
    trainable = {id(rec) for rec in usable}
    retried = [attempts for same in groups.values() for attempts in same if len(attempts) > 1]
    used = _used_attempts(usable, retried)
    superseded: set[str] = set()
    forks: set[str] = set()
    for attempts in retried:
        order = sorted(attempts, key=lambda a: (a.started_at, a.index))
        kept = [a for i, a in enumerate(order)
                if id(a) in used or not any(_retries(b, a) and not _another_conversation(a, b, calls, records)
                                            for b in order[i + 1:])]
        superseded |= {a.completion_id for a in attempts if a not in kept and id(a) in trainable}
        if len(kept) > 1:
            forks |= {a.completion_id for a in kept if id(a) in trainable}
    return superseded, forks


def _shows_a_twin(rec: CompletionRecord, last: CompletionRecord,
                  placed: dict[tuple[int, tuple[int, ...]], list[CompletionRecord]]) -> bool:
    """Whether ``rec``'s prompt shows, exactly, the reply of another trained completion sent with ``last``'s prompt
    (a twin): then it goes on from that twin, not from a re-rendering of ``last``'s reply, and merging it into
    ``last``'s chain would train a turn after a reply it never saw."""
    n, q = len(last.prompt_ids), rec.prompt_ids
    return any(other is not last and other.prompt_ids == last.prompt_ids
               and q[n:n + len(other.response_ids)] == other.response_ids
               for other in placed.get(_prompt_key(last.prompt_ids), ()))


def _rank(match: _Match, rec: CompletionRecord) -> tuple[int, bool, int, int]:
    """Longest prefix first; then an exact re-rendering; then how much of the last reply the new prompt shows
    (so a drifted twin is told from its sibling); then the latest chain."""
    last = match.chain.trace.last
    n, a = match.prefix, last.response_ids
    overlap = len(a) if match.exact else common_prefix_len(rec.prompt_ids[n:n + len(a)], a)
    return (n, match.exact, overlap, last.index)


class _ChainIndex:
    """Chains by the key of their last prompt, and the distinct lengths of those prompts, longest first: the chain a
    completion extends is found by looking up its own prompt cut at those lengths, from the longest down, stopping
    at the first length that matches. Chains a drift left behind have shorter prompts than the live one, so they
    are never visited: the cost does not grow with their number."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[int, tuple[int, ...]], list[_Chain]] = {}
        self.lengths: list[int] = []  # sorted, distinct
        self.count: Counter[int] = Counter()

    def add(self, chain: _Chain) -> None:
        key = _prompt_key(chain.trace.last.prompt_ids)
        self.by_key.setdefault(key, []).append(chain)
        if not self.count[key[0]]:
            insort(self.lengths, key[0])
        self.count[key[0]] += 1

    def remove(self, chain: _Chain) -> None:
        key = _prompt_key(chain.trace.last.prompt_ids)
        bucket = self.by_key[key]
        bucket.remove(chain)
        if not bucket:
            del self.by_key[key]
        self.count[key[0]] -= 1
        if not self.count[key[0]]:
            del self.count[key[0]]
            self.lengths.pop(bisect_left(self.lengths, key[0]))

    def best(self, rec: CompletionRecord, eot: frozenset[int], rejected: Counter[str]) -> _Match | None:
        q = rec.prompt_ids
        for i in range(bisect_left(self.lengths, len(q)) - 1, -1, -1):
            bucket = self.by_key.get(_prompt_key(q, self.lengths[i]))
            if not bucket:
                continue
            best: _Match | None = None
            for chain in bucket:
                found = _candidate(chain, rec, eot)
                if isinstance(found, str):
                    rejected[found] += 1
                elif found is not None and (best is None or _rank(found, rec) > _rank(best, rec)):
                    best = found
            if best is not None:
                return best  # a shorter prefix never outranks a longer one
        return None


def prefix_merging(session: CompletionSession, config: MergeConfig | None = None) -> Trajectory:
    config = config or MergeConfig()
    eot = frozenset(config.end_of_turn_ids)
    usable, excluded = partition(session, config)
    chains: list[_Chain] = []
    breaks: Counter[str] = Counter()
    superseded: list[CompletionRecord] = []
    rejected: Counter[str] = Counter()
    rerender_merged = 0

    index = _ChainIndex()
    placed: dict[tuple[int, tuple[int, ...]], list[CompletionRecord]] = {}  # every trained record, by prompt key
    trainable = {rec.completion_id for rec in usable}
    untrainable = [r for r in session.completions if r.status == "ok" and r.completion_id not in trainable]
    thrown_away, forks = superseded_attempts(usable, untrainable)
    for rec in usable:
        if rec.completion_id in thrown_away:
            superseded.append(rec)
            continue
        best = index.best(rec, eot, rejected)
        twin = best is not None and not best.exact and _shows_a_twin(rec, best.chain.trace.last, placed)
        if (best is not None and best.bridge is not None and not twin
                and (best.exact or config.on_rerender == "merge")):
            index.remove(best.chain)
            best.chain.trace.add(rec, best.bridge)
            index.add(best.chain)
            rerender_merged += not best.exact
        else:
            cause = "fork" if twin else best.cause if best is not None else _classify_new(
                rec, chains, rec.completion_id in forks)
            if cause != "first":
                breaks[cause] += 1
            chains.append(_Chain(TraceBuilder(rec), cause))
            index.add(chains[-1])
        placed.setdefault(_prompt_key(rec.prompt_ids), []).append(rec)

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
