"""Property-based tests for the builders.

Hypothesis draws the *plan* of a session: a main agent's tool loop, parallel sub-agents (some of them twins that
start from one prompt at once), a side request; per turn: failed attempts (error records), answers the harness threw
away and re-sent the prompt for (retries), attempts re-sent while they still ran (a client timeout; the abandoned one
finishes last), answers without logprobs, answers from a server that reports no token IDs, length stops without an
end-of-turn token, thinking spans, several end-of-turn ids, and how the next prompt re-renders the reply (exactly,
drifted, split, thinking dropped, another end-of-turn token); before a turn: a compaction or a rewritten older reply.
``simulate`` renders the plan into the token IDs and append-only message lists a harness and engine would produce,
journaled in the order completions finish (as the capture journal does), and returns the ground truth with it.

Checked for per_request and prefix_merging (``on_rerender`` "break" and "merge", and ``keep_superseded``): DESIGN.md's
invariants; every completion in exactly one trace or diagnostic; prefix_merging never emits more traces than
per_request; under "break" every merged reply sits in exactly the context the engine saw; and, when token contents
are unambiguous, the chains equal an independent oracle built from the ground truth (so a session without retries,
forks, drift or compaction gives exactly one trace per agent, and no chain is ever cross-wired).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from polar_gym.merge.base import MergeConfig, partition
from polar_gym.merge.per_request import per_request
from polar_gym.merge.prefix_merging import prefix_merging
from polar_gym.schema import CompletionRecord, CompletionSession, Trajectory
from tests.merge._sessions import check_invariants, rec, session

# -- token vocabulary: readable ids, content tokens from 1000 up ------------------------------------------------
SYSTEM, USER, ASSISTANT, IM_START, NL, THINK_OPEN, THINK_CLOSE, TOOL = 2, 3, 4, 5, 6, 7, 8, 9
ALT_EOT, IM_END = 98, 99  # <|endoftext|>-like and <|im_end|>-like: either one ends a sampled turn
AGENT_MARK = 500  # 500 + group: the first system token, so different agents never share a system prompt
EOTS = (ALT_EOT, IM_END)

BREAK = MergeConfig(end_of_turn_ids=EOTS)
MERGE = MergeConfig(end_of_turn_ids=EOTS, on_rerender="merge")
KEEP = MergeConfig(end_of_turn_ids=EOTS, keep_superseded=True)

Render = Literal["exact", "drift", "split", "drop_thinking", "eot"]


@dataclass(frozen=True)
class TurnPlan:
    """One accepted model call of an agent and what happened around it."""

    errors: int = 0  # failed attempts (error records) before the answer
    discarded: int = 0  # answers that came back and were thrown away: the harness re-sent the same prompt
    timeout: bool = False  # the first attempt ran past the client's timeout: re-sent while it ran, it finishes last
    no_logprobs: bool = False  # the kept answer came from an engine that reported no logprobs
    unfaithful: Literal["", "empty", "ids"] = ""  # the kept answer came from a server without token IDs
    length: bool = False  # stopped by max_tokens: no end-of-turn token sampled
    think: bool = False  # the reply opens with a thinking span
    render: Render = "exact"  # how the next prompt re-renders this reply
    history_drift: bool = False  # before this call, an older reply is re-rendered differently
    compact: bool = False  # before this call, the history is replaced by a summary (same system prompt)


@dataclass(frozen=True)
class AgentPlan:
    group: int  # agents of one group start from the same prompt (parallel twins)
    start: float
    turns: tuple[TurnPlan, ...]
    side: bool = False
    reports: int | None = None  # its first call carries this agent's last answer (a parent given a sub-agent's result)


@dataclass(frozen=True)
class SessionPlan:
    agents: tuple[AgentPlan, ...]
    seed: int = 0
    alphabet: int | None = None  # None: every content token unique; else drawn from this many ids (collisions)
    messages: bool = True  # records carry the messages the harness sent
    shared_system: bool = False  # sub-agents reuse the main agent's system prompt (their tasks differ)
    delivery: bool = False  # the proxy journaled whether each answer reached the harness (``delivered``)

    def twin_rerendered(self) -> bool:
        """Twins whose first reply a later prompt may not show as sampled (drifted, rewritten, or an answer without
        token IDs, an older reply rewritten): under ``on_rerender="merge"`` that prompt may still continue the other
        twin's chain. The drifted-reply case is fixed (test_merge_mode_cross_wires_twins); a twin answer without token
        IDs or a rewritten history remains a known weakness of merge mode."""
        groups = [a.group for a in self.agents]
        return any(groups.count(a.group) > 1 and a.turns
                   and (a.turns[0].render != "exact" or a.turns[0].unfaithful or any(t.history_drift for t in a.turns))
                   for a in self.agents)


@dataclass
class Truth:
    """What really happened, from the simulator."""

    agent: dict[str, int] = field(default_factory=dict)  # completion id -> agent
    turn: dict[str, tuple[int, int]] = field(default_factory=dict)  # completion id -> (agent, turn)
    rendered: dict[str, list[int]] = field(default_factory=dict)  # kept reply -> how later prompts show it
    discarded: set[str] = field(default_factory=set)  # answers the harness threw away
    detectable: set[str] = field(default_factory=set)  # ... of which a usable or answered same-prompt attempt followed


# -- simulation -------------------------------------------------------------------------------------------------
class _Tokens:
    def __init__(self, rng: random.Random, alphabet: int | None) -> None:
        self.rng, self.alphabet, self.counter = rng, alphabet, itertools.count(1000)

    def __call__(self, n: int) -> list[int]:
        if self.alphabet is None:
            return [next(self.counter) for _ in range(n)]
        return [1000 + self.rng.randrange(self.alphabet) for _ in range(n)]

    def other(self, token: int) -> int:
        """A token for a re-rendering: never ``token``, and never a sampled one (so drift cannot undo drift)."""
        new = self(1)[0] + (0 if self.alphabet is None else 1000)
        return new if new != token else new + 1


def _header(system: list[int], user: list[int]) -> list[int]:
    return [IM_START, SYSTEM, NL, *system, IM_END, NL, IM_START, USER, NL, *user, IM_END, NL, IM_START, ASSISTANT, NL]


def _bridge(result: list[int]) -> list[int]:
    return [NL, IM_START, TOOL, NL, *result, IM_END, NL, IM_START, ASSISTANT, NL]


def _render(reply: list[int], think_len: int, turn: TurnPlan, tok: _Tokens) -> list[int]:
    """The reply as the next prompt shows it (a length-stopped reply gets its end-of-turn token from the template)."""
    body = reply if turn.length else reply[:-1]
    end = [IM_END] if turn.length or turn.render == "eot" else [reply[-1]]
    content = body[think_len:]
    if turn.render == "drop_thinking":
        body = content
    elif turn.render in ("drift", "split"):
        at = think_len + tok.rng.randrange(len(content))
        new = [tok.other(body[at])] + ([tok.other(body[at])] if turn.render == "split" else [])
        body = [*body[:at], *new, *body[at + 1:]]
    return [*body, *end]


def _attempts(plan: SessionPlan, a: int, agent: AgentPlan, rng: random.Random, tok: _Tokens,
              system: list[int], task: list[int], answers: dict[int, str]) -> Iterator[dict[str, Any]]:
    """Every call agent ``a`` makes, as record fields plus ``_end`` / ``_kind`` / ``_turn``; its last answer goes to
    ``answers``."""
    sys_msg = {"role": "system", "content": f"system {agent.group}"}
    segments, replies = [_header(system, task)], []  # replies: indexes of rendered replies in segments
    msgs: list[Any] = [sys_msg, {"role": "user", "content": f"task {agent.group}"}]
    if agent.reports is not None:
        msgs.append({"role": "tool", "content": f"the sub-agent answered: {answers[agent.reports]}."})
    t = agent.start
    for k, turn in enumerate(agent.turns):
        if turn.compact and k:
            summary = tok(rng.randint(2, 6))
            segments, replies = [_header(system, summary)], []
            msgs = [sys_msg, {"role": "user", "content": f"summary {a}.{k}"}]
        if turn.history_drift and len(replies) >= 2:
            j = replies[rng.randrange(len(replies) - 1)]
            at = rng.randrange(len(segments[j]) - 1)
            segments[j] = [*segments[j][:at], tok.other(segments[j][at]), *segments[j][at + 1:]]
        prompt = list(itertools.chain.from_iterable(segments))
        kinds = ["error"] * turn.errors + ["abandoned"] * turn.timeout + ["discarded"] * turn.discarded + ["kept"]
        think_len, reply = 0, []
        for n, kind in enumerate(kinds):
            label = f"a{a}.{k}.{n}"
            think = [THINK_OPEN, *tok(rng.randint(1, 4)), THINK_CLOSE] if turn.think else []
            eot = [] if turn.length else [ALT_EOT if turn.render == "eot" or rng.random() < 0.3 else IM_END]
            reply = [*think, *tok(rng.randint(1, 5)), *eot] if kind != "error" else []
            think_len = len(think)
            # twins' first calls overlap, so they are parallel forks, never mistaken for a retry
            seconds = rng.uniform(0.6, 2.0) if k == 0 else rng.uniform(0.05, 2.0)
            if kind == "abandoned":  # runs on long after the client gave up on it
                seconds = rng.uniform(5.0, 40.0)
            fields: dict[str, Any] = {
                "_end": t + seconds, "_start": t, "_kind": kind, "_turn": k, "_agent": a, "_label": label,
                "prompt": prompt, "response_ids": reply, "messages": msgs if plan.messages else [],
                "started": t, "seconds": seconds, "side_request": agent.side,
                "finish_reason": "length" if turn.length else "stop",
                "_response": {"message": {"role": "assistant", "content": f"reply {label}"}},
            }
            if kind == "error":
                fields.update(status="error", error="upstream 500", finish_reason=None)
            elif plan.delivery:  # an abandoned answer never reached the harness (it had hung up); a discarded one did
                fields["delivered"] = kind != "abandoned"
            if kind == "kept" and turn.no_logprobs:
                fields["response_logprobs"] = []
            if kind == "kept" and turn.unfaithful:
                fields["token_faithful"] = False
                if turn.unfaithful == "empty":
                    fields["prompt"], fields["response_ids"] = [], []
            yield fields
            t += rng.uniform(0.3, 2.0) if kind == "abandoned" else seconds + rng.uniform(0.01, 1.0)
        shown = _render(reply, think_len, turn, tok)
        fields["_rendered"] = shown[:-1] if turn.length else shown  # a template-added end of turn is bridge
        segments.append(shown)
        replies.append(len(segments) - 1)
        segments.append(_bridge(tok(rng.randint(1, 6))))
        msgs = [*msgs, {"role": "assistant", "content": f"reply a{a}.{k}.{len(kinds) - 1}"},
                {"role": "tool", "content": f"result {a}.{k}"}]
        answers[a] = f"reply a{a}.{k}.{len(kinds) - 1}"


def simulate(plan: SessionPlan) -> tuple[CompletionSession, Truth]:
    """Render ``plan`` into a journaled session (index = order of finishing) and its ground truth."""
    rng = random.Random(plan.seed)
    tok = _Tokens(rng, plan.alphabet)
    prompts: dict[int, tuple[list[int], list[int]]] = {}
    calls: list[dict[str, Any]] = []
    answers: dict[int, str] = {}
    for a, agent in enumerate(plan.agents):
        if agent.group not in prompts:
            system = [AGENT_MARK + agent.group, *tok(rng.randint(2, 8))]
            if plan.shared_system and prompts and not agent.side:
                system = prompts[plan.agents[0].group][0]
            prompts[agent.group] = (system, tok(rng.randint(1, 4)))
        calls += _attempts(plan, a, agent, rng, tok, *prompts[agent.group], answers)
    calls.sort(key=lambda c: (c["_end"], c["_agent"]))
    truth, records = Truth(), []
    for index, c in enumerate(calls):
        r = rec(index, c.pop("prompt"), c.pop("response_ids"), messages=c.pop("messages"), started=c.pop("started"),
                seconds=c.pop("seconds"), **{k: v for k, v in c.items() if not k.startswith("_")})
        r = r.model_copy(update={"response": c["_response"]})
        records.append(r)
        truth.agent[r.completion_id] = c["_agent"]
        truth.turn[r.completion_id] = (c["_agent"], c["_turn"])
        if "_rendered" in c:
            truth.rendered[r.completion_id] = c["_rendered"]
        c["_id"] = r.completion_id
    usable = {r.completion_id for r in partition(session(*records), BREAK)[0]}
    def asked(c: dict[str, Any]) -> tuple[Any, ...]:
        """Calls with one prompt: a turn's attempts, and twins' first calls (one group, one first prompt)."""
        return ("group", plan.agents[c["_agent"]].group) if c["_turn"] == 0 else ("agent", c["_agent"], c["_turn"])

    by_turn = itertools.groupby(sorted(calls, key=lambda c: (asked(c), c["_start"])), key=asked)
    for _, group in by_turn:
        attempts = list(group)
        for n, c in enumerate(attempts):
            if c["_kind"] in ("discarded", "abandoned"):
                truth.discarded.add(c["_id"])
                # a later attempt that was answered shows the retry: trainable, or told apart by its messages
                if c["_id"] in usable and any(later["_id"] in usable or (plan.messages and later["_kind"] != "error")
                                              for later in attempts[n + 1:]):
                    truth.detectable.add(c["_id"])
    return session(*records), truth


# -- the oracle -------------------------------------------------------------------------------------------------
def expected_chains(sess: CompletionSession, truth: Truth, on_rerender: str) -> set[tuple[str, ...]]:
    """Each agent's usable completions (retried answers removed), split where the next prompt does not extend the
    previous one: exactly ("break") or by plain token prefix ("merge")."""
    usable, _ = partition(sess, BREAK)
    chains: list[list[CompletionRecord]] = []
    of_agent: dict[int, list[list[CompletionRecord]]] = {}
    for r in usable:
        if r.completion_id in truth.detectable:
            continue
        agent = truth.agent[r.completion_id]

        def fits(chain: list[CompletionRecord], r: CompletionRecord = r) -> bool:
            prev = chain[-1]
            head = prev.prompt_ids + (prev.response_ids if on_rerender == "break" else [])
            return len(r.prompt_ids) > len(prev.prompt_ids) and r.prompt_ids[:len(head)] == head

        # an attempt that finished late (a client timeout) may continue an older chain of its agent than the latest
        fitting = [c for c in of_agent.get(agent, []) if fits(c)]
        if fitting:
            max(fitting, key=lambda c: len(c[-1].prompt_ids)).append(r)
            continue
        of_agent.setdefault(agent, []).append([r])
        chains.append(of_agent[agent][-1])
    return {tuple(r.completion_id for r in chain) for chain in chains}


# -- checks -----------------------------------------------------------------------------------------------------
def trained_ids(traj: Trajectory) -> list[str]:
    return [c for t in traj.traces if not t.metadata.get("superseded") for c in t.metadata["completion_ids"]]


def check_exactly_once(sess: CompletionSession, traj: Trajectory) -> None:
    diag = traj.diagnostics
    trained = set(trained_ids(traj))
    excluded = {c for ids in diag["excluded"].values() for c in ids}
    superseded = set(diag.get("superseded", []))
    assert not trained & excluded and not trained & superseded and not excluded & superseded
    assert trained | excluded | superseded == {r.completion_id for r in sess.completions}


def check_exact_context(sess: CompletionSession, traj: Trajectory) -> None:
    """Each merged reply sits in exactly the context the engine saw: the trace is token-identical to the calls."""
    by_id = {r.completion_id: r for r in sess.completions}
    for trace in traj.traces:
        for span in trace.metadata["spans"]:
            assert by_id[span["completion_id"]].prompt_ids == trace.prompt_ids + trace.response_ids[:span["start"]]


def check_bridges(sess: CompletionSession, traj: Trajectory, truth: Truth) -> None:
    """Under "merge": each completion's prompt extends its predecessor's, and the masked bridge is exactly what the
    prompt holds after the predecessor's reply as the template rendered it."""
    by_id = {r.completion_id: r for r in sess.completions}
    for trace in traj.traces:
        spans = trace.metadata["spans"]
        for before, span in itertools.pairwise(spans):
            prev, cur = by_id[before["completion_id"]], by_id[span["completion_id"]]
            assert len(cur.prompt_ids) > len(prev.prompt_ids)
            assert cur.prompt_ids[:len(prev.prompt_ids)] == prev.prompt_ids
            bridge = trace.response_ids[before["end"]:span["start"]]
            assert not bridge or cur.prompt_ids[-len(bridge):] == bridge
            assert set(trace.loss_mask[before["end"]:span["start"]]) <= {0}
            shown, n = truth.rendered.get(prev.completion_id), len(prev.prompt_ids)
            if shown is not None and cur.prompt_ids[n:n + len(shown)] == shown:
                assert bridge == cur.prompt_ids[n + len(shown):]


