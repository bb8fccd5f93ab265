"""What mutation testing found loosely pinned in ``prefix_merging`` (issue 20): a continuation with nothing between
two replies, a drift with no end of turn, which chain a new one is measured against for its cause, a rejected
candidate counted once, forks of a chain that has moved on, which attempt a later completion goes on from (its
messages' text and tool calls, the clock, ``delivered``) and the boundaries of a retry."""

from __future__ import annotations

import pytest

from tests.merge._sessions import EOT, merged, rec


def causes(traj):
    return [t.metadata["chain_cause"] for t in traj.traces]


def chains(traj):
    return [t.metadata["completion_ids"] for t in traj.traces]


def user(text):
    return {"role": "user", "content": text}


def answering(record, message):
    """``record`` with the assistant message its answer is journaled as (what a harness repeats in its history)."""
    return record.model_copy(update={"response": {"message": message}})


def assistant(text, *calls):
    return {"role": "assistant", "content": text, **({"tool_calls": list(calls)} if calls else {})}


# ------------------------------------------------------------------------------------------ joining a chain


def test_a_prompt_that_ends_with_the_last_reply_joins_with_no_bridge():
    """A continuation (the harness asks the model to go on) adds no unsampled tokens; the same messages still
    extend themselves."""
    msgs = [user("go")]
    traj = merged(rec(0, [1, 2], [10, EOT], messages=msgs), rec(1, [1, 2, 10, EOT], [11, 12, EOT], messages=msgs))
    (t,) = traj.traces
    assert t.metadata["completion_ids"] == ["c0", "c1"]
    assert t.response_ids == [10, EOT, 11, 12, EOT] and t.loss_mask == [1, 1, 1, 1, 1]
    assert [(s["start"], s["end"]) for s in t.metadata["spans"]] == [(0, 2), (2, 5)]
    assert traj.diagnostics["breaks"] == {} and traj.diagnostics["rejected_candidates"] == {}


def test_a_rerendered_reply_with_no_end_of_turn_breaks_the_chain_as_drift():
    traj = merged(rec(0, [1, 2], [10, EOT]), rec(1, [1, 2, 10, 11, 12], [13, EOT]))
    assert chains(traj) == [["c0"], ["c1"]] and causes(traj) == ["first", "drift"]
    assert traj.diagnostics["breaks"] == {"drift": 1} and traj.diagnostics["rerender_merged"] == 0


def test_a_rejected_candidate_is_counted_once_after_chains_moved_on():
    """Each chain is looked up under its last prompt only, and each prompt length once: the chain that grew from a
    one-token prompt (another chain keeps that length), the length another chain left and then this one took, and the
    length two chains share are not looked up again."""
    m0, m1 = [user("a")], [user("a"), assistant("reply 0"), user("b")]
    traj = merged(rec(0, [1], [10, EOT], messages=m0), rec(1, [7], [30, EOT], messages=[user("other")]),
                  rec(2, [8, 8, 8, 8], [40, EOT]), rec(3, [8, 8, 8, 8, 40, EOT, 60], [41, EOT]),
                  rec(4, [1, 10, EOT, 50], [11, EOT], messages=m1), rec(5, [9, 9, 9, 9], [42, EOT]),
                  rec(6, [1, 10, EOT, 50, 11, EOT, 51], [12, EOT], messages=[user("edited"), user("c")]))
    assert chains(traj) == [["c0", "c4"], ["c1"], ["c2", "c3"], ["c5"], ["c6"]]
    assert traj.diagnostics["rejected_candidates"] == {"message_mismatch": 1}
    assert causes(traj) == ["first", "new_context", "new_context", "new_context", "history_rewritten"]


def test_a_rejected_candidate_is_counted_once_when_two_chains_reach_one_prompt_length():
    m0, m1 = [user("a")], [user("a"), assistant("reply 0"), user("b")]
    traj = merged(rec(0, [1], [10, EOT], messages=m0), rec(1, [9, 9, 9, 9], [42, EOT]),
                  rec(2, [1, 10, EOT, 50], [11, EOT], messages=m1),
                  rec(3, [1, 10, EOT, 50, 11, EOT, 51], [12, EOT], messages=[user("edited"), user("c")]))
    assert chains(traj) == [["c0", "c2"], ["c1"], ["c3"]]
    assert traj.diagnostics["rejected_candidates"] == {"message_mismatch": 1}


# ------------------------------------------------------------------------------------ the cause of a new chain


