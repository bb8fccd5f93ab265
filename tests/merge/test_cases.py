"""The numbered case matrix for the builders, with readable token IDs (EOT = 99; 1-3 system prompt; 10-39 sampled
replies; 50-59 tool results; 200+ a sub-agent's prompt)."""

from __future__ import annotations

import pytest

from polar_gym.merge.base import MergeConfig
from polar_gym.merge.per_request import per_request
from polar_gym.merge.prefix_merging import common_prefix_len
from tests.merge._sessions import EOT, check_invariants, merged, rec, session

CFG = MergeConfig(end_of_turn_ids=(EOT,))
MERGE_RERENDER = MergeConfig(end_of_turn_ids=(EOT,), on_rerender="merge")


def test_01_paper_worked_example():
    traj = merged(rec(0, [1, 2, 3], [10, 11, EOT]),
                  rec(1, [1, 2, 3, 10, 11, EOT, 50, 51], [20, 21, EOT]))
    (t,) = traj.traces
    assert t.prompt_ids == [1, 2, 3]
    assert t.response_ids == [10, 11, EOT, 50, 51, 20, 21, EOT]
    assert t.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1]
    assert t.response_logprobs[3:5] == [0.0, 0.0]  # synthetic slots
    assert traj.diagnostics["completions_merged"] == 1 and traj.diagnostics["breaks"] == {}


def test_02_length_stopped_turn_bridges_from_the_rendered_end_of_turn():
    traj = merged(rec(0, [1, 2, 3], [10, 11], finish_reason="length"),
                  rec(1, [1, 2, 3, 10, 11, EOT, 50], [20, EOT]))
    (t,) = traj.traces
    assert t.response_ids == [10, 11, EOT, 50, 20, EOT]
    assert t.loss_mask == [1, 1, 0, 0, 1, 1]  # the end-of-turn token was not sampled


def test_03_drift_breaks_by_default():
    records = (rec(0, [1, 2, 3], [10, 11, EOT]), rec(1, [1, 2, 3, 10, 12, EOT, 50], [20, EOT]))
    traj = merged(*records)
    assert len(traj.traces) == 2 and traj.diagnostics["breaks"] == {"drift": 1}
    assert traj.traces[1].prompt_ids == [1, 2, 3, 10, 12, EOT, 50]  # trained in its true context


def test_04_drift_merged_as_in_the_paper_when_asked():
    traj = merged(rec(0, [1, 2, 3], [10, 11, EOT]), rec(1, [1, 2, 3, 10, 12, EOT, 50], [20, EOT]),
                  config=MERGE_RERENDER)
    (t,) = traj.traces
    assert t.response_ids == [10, 11, EOT, 50, 20, EOT] and t.loss_mask == [1, 1, 1, 0, 1, 1]
    assert traj.diagnostics["rerender_merged"] == 1


def test_05_thinking_dropped_by_the_template():
    think = [7, 30, 8]  # <think> ... </think>
    records = (rec(0, [1, 2, 3], [*think, 10, 11, EOT]), rec(1, [1, 2, 3, 10, 11, EOT, 50], [20, EOT]))
    assert merged(*records).diagnostics["breaks"] == {"thinking_dropped": 1}
    (t,) = merged(*records, config=MERGE_RERENDER).traces
    assert t.response_ids == [*think, 10, 11, EOT, 50, 20, EOT]
    assert t.loss_mask == [1, 1, 1, 1, 1, 1, 0, 1, 1]


def test_06_several_end_of_turn_tokens():
    cfg = MergeConfig(end_of_turn_ids=(98, EOT))
    traj = merged(rec(0, [1], [10, 98]), rec(1, [1, 10, 98, 50], [11, 12], finish_reason="length"),
                  rec(2, [1, 10, 98, 50, 11, 12, EOT, 51], [13, EOT]), config=cfg)
    (t,) = traj.traces
    assert t.response_ids == [10, 98, 50, 11, 12, EOT, 51, 13, EOT]
    assert t.loss_mask == [1, 1, 0, 1, 1, 0, 0, 1, 1]