def unambiguous(plan: SessionPlan, sess: CompletionSession, truth: Truth) -> bool:
    """Whether the ground truth is decidable from tokens and messages: unique content tokens, or colliding ones
    with messages, no twins, and no identical prompts but a turn's own attempts."""
    if plan.alphabet is None:
        return True
    groups = [a.group for a in plan.agents]
    turns_by_prompt: dict[tuple[int, ...], set[tuple[int, int]]] = {}
    for r in sess.completions:
        if r.prompt_ids:
            turns_by_prompt.setdefault(tuple(r.prompt_ids), set()).add(truth.turn[r.completion_id])
    return (plan.messages and len(set(groups)) == len(groups)
            and all(len(turns) == 1 for turns in turns_by_prompt.values()))


def check_session(plan: SessionPlan) -> None:
    sess, truth = simulate(plan)
    usable, _ = partition(sess, BREAK)
    flat = per_request(sess, BREAK)
    check_invariants(sess, flat)
    check_exactly_once(sess, flat)
    assert len(flat.traces) == len(usable)
    for trace, r in zip(flat.traces, usable, strict=True):
        assert (trace.prompt_ids, trace.response_ids) == (r.prompt_ids, r.response_ids)
        assert set(trace.loss_mask) == {1}
    for config in (BREAK, MERGE, KEEP):
        traj = prefix_merging(sess, config)
        check_invariants(sess, traj)
        check_exactly_once(sess, traj)
        assert len(traj.traces) <= len(flat.traces)
        if config.on_rerender == "break":
            check_exact_context(sess, traj)
        else:
            check_bridges(sess, traj, truth)
        if not unambiguous(plan, sess, truth) or (config.on_rerender == "merge" and plan.twin_rerendered()):
            continue  # the ground truth is ambiguous to a token-level builder; the invariants are not
        chains = {tuple(t.metadata["completion_ids"]) for t in traj.traces if not t.metadata.get("superseded")}
        assert chains == expected_chains(sess, truth, config.on_rerender)
        assert set(traj.diagnostics["superseded"]) == truth.detectable
        if config.keep_superseded:
            kept = {c for t in traj.traces if t.metadata.get("superseded") for c in t.metadata["completion_ids"]}
            assert kept == truth.detectable