@pytest.mark.parametrize(("prompts", "cause"), [
    # two earlier chains share as much with it: the latest one is the measure (its short first prompt)
    ([[1, 2, 3, 4, 5, 6], [1, 2, 5], [1, 2, 9]], "history_rewritten"),
    # the chain that shares the most is the measure, not the latest one
    ([[1, 2, 3, 4], [1, 5, 6, 7, 8, 9], [1, 2, 3, 9]], "history_rewritten"),
    # one shared token is half of a two-token first prompt
    ([[1, 2], [1, 9, 9]], "history_rewritten"),
    # the chain's prompt cut back: all of the new prompt is shared, and it is shorter
    ([[1, 2, 3, 4], [1, 2, 3]], "compaction"),
])
def test_a_new_chain_is_measured_against_the_chain_it_shares_most_with(prompts, cause):
    traj = merged(*(rec(i, p, [10 + i, EOT]) for i, p in enumerate(prompts)))
    assert len(traj.traces) == len(prompts) and causes(traj)[-1] == cause


@pytest.mark.parametrize("second", [
    [1, 2, 3, 10, EOT, 50, 11, EOT, 51],  # thinking off: the empty thinking span (3) dropped, the prompt longer
    [1, 2, 10, EOT, 51],  # thinking on: a long thinking span dropped, the prompt shorter (not a compaction)
])
def test_a_history_sent_on_unchanged_but_rendered_anew_is_template_rerendered(second):
    """Qwen3's template drops the earlier turns' thinking at a new user turn (an empty span with thinking off): the
    harness kept its history, so the break is the template's, not a rewritten history or a compaction."""
    m0 = [user("a"), assistant("reply 0"), {"role": "tool", "content": "r"}]
    m1 = [*m0, assistant("reply 1"), user("b")]
    traj = merged(rec(0, [1, 2, 3, 4, 5, 6, 7], [10, EOT], messages=m0), rec(1, second, [12, EOT], messages=m1))
    assert chains(traj) == [["c0"], ["c1"]] and causes(traj) == ["first", "template_rerendered"]
    # the same tokens with an edited history are not the template's doing
    edited = merged(rec(0, [1, 2, 3, 4, 5, 6, 7], [10, EOT], messages=m0),
                    rec(1, second, [12, EOT], messages=[user("edited"), *m1[1:]]))
    assert causes(edited)[-1] != "template_rerendered"


def test_a_fork_of_a_chain_that_moved_on_is_a_fork_not_a_compaction():
    """Parallel twins sent at once, each gone on from: the second is trained in its own chain, called a fork even
    though the first one's chain already has a longer prompt."""
    p = [1, 2]
    traj = merged(rec(0, p, [10, EOT], started=10), rec(1, [*p, 10, EOT, 50], [11, EOT], started=20),
                  rec(2, p, [20, EOT], started=10), rec(3, [*p, 20, EOT, 60], [21, EOT], started=30))
    assert chains(traj) == [["c0", "c1"], ["c2", "c3"]] and causes(traj) == ["first", "fork"]
    assert traj.diagnostics["breaks"] == {"fork": 1} and traj.diagnostics["superseded"] == []


def test_a_retried_compaction_is_a_compaction_not_a_fork():
    """One attempt left of a retried turn is no fork: its chain is given the cause its prompt shows."""
    c = [1, 2, 60]
    traj = merged(rec(0, [1, 2, 3, 4], [10, EOT]), rec(1, [1, 2, 3, 4, 10, EOT, 50], [11, EOT]),
                  rec(2, c, [12, EOT], started=20), rec(3, c, [13, EOT], started=30))
    assert chains(traj) == [["c0", "c1"], ["c3"]] and causes(traj) == ["first", "compaction"]
    assert traj.diagnostics["superseded"] == ["c2"] and traj.diagnostics["breaks"] == {"compaction": 1}


# --------------------------------------------------------------------- which attempt a later completion goes on from

P = [1, 10, EOT, 50]
M1 = [user("a"), assistant("reply 0"), user("b")]


def test_a_completion_sent_at_the_same_instant_as_an_attempt_goes_on_from_it():
    traj = merged(rec(0, [1], [10, EOT]), rec(1, P, [20, EOT], started=10), rec(2, P, [21, EOT], started=20),
                  rec(3, [*P, 21, EOT, 51], [22, EOT], started=20))
    assert chains(traj) == [["c0", "c2", "c3"]] and traj.diagnostics["superseded"] == ["c1"]