def test_07_compaction_starts_a_complete_new_chain():
    traj = merged(rec(0, [1, 2, 3, 4], [10, EOT]), rec(1, [1, 2, 3, 4, 10, EOT, 50], [11, EOT]),
                  rec(2, [1, 2, 3, 60, 61], [12, EOT]),  # system prompt kept, history replaced by a summary
                  rec(3, [1, 2, 3, 60, 61, 12, EOT, 52], [13, EOT]))
    assert [len(t.metadata["completion_ids"]) for t in traj.traces] == [2, 2]
    assert traj.diagnostics["breaks"] == {"compaction": 1}
    assert traj.traces[1].metadata["chain_cause"] == "compaction"


def test_08_interleaved_sub_agent_gets_its_own_chain():
    traj = merged(rec(0, [1, 2], [10, EOT]),
                  rec(1, [200, 201], [30, EOT]),  # sub-agent, own system prompt
                  rec(2, [1, 2, 10, EOT, 50], [11, EOT]),  # main agent continues meanwhile
                  rec(3, [200, 201, 30, EOT, 55], [31, EOT]),
                  rec(4, [1, 2, 10, EOT, 50, 11, EOT, 51], [12, EOT]))
    main, sub = traj.traces
    assert main.metadata["completion_ids"] == ["c0", "c2", "c4"]
    assert sub.metadata["completion_ids"] == ["c1", "c3"]
    assert traj.diagnostics["breaks"] == {"new_context": 1}


def test_09_parallel_sub_agents_from_one_prompt_are_never_cross_wired():
    traj = merged(rec(0, [5, 6], [30, EOT], started=0, seconds=5),
                  rec(1, [5, 6], [31, EOT], started=1, seconds=5),  # overlaps: a parallel twin, not a retry
                  rec(2, [5, 6, 31, EOT, 40], [32, EOT], started=7),  # continues the second twin
                  rec(3, [5, 6, 30, EOT, 41], [33, EOT], started=8))  # continues the first
    a, b = traj.traces
    assert a.metadata["completion_ids"] == ["c0", "c3"] and b.metadata["completion_ids"] == ["c1", "c2"]
    assert a.response_ids == [30, EOT, 41, 33, EOT] and b.response_ids == [31, EOT, 40, 32, EOT]
    assert traj.diagnostics["breaks"] == {"fork": 1}


def test_10_retry_replaces_the_discarded_answer_and_keeps_the_rest():
    p2 = [1, 10, EOT, 50]
    records = (rec(0, [1], [10, EOT]), rec(1, p2, [20, EOT], started=10, seconds=2),
               rec(2, p2, [21, EOT], started=15),  # the harness retried after the first answer came back
               rec(3, [*p2, 21, EOT, 51], [22, EOT], started=20))
    traj = merged(*records)
    (t,) = traj.traces
    assert t.metadata["completion_ids"] == ["c0", "c2", "c3"]
    assert t.response_ids == [10, EOT, 50, 21, EOT, 51, 22, EOT]
    assert traj.diagnostics["superseded"] == ["c1"]
    kept = merged(*records, config=MergeConfig(end_of_turn_ids=(EOT,), keep_superseded=True))
    assert kept.traces[-1].metadata["superseded"] is True and kept.traces[-1].response_ids == [20, EOT]


def test_11_retry_of_a_first_call():
    traj = merged(rec(0, [1, 2], [10, EOT], started=0, seconds=1), rec(1, [1, 2], [11, EOT], started=3),
                  rec(2, [1, 2, 11, EOT, 50], [12, EOT], started=6))
    (t,) = traj.traces
    assert t.metadata["completion_ids"] == ["c1", "c2"] and traj.diagnostics["superseded"] == ["c0"]


def test_12_empty_and_single():
    assert merged().traces == [] and merged().diagnostics["chains"] == 0
    (t,) = merged(rec(0, [1], [10, EOT])).traces
    assert t.loss_mask == [1, 1]


def test_13_errors_and_unfaithful_records_are_reported_not_trained():
    traj = merged(rec(0, [1], [10, EOT]), rec(1, [1, 10, EOT, 50], [], status="error", error="boom"),
                  rec(2, [1, 10, EOT, 50], [11, EOT], token_faithful=False),
                  rec(3, [1, 10, EOT, 50], [12, EOT]))
    assert traj.diagnostics["excluded"] == {"error": ["c1"], "not_token_faithful": ["c2"]}
    (t,) = traj.traces
    assert t.metadata["completion_ids"] == ["c0", "c3"]