# -- strategies -------------------------------------------------------------------------------------------------
def _rarely(value: Any, default: Any, weight: int = 4) -> st.SearchStrategy[Any]:
    return st.sampled_from([default] * weight + [value])


def turn_plans(*, clean: bool = False, rerender: bool = False) -> st.SearchStrategy[TurnPlan]:
    """A turn; ``clean`` forbids retries, drift and compaction (``rerender`` still allows re-rendered replies)."""
    renders: list[Render] = ["exact"] * 8 + ["drift", "split", "drop_thinking", "eot"]
    return st.builds(
        TurnPlan,
        errors=_rarely(1, 0),
        discarded=st.just(0) if clean else st.sampled_from([0] * 6 + [1, 2]),
        timeout=st.just(False) if clean else _rarely(True, False, 8),
        no_logprobs=_rarely(True, False, 8),
        unfaithful=st.sampled_from([""] * 10 + ["empty", "ids"]),
        length=_rarely(True, False),
        think=_rarely(True, False, 2),
        render=st.sampled_from(renders) if not clean or rerender else st.just("exact"),
        history_drift=st.just(False) if clean else _rarely(True, False, 8),
        compact=st.just(False) if clean else _rarely(True, False, 8),
    )


@st.composite
def session_plans(draw: st.DrawFn, *, clean: bool = False, rerender: bool = False) -> SessionPlan:
    turns = turn_plans(clean=clean, rerender=rerender)
    agents = [AgentPlan(0, 0.0, tuple(draw(st.lists(turns, max_size=10))))]
    delivery = draw(st.booleans())
    messages = draw(_rarely(False, True))
    for group in range(1, draw(st.integers(0, 3)) + 1):
        start = draw(st.integers(0, 30)) / 2
        size = 1 if clean else draw(st.sampled_from([1, 1, 2, 3]))
        # with delivery and messages known, twins may also start one after another (a sub-agent delegated twice),
        # each after the previous one's answer and a call of the parent that carries it and delegates again: then
        # one of them may be a single call, and their first turns may be retried
        sequential = size > 1 and delivery and messages and draw(st.booleans())
        previous = None
        for twin in range(size):
            first = draw(turns)
            if size > 1 and not sequential:  # parallel twins' first calls are never retried: nothing tells them apart
                first = replace(first, errors=0, discarded=0, timeout=False)
                if not draw(_rarely(True, False, 2)):
                    first = replace(first, render="exact", unfaithful="")
            rest = draw(st.lists(turns, max_size=4 if draw(st.booleans()) or not sequential else 0))
            if sequential:  # a compaction right after the first call hides its answer from everything after it: then
                rest = [replace(t, compact=False) for t in rest]  # nothing tells a second conversation from a retry
            twin_index = len(agents)
            agents.append(AgentPlan(group, start + twin * (120.0 if sequential else 0.05), (first, *rest)))
            if sequential and twin:
                agents.append(AgentPlan(10 + 4 * group + twin, start + twin * 120.0 - 10.0, (TurnPlan(),),
                                        reports=previous))
            previous = twin_index
    if draw(_rarely(True, False)):
        agents.append(AgentPlan(9, draw(st.integers(0, 20)) / 2, (TurnPlan(),), side=True))
    alphabet = None if clean else draw(st.sampled_from([None, None, None, 3, 50]))
    shared = False if clean else draw(_rarely(True, False, 3))
    return SessionPlan(tuple(agents), draw(st.integers(0, 2**16)), alphabet, messages, shared, delivery)