def test_an_answer_the_harness_hung_up_on_is_never_gone_on_from():
    """Even when the next prompt shows its tokens: the delivered retry is the one used."""
    traj = merged(rec(0, [1], [10, EOT]), rec(1, P, [20, EOT], started=10, delivered=False),
                  rec(2, P, [21, EOT], started=20, delivered=True), rec(3, [*P, 20, EOT, 51], [22, EOT], started=30))
    assert traj.diagnostics["superseded"] == ["c1"]
    assert chains(traj)[0] == ["c0", "c2"]


def test_the_messages_text_decides_over_the_tokens_shown():
    first = assistant("first answer")
    second = assistant("second answer")
    traj = merged(rec(0, [1], [10, EOT], messages=[user("a")]),
                  answering(rec(1, P, [20, EOT], started=10, messages=M1), first),
                  answering(rec(2, P, [21, EOT], started=20, messages=M1), second),
                  rec(3, [*P, 21, EOT, 51], [22, EOT], started=30,
                      messages=[*M1, assistant("first answer"), user("c")]))
    assert traj.diagnostics["superseded"] == []  # the first attempt was gone on from: a fork, not thrown away
    assert chains(traj) == [["c0", "c1"], ["c2", "c3"]] and causes(traj) == ["first", "fork"]


def test_attempts_that_say_the_same_are_told_apart_by_the_tokens_shown():
    same = assistant("same answer")
    traj = merged(rec(0, [1], [10, EOT], messages=[user("a")]),
                  answering(rec(1, P, [20, EOT], started=10, messages=M1), same),
                  answering(rec(2, P, [21, EOT], started=20, messages=M1), same),
                  rec(3, [*P, 20, EOT, 51], [22, EOT], started=30,
                      messages=[*M1, assistant("same answer"), user("c")]))
    assert traj.diagnostics["superseded"] == []  # the first was used; the latest is kept (nothing came after it)
    assert chains(traj) == [["c0", "c1", "c3"], ["c2"]] and causes(traj) == ["first", "fork"]


def test_tool_calls_are_matched_by_name_and_arguments_not_ids_or_key_order():
    """Text parts are joined, a call's id and its arguments' key order ignored, a call without a function
    skipped: the harness's copy of the first answer is recognised though the tokens show the second."""
    def call(call_id, arguments):
        return {"id": call_id, "type": "function", "function": {"name": "read", "arguments": arguments}}

    first = {"role": "assistant", "content": [{"type": "text", "text": "let me look"}],
             "tool_calls": [call("call_a", '{"path": "a", "n": 1}')]}
    second = {"role": "assistant", "content": [{"type": "text", "text": "let me look"}],
              "tool_calls": [call("call_b", '{"path": "b", "n": 1}')]}
    copy = assistant("let me look ", call("toolu_1", '{"n": 1, "path": "a"}'), {"id": "broken"})
    traj = merged(rec(0, [1], [10, EOT], messages=[user("a")]),
                  answering(rec(1, P, [20, EOT], started=10, messages=M1), first),
                  answering(rec(2, P, [21, EOT], started=20, messages=M1), second),
                  rec(3, [*P, 21, EOT, 51], [22, EOT], started=30,
                      messages=[*M1, copy, {"role": "tool", "content": "file a"}]))
    assert traj.diagnostics["superseded"] == []
    assert chains(traj) == [["c0", "c1"], ["c2", "c3"]]


# ---------------------------------------------------------------------------------------- a retry's boundaries


@pytest.mark.parametrize(("first", "retry", "between"), [
    ((10.0, 0.125), 10.125, None),  # sent the instant the first came back
    ((0.0, 5.0), 0.2, None),  # sent exactly _SENT_TOGETHER_SECONDS after the first, which still runs
    ((10.0, 1.0), 15.0, (12.0, 3.0)),  # delivered, but the call in between came back as the retry was sent
])
def test_a_retry_at_its_boundary_supersedes_the_first_attempt(first, retry, between):
    (started, seconds) = first
    records = [rec(0, [1], [10, EOT], started=-10.0),
               rec(1, P, [20, EOT], started=started, seconds=seconds, delivered=between is not None)]
    if between is not None:
        records.append(rec(2, [300], [40, EOT], started=between[0], seconds=between[1]))
    records.append(rec(3, P, [21, EOT], started=retry))
    traj = merged(*records)
    assert traj.diagnostics["superseded"] == ["c1"]
    assert chains(traj)[0] == ["c0", "c3"]