def test_14_message_key_rules_out_a_false_token_match():
    sys_msg = {"role": "system", "content": "s"}
    traj = merged(rec(0, [1, 2], [10, EOT], messages=[sys_msg, {"role": "user", "content": "a"}]),
                  rec(1, [1, 2, 10, EOT, 50], [11, EOT], messages=[sys_msg, {"role": "user", "content": "OTHER"}]))
    assert len(traj.traces) == 2 and traj.diagnostics["rejected_candidates"] == {"message_mismatch": 1}


def test_15_policy_version_spans():
    traj = merged(rec(0, [1], [10, EOT], policy_version=3), rec(1, [1, 10, EOT, 50], [11, EOT], policy_version=4))
    (t,) = traj.traces
    assert [(s["start"], s["end"], s["policy_version"]) for s in t.metadata["spans"]] == [(0, 2, 3), (3, 5, 4)]
    assert t.metadata["policy_versions"] == [3, 4]


def test_16_per_request_is_lossless():
    records = (rec(0, [1, 2, 3], [10, 11, EOT]), rec(1, [1, 2, 3, 10, 11, EOT, 50, 51], [20, 21, EOT]))
    sess = session(*records)
    traj = per_request(sess, CFG)
    check_invariants(sess, traj)
    assert [(t.prompt_ids, t.response_ids) for t in traj.traces] == [(r.prompt_ids, r.response_ids)
                                                                      for r in records]
    assert all(set(t.loss_mask) == {1} for t in traj.traces)


def test_17_messages_and_tools_are_kept():
    msgs0 = [{"role": "user", "content": "go"}]
    msgs1 = [*msgs0, {"role": "assistant", "content": "reply 0"}, {"role": "tool", "content": "out"}]
    r0, r1 = rec(0, [1], [10, EOT], messages=msgs0), rec(1, [1, 10, EOT, 50], [11, EOT], messages=msgs1)
    r0.normalized_request["tools"] = [{"type": "function", "function": {"name": "bash"}}]
    (t,) = merged(r0, r1).traces
    assert t.prompt_messages == msgs0 and t.tools[0]["function"]["name"] == "bash"
    assert t.response_messages == [msgs1[1], msgs1[2], {"role": "assistant", "content": "reply 1"}]


@pytest.mark.parametrize(("a", "b", "n"), [([], [1], 0), ([1, 2, 3], [1, 2, 4], 2), ([5] * 100, [5] * 100, 100),
                                           ([1, 2], [3], 0)])
def test_common_prefix_len(a, b, n):
    assert common_prefix_len(a, b) == n


def test_18_two_conversations_from_one_prompt_the_second_after_the_first_answered():
    # two sequential sub-agents with the same task prompt: the second starts once the first has answered
    records = (rec(0, [5, 6], [30, EOT], started=0, seconds=1),
               rec(1, [5, 6], [31, EOT], started=2, seconds=1),  # not a retry: the first answer is used below
               rec(2, [5, 6, 30, EOT, 40], [32, EOT], started=4),  # the first conversation goes on
               rec(3, [5, 6, 31, EOT, 41], [33, EOT], started=6))  # so does the second
    for config in (CFG, MERGE_RERENDER):
        traj = merged(*records, config=config)
        assert sorted(t.metadata["completion_ids"] for t in traj.traces) == [["c0", "c2"], ["c1", "c3"]]
        assert traj.diagnostics["superseded"] == [] and traj.diagnostics["breaks"] == {"fork": 1}
        assert traj.diagnostics["rerender_merged"] == 0  # no turn trained after a reply it never saw


def test_19_two_conversations_from_one_prompt_drifted_replies_stay_apart():
    records = (rec(0, [5, 6], [30, 31, EOT], started=0, seconds=1),
               rec(1, [5, 6], [32, 33, EOT], started=2, seconds=1),
               rec(2, [5, 6, 30, 12, EOT, 40], [34, EOT], started=4),  # the first reply, re-tokenized
               rec(3, [5, 6, 32, 33, EOT, 41], [35, EOT], started=6))
    traj = merged(*records, config=MERGE_RERENDER)
    assert sorted(t.metadata["completion_ids"] for t in traj.traces) == [["c0", "c2"], ["c1", "c3"]]
    assert traj.diagnostics["superseded"] == []