EMPTY = SessionPlan(())
SINGLE = SessionPlan((AgentPlan(0, 0.0, (TurnPlan(),)),))
PROFILE = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- properties -------------------------------------------------------------------------------------------------
@PROFILE
@given(session_plans())
@example(EMPTY)
@example(SINGLE)
def test_mixed_sessions_hold_every_invariant(plan: SessionPlan) -> None:
    check_session(plan)


# Found by the property above after the retry-vs-second-conversation rule landed (issue 13): two twins of one group
# 0.05 s apart, the later one's second call a client-timeout retry whose kept answer has no token IDs; the builder
# joined the twins' first completions (c0 with c4): the retry's answer, untrainable, now still supersedes the attempt.
TWINS_WITH_TIMEOUT_RETRY = SessionPlan((
    AgentPlan(0, 0.0, ()),
    AgentPlan(1, 0.0, (TurnPlan(),)),
    AgentPlan(1, 0.05, (TurnPlan(), TurnPlan(timeout=True, unfaithful="empty"), TurnPlan())),
))


# The same without messages (hypothesis, later): the abandoned attempt cannot be told a retry, so it is trained alone;
# merge mode had joined it to the other twin's chain although its prompt shows the sibling's reply exactly.
TWINS_WITHOUT_MESSAGES = SessionPlan((
    AgentPlan(0, 0.0, ()),
    AgentPlan(1, 0.0, (TurnPlan(),)),
    AgentPlan(1, 0.05, (TurnPlan(), TurnPlan(), TurnPlan(timeout=True, unfaithful="empty"), TurnPlan())),
), messages=False)