def test_an_empty_reply_is_never_what_a_later_prompt_goes_on_from():
    """An empty answer (excluded, no tokens) shows trivially in any prompt: the attempt with a reply, re-rendered
    in the next prompt, is the one gone on from, and is trained."""
    empty = answering(rec(2, P, [], started=20, messages=M1, response_logprobs=[]), assistant(""))
    traj = merged(rec(0, [1], [10, EOT], messages=[user("a")]), rec(1, P, [20, EOT], started=10, messages=M1),
                  empty, rec(3, [*P, 20, 21, EOT, 51], [22, EOT], started=30,
                             messages=[*M1, assistant("reply 1"), user("c")]))
    assert traj.diagnostics["superseded"] == [] and traj.diagnostics["excluded"] == {"empty": ["c2"]}
    assert chains(traj) == [["c0", "c1"], ["c3"]] and causes(traj) == ["first", "drift"]


def test_the_latest_of_untrainable_retries_that_say_the_same_is_gone_on_from():
    """Two retries the proxy could not journal token for token said the same thing, and the harness went on with
    it: the trained first attempt was thrown away."""
    again = assistant("second answer")
    traj = merged(rec(0, [1], [10, EOT], messages=[user("a")]),
                  answering(rec(1, P, [20, EOT], started=10, messages=M1), assistant("first answer")),
                  answering(rec(2, P, [21, EOT], started=20, messages=M1, token_faithful=False), again),
                  answering(rec(3, P, [21, EOT], started=30, messages=M1, token_faithful=False), again),
                  rec(4, [*P, 21, EOT, 51], [22, EOT], started=40, messages=[*M1, again, user("c")]))
    assert traj.diagnostics["superseded"] == ["c1"]
    assert traj.diagnostics["excluded"] == {"not_token_faithful": ["c2", "c3"]}


def test_a_prompt_going_on_from_a_twin_whose_chain_moved_on_is_a_fork():
    """Twins sent at once with replies cut short (no end of turn): a second branch from the second twin's reply
    is found under the first twin's prompt, shows no end of turn, and is called a fork, not a drift."""
    p = [1, 2]
    traj = merged(rec(0, p, [20, 21], started=10), rec(1, p, [30, 31], started=10),
                  rec(2, [*p, 30, 31, 50], [40, EOT], started=20), rec(3, [*p, 30, 31, 60], [41, EOT], started=30))
    assert chains(traj) == [["c0"], ["c1", "c2"], ["c3"]]
    assert causes(traj) == ["first", "fork", "fork"] and traj.diagnostics["breaks"] == {"fork": 2}


def test_an_untrainable_retry_supersedes_the_attempt_of_its_own_sub_agent():
    """Two sub-agents open with the same messages but different tools (so different prompts); the second one's first
    call times out and its retry, answered but not journaled token for token, is what it goes on from. The retry
    joins the attempts of the sub-agent whose tools it has: the second one's first attempt is thrown away, and the
    first sub-agent's (which it goes on from too) is not."""
    opening = [user("a")]
    tools_a = {"tools": [{"type": "function", "function": {"name": "read"}}]}
    tools_b = {"tools": [{"type": "function", "function": {"name": "write"}}]}

    def call(index, prompt, response, messages, tools, **kw):
        record = rec(index, prompt, response, messages=messages, **kw)
        request = {**record.normalized_request, **tools}
        return record.model_copy(update={"normalized_request": request})

    retried = assistant("retried")
    traj = merged(
        answering(call(0, [1, 2], [10, EOT], opening, tools_a, started=0), assistant("reply 0")),
        answering(call(1, [3, 4], [20, EOT], opening, tools_b, started=1), assistant("abandoned")),
        answering(call(2, [3, 4], [21, EOT], opening, tools_b, started=20, token_faithful=False), retried),
        call(3, [3, 4, 21, EOT, 50], [22, EOT], [*opening, retried, user("b")], tools_b, started=40),
        call(4, [1, 2, 10, EOT, 60], [11, EOT], [*opening, assistant("reply 0"), user("c")], tools_a, started=41))
    assert traj.diagnostics["superseded"] == ["c1"]
    assert ["c0", "c4"] in chains(traj) and ["c1"] not in chains(traj)