def test_20_retry_sent_while_the_first_attempt_still_ran_supersedes_it():
    p2 = [1, 10, EOT, 50]
    records = (rec(0, [1], [10, EOT], started=0),
               rec(2, p2, [21, EOT], started=15, seconds=2),  # the retry, sent when the client timed out
               rec(3, [*p2, 21, EOT, 51], [22, EOT], started=18),  # the conversation goes on with the retry
               rec(4, p2, [20, EOT], started=10, seconds=30))  # the abandoned attempt finishes (journaled) last
    traj = merged(*records)
    (t,) = traj.traces
    assert t.metadata["completion_ids"] == ["c0", "c2", "c3"]
    assert traj.diagnostics["superseded"] == ["c4"] and traj.diagnostics["breaks"] == {}


def test_21_retry_of_a_first_call_while_it_still_ran():
    traj = merged(rec(1, [1, 2], [11, EOT], started=5, seconds=1),
                  rec(2, [1, 2, 11, EOT, 50], [12, EOT], started=7),
                  rec(3, [1, 2], [10, EOT], started=0, seconds=20))  # abandoned after a 5 s client timeout
    (t,) = traj.traces
    assert t.metadata["completion_ids"] == ["c1", "c2"] and traj.diagnostics["superseded"] == ["c3"]
    assert traj.diagnostics["breaks"] == {}


def test_22_a_record_without_logprobs_makes_its_trace_say_so():
    traj = merged(rec(0, [1], [10, EOT]), rec(1, [1, 10, EOT, 50], [11, EOT], response_logprobs=[]),
                  rec(2, [200], [30, EOT]))
    with_none, full = traj.traces
    assert with_none.response_logprobs == [] and with_none.metadata["has_logprobs"] is False
    assert with_none.metadata["without_logprobs"] == ["c1"]
    assert full.metadata["has_logprobs"] is True and len(full.response_logprobs) == 2
    assert traj.diagnostics["traces_without_logprobs"] == 1
    assert traj.diagnostics["completions_without_logprobs"] == ["c1"]
    flat = per_request(session(rec(0, [1], [10, EOT], response_logprobs=[])), CFG)
    assert flat.traces[0].response_logprobs == [] and flat.diagnostics["traces_without_logprobs"] == 1


def test_23_finding_a_chain_does_not_visit_the_chains_drift_left_behind(monkeypatch):
    import polar_gym.merge.prefix_merging as pm

    calls = 0
    real = pm._candidate

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(pm, "_candidate", counting)
    records, prompt = [], [1, 2, 3]
    for k in range(60):
        reply = [100 + k, 101 + k, EOT]
        records.append(rec(k, prompt, reply))
        shown = [100 + k, 7, EOT] if k % 2 else reply  # every other reply drifts in the next prompt
        prompt = [*prompt, *shown, 50]
    traj = merged(*records)
    assert traj.diagnostics["breaks"] == {"drift": 29} and len(traj.traces) == 30
    assert calls <= 2 * len(records)  # about one candidate per completion, whatever the number of chains


def test_24_a_reply_whose_tool_call_could_not_be_parsed_is_flagged_in_its_trace():
    """The proxy answered a malformed sampled tool call as text: the trace names that span, so a trainer can mask
    or zero it, and the diagnostics list it."""
    bad = rec(1, [1, 10, EOT, 50], [11, 12, EOT]).model_copy(update={"unparseable_tool_calls": 2})
    traj = merged(rec(0, [1], [10, EOT]), bad)
    (t,) = traj.traces
    assert t.metadata["unparseable_tool_calls"] == ["c1"]
    assert [s.get("unparseable_tool_calls", 0) for s in t.metadata["spans"]] == [0, 2]
    assert traj.diagnostics["completions_with_unparseable_tool_calls"] == ["c1"]
    clean = merged(rec(0, [1], [10, EOT]))
    assert "unparseable_tool_calls" not in clean.traces[0].metadata
    assert per_request(session(bad), CFG).traces[0].metadata["unparseable_tool_calls"] == ["c1"]