@pytest.mark.parametrize("plan", [TWINS_WITH_TIMEOUT_RETRY, TWINS_WITHOUT_MESSAGES], ids=["messages", "tokens"])
def test_twins_with_a_timeout_retry_keep_one_chain_each(plan: SessionPlan) -> None:
    check_session(plan)


# A sub-agent delegated twice (Claude Code's Task tool): the second starts from the first one's first prompt after
# the first one answered and the parent's next call (agent 2 here), which carries that answer, and each is one call.
# Only the journaled delivery and that call in between tell the two conversations from a retry.
SEQUENTIAL_ONE_CALL_TWINS = SessionPlan((
    AgentPlan(0, 0.0, (TurnPlan(), TurnPlan())),
    AgentPlan(1, 1.0, (TurnPlan(),)),
    AgentPlan(2, 50.0, (TurnPlan(),), reports=1),
    AgentPlan(1, 61.0, (TurnPlan(),)),
), delivery=True)


def test_sequential_one_call_twins_are_two_conversations_when_delivery_is_known() -> None:
    check_session(SEQUENTIAL_ONE_CALL_TWINS)
    sess, truth = simulate(SEQUENTIAL_ONE_CALL_TWINS)
    assert all(r.delivered for r in sess.completions) and not truth.detectable
    for config in (BREAK, MERGE):
        traj = prefix_merging(sess, config)
        assert not traj.diagnostics["superseded"] and len(traj.traces) == 4
    first = next(c for c, agent in truth.agent.items() if agent == 1)
    # without the flag (an older journal) the same pair reads as a retry: the first answer is superseded
    blind = session(*(r.model_copy(update={"delivered": None}) for r in sess.completions))
    assert prefix_merging(blind, BREAK).diagnostics["superseded"] == [first]
    # ... and so it does when nothing happened in between (a harness re-sending an answer it rejected), or when the
    # call in between does not carry the answer (a side request: a title, a next-speaker check)
    at_once = SessionPlan(tuple(a for a in SEQUENTIAL_ONE_CALL_TWINS.agents if a.group != 2), delivery=True)
    unused = SessionPlan(tuple(replace(a, reports=None) for a in SEQUENTIAL_ONE_CALL_TWINS.agents), delivery=True)
    for plan in (at_once, unused):
        sess, truth = simulate(plan)
        first = next(c for c, agent in truth.agent.items() if agent == 1)
        assert prefix_merging(sess, BREAK).diagnostics["superseded"] == [first]