def test_each_completion_is_asked_about_one_retried_prompt_only(monkeypatch):
    """Every turn of a 200-turn session retried once: telling the attempts apart asks each completion which attempt
    it goes on from for the longest retried prompt it extends only (the shorter ones are asked by that prompt's own
    attempts), so the work is linear in the session, not retries x completions (issue 41: half the build time of
    a 400-turn retry session)."""
    import polar_gym.merge.prefix_merging as module

    asked = []
    original = module._continues

    def counting(later, attempts):
        asked.append(later.completion_id)
        return original(later, attempts)

    monkeypatch.setattr(module, "_continues", counting)
    records, prompt, token = [], [1], 1000
    for turn in range(200):
        for attempt in range(2):
            index = len(records)
            records.append(rec(index, prompt, [token + attempt, EOT], started=turn * 10.0 + attempt * 2))
        prompt = [*prompt, token + 1, EOT, token + 2]  # the harness went on from the second attempt
        token += 3
    traj = merged(*records)
    assert traj.diagnostics["superseded"] == [f"c{i}" for i in range(0, 400, 2)]
    assert chains(traj)[0] == [f"c{i}" for i in range(1, 400, 2)]
    assert len(asked) <= len(records)


def test_an_untrainable_retry_joins_the_attempt_it_follows_when_one_request_has_two_prompts():
    """One request (the same messages and tools) rendered to two prompts (a drifted history): the retry whose own
    answer cannot be trained retries the attempt sent just before it, not the first prompt's: that one was gone on
    from and stays, the timed-out one is thrown away (issue 41: it joined the first group and left the abandoned
    attempt to be trained as a turn of its own)."""
    m = [user("a")]
    retried = assistant("retried")
    traj = merged(
        rec(0, [1, 2, 3], [10, EOT], messages=m, started=0),
        rec(1, [1, 2, 3, 10, EOT, 50], [11, EOT], messages=[*m, assistant("reply 0"), user("b")], started=10),
        rec(2, [1, 2, 4], [20, EOT], messages=m, started=100, seconds=30, delivered=False),
        answering(rec(3, [1, 2, 4], [21, EOT], messages=m, started=105, token_faithful=False), retried),
        rec(4, [1, 2, 4, 21, EOT, 60], [22, EOT], messages=[*m, retried, user("c")], started=120))
    assert traj.diagnostics["superseded"] == ["c2"]
    assert ["c0", "c1"] in chains(traj) and ["c2"] not in chains(traj)


# ------------------------------------------------------------------ a rejected answer, a side request, the re-send

SUB = [user("explore the repo")]
SAID = "Found 3 files: a.py, b.py, c.py"
HISTORY = [user("fix the bug"), assistant("I will delegate")]


@pytest.mark.parametrize(("shape", "between", "superseded"), [
    # opencode: a title request (another model, its own system prompt) answered before the re-send
    ("opencode title", dict(messages=[{"role": "system", "content": "You are a title generator."},
                                      user("fix the bug")], side_request=True), ["c1"]),
    # Gemini CLI / Qwen Code: a next-speaker check with the session's own model, over the history without the answer
    ("next-speaker check", dict(messages=[*HISTORY, user("Who should speak next? Answer in JSON.")]), ["c1"]),
    # Claude Code: a small-model side request (a command's safety check) that quotes the answer: still not a turn
    ("claude code side request", dict(messages=[user(f"Is this safe? {SAID}")], side_request=True), ["c1"]),
    # Claude Code's Task tool: the parent's next turn is given the sub-agent's answer and delegates again
    ("parent given the answer", dict(messages=[*HISTORY, {"role": "tool", "content": f"Result: {SAID}"}]), []),
    # the sub-agent's own next turn, whose tokens cannot be used (no token IDs), went on with the answer
    ("its own next turn", dict(messages=[*SUB, assistant(SAID), user("go on")], token_faithful=False), []),
])
def test_a_re_sent_prompt_is_a_retry_unless_a_call_in_between_carries_the_answer(shape, between, superseded):
    """Which calls answered between an answer and the re-send of its prompt tell a second conversation from a
    retry: only one that carries the answer (a harness that rejected it uses it nowhere); a side request never
    counts, nor a call that carries the history without it (issue 41: any whole call in between counted)."""
    traj = merged(rec(0, [1], [10, EOT], messages=[user("fix the bug")], started=0),
                  answering(rec(1, [5, 6], [20, EOT], messages=SUB, started=10, delivered=True), assistant(SAID)),
                  rec(2, [7, 8], [30, EOT], started=12, delivered=True, **between),
                  rec(3, [5, 6], [21, EOT], messages=SUB, started=15, delivered=True))
    assert traj.diagnostics["superseded"] == superseded, shape