def test_a_rejected_answer_re_sent_at_once_is_superseded() -> None:
    """Qwen Code re-sent a prompt 0.3 s after an answer it rejected (an unparseable tool-call block): the answer
    reached it, but nothing else happened before the retry, so it is a retry, not a second conversation."""
    plan = SessionPlan((AgentPlan(0, 0.0, (TurnPlan(), TurnPlan(discarded=1), TurnPlan())),), delivery=True)
    sess, truth = simulate(plan)
    (rejected,) = truth.discarded
    assert next(r for r in sess.completions if r.completion_id == rejected).delivered
    assert truth.detectable == {rejected}
    check_session(plan)


@settings(PROFILE, max_examples=150)
@given(session_plans(clean=True))
def test_clean_sessions_give_one_trace_per_agent(plan: SessionPlan) -> None:
    check_session(plan)
    sess, truth = simulate(plan)
    agents = {truth.agent[r.completion_id] for r in partition(sess, BREAK)[0]}
    for config in (BREAK, MERGE):
        traj = prefix_merging(sess, config)
        assert len(traj.traces) == len(agents)
        assert traj.diagnostics["breaks"].keys() <= {"new_context"}
        for trace in traj.traces:
            assert len({truth.agent[c] for c in trace.metadata["completion_ids"]}) == 1


@settings(PROFILE, max_examples=150)
@given(session_plans(clean=True, rerender=True))
def test_rerendered_replies_stay_in_one_chain_when_merging(plan: SessionPlan) -> None:
    check_session(plan)
    sess, truth = simulate(plan)
    agents = {truth.agent[r.completion_id] for r in partition(sess, BREAK)[0]}
    assert len(prefix_merging(sess, MERGE).traces) == len(agents)


def test_the_simulator_makes_what_the_plan_says() -> None:
    """Guard against a generator that silently stops producing the hard cases."""
    turn = TurnPlan(discarded=1, errors=1, length=True, think=True, render="drift")
    plan = SessionPlan((AgentPlan(0, 0.0, (turn, TurnPlan(), TurnPlan(compact=True), TurnPlan())),
                        AgentPlan(1, 1.0, (TurnPlan(), TurnPlan())), AgentPlan(1, 1.05, (TurnPlan(),))))
    sess, truth = simulate(plan)
    statuses = [r.status for r in sess.completions]
    assert len(sess.completions) == 6 + 2 + 1 and statuses.count("error") == 1
    assert len(truth.detectable) == 1
    traj = prefix_merging(sess, BREAK)
    breaks = traj.diagnostics["breaks"]
    # the compaction may be labelled "history_rewritten": _classify_new compares with the first of equally close
    # chains (here the retried turn's short chain), not the latest one
    assert {"drift", "new_context", "fork"} <= breaks.keys() and sum(breaks.values()) == 4
    check_session(plan)


# -- twins: minimal sessions the properties once found mis-wired (the generator still avoids them) ---------------
def test_retry_by_one_of_two_twins_after_both_answered() -> None:
    cfg = MergeConfig(end_of_turn_ids=(IM_END,))
    sess = session(rec(0, [5, 6], [30, IM_END], started=0, seconds=1),  # twin 1's first answer, discarded
                   rec(1, [5, 6], [31, IM_END], started=0.1, seconds=1.2),  # twin 2, in parallel
                   rec(2, [5, 6], [32, IM_END], started=2, seconds=1),  # twin 1 retries after both came back
                   rec(3, [5, 6, 32, IM_END, 40], [33, IM_END], started=4),  # twin 1 goes on with its retry
                   rec(4, [5, 6, 31, IM_END, 41], [34, IM_END], started=5))  # twin 2 goes on with its answer
    traj = prefix_merging(sess, cfg)
    assert traj.diagnostics["superseded"] == ["c0"]
    assert sorted(t.metadata["completion_ids"] for t in traj.traces) == [["c1", "c4"], ["c2", "c3"]]


def test_merge_mode_cross_wires_twins() -> None:
    cfg = MergeConfig(end_of_turn_ids=(IM_END,), on_rerender="merge")
    sess = session(rec(0, [5, 6], [30, IM_END], started=0, seconds=5),
                   rec(1, [5, 6], [31, IM_END], started=1, seconds=5),  # a parallel twin
                   rec(2, [5, 6, 30, 12, IM_END, 40], [32, IM_END], started=7))  # twin 1 goes on, its reply drifted
    traj = prefix_merging(sess, cfg)
    assert sorted(t.metadata["completion_ids"] for t in traj.traces) == [["c0", "c2"], ["c1"]]


def test_the_simulator_makes_client_timeouts_and_answers_without_logprobs() -> None:
    """Guard: a timed-out attempt finishes after the turns that followed its retry, and is superseded, not a chain."""
    plan = SessionPlan((AgentPlan(0, 0.0, (TurnPlan(), TurnPlan(timeout=True), TurnPlan(no_logprobs=True),
                                           TurnPlan())),))
    sess, truth = simulate(plan)
    (abandoned,) = truth.detectable
    assert sess.completions[-1].completion_id == abandoned  # journaled last: it ran on after the client gave up
    traj = prefix_merging(sess, BREAK)
    assert traj.diagnostics["superseded"] == [abandoned] and traj.diagnostics["breaks"] == {}
    (trace,) = traj.traces
    assert trace.metadata["has_logprobs"] is False and traj.diagnostics["traces_without_logprobs"] == 1
    check_session(plan)
