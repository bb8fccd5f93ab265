"""Exports: Slime samples (alignment, status, masking of timeouts and errors), NeMo RL output items (prefix
contiguity, checked by the documented rule), trace lines and SFT records in OpenAI Chat shape."""

from __future__ import annotations

import orjson
import pytest
from pydantic import ValidationError

from polar_gym.merge import (
    ContiguityError,
    NemoOutputItem,
    TraceLine,
    apply_rewards,
    check_contiguity,
    nemo_item_chains,
    nemo_items,
    sft_records,
    slime_samples,
    trace_lines,
)
from polar_gym.merge.base import MergeConfig
from polar_gym.merge.exports import SlimeSample, openai_message, sample_status
from polar_gym.merge.per_request import per_request
from polar_gym.merge.prefix_merging import prefix_merging
from polar_gym.schema import EvalResult, SessionResult, SessionStatus, TaskMetadata, Trace
from tests.merge._sessions import EOT, check_invariants, rec, session

CFG = MergeConfig(end_of_turn_ids=(EOT,))
MERGE_RERENDER = MergeConfig(end_of_turn_ids=(EOT,), on_rerender="merge")

# A main agent (3 turns, the second stopped by length), an interleaved sub-agent and a compaction.
RECORDS = (
    rec(0, [1, 2, 3], [10, 11, EOT]),
    rec(1, [200, 201], [30, EOT]),
    rec(2, [1, 2, 3, 10, 11, EOT, 50, 51], [20, 21], finish_reason="length"),
    rec(3, [200, 201, 30, EOT, 55], [31, EOT]),
    rec(4, [1, 2, 3, 10, 11, EOT, 50, 51, 20, 21, EOT, 52], [22, EOT]),
    rec(5, [1, 2, 3, 60, 61], [23, EOT]),  # compaction: system prompt kept, history summarised
    rec(6, [1, 2, 3, 60, 61, 23, EOT, 53], [24, 25, EOT]),
)


def built(builder=prefix_merging, records=RECORDS, config=CFG):
    sess = session(*records)
    traj = builder(sess, config)
    check_invariants(sess, traj)
    return traj


def result(traj, status=SessionStatus.COMPLETED, **kw):
    return SessionResult(session_id=traj.session_id, task_id="task-1", status=status, trajectory=traj, **kw)


# -- Slime ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("builder", [per_request, prefix_merging])
def test_slime_samples_are_aligned(builder):
    traj = apply_rewards(built(builder), EvalResult(reward=1.0))
    samples = slime_samples(result(traj), TaskMetadata(group_id="g7"), group_index=3)
    assert len(samples) == len(traj.traces)
    for i, (s, t) in enumerate(zip(samples, traj.traces, strict=True)):
        assert s.tokens == t.prompt_ids + t.response_ids
        assert len(s.tokens) == len(t.prompt_ids) + s.response_length
        assert s.response_length == len(s.loss_mask) == len(s.rollout_log_probs) == len(t.response_ids)
        assert s.loss_mask == t.loss_mask
        assert s.rollout_log_probs == t.response_logprobs
        assert (s.group_id, s.group_index, s.index, s.reward) == ("g7", 3, i, 1.0)
        assert s.metadata["weight"] == pytest.approx(1 / len(traj.traces))
        assert s.metadata["completion_ids"] == t.metadata["completion_ids"]
        type(s).model_validate(s.model_dump())  # the construct'ed samples pass their own validator


def test_slime_status_from_the_session_and_the_finish_reason():
    traj = built(per_request)
    statuses = [s.status for s in slime_samples(result(traj))]
    assert statuses == ["truncated" if r.finish_reason == "length" else "completed" for r in RECORDS]
    assert statuses.count("truncated") == 1
    assert sample_status("COMPLETED", "stop") == ("completed", False)


@pytest.mark.parametrize("status", [SessionStatus.TIMEOUT, SessionStatus.ERROR, SessionStatus.CANCELLED])
def test_timeouts_and_errors_are_exported_fully_masked(status):
    traj = apply_rewards(built(), EvalResult(reward=0.0))
    samples = slime_samples(result(traj, status, reason="deadline reached"))
    assert len(samples) == len(traj.traces)  # nothing silently disappears
    for s, t in zip(samples, traj.traces, strict=True):
        assert s.status == "aborted" and set(s.loss_mask) == {0}
        assert s.tokens == t.prompt_ids + t.response_ids  # still aligned, just not trained
        assert s.metadata["masked"] and s.metadata["session_status"] == status.value
        assert s.metadata["reason"] == "deadline reached"


def test_slime_reward_falls_back_to_the_outcome_then_zero_and_group_from_result_metadata():
    traj = built()
    with_eval = slime_samples(result(traj, evaluation=EvalResult(reward=0.5), metadata={"group_id": "g1"}))
    assert {s.reward for s in with_eval} == {0.5} and {s.group_id for s in with_eval} == {"g1"}
    bare = slime_samples(traj)  # a bare trajectory counts as completed, no evaluation
    assert {s.reward for s in bare} == {0.0} and all(s.metadata["reward_missing"] for s in bare)
    assert {s.status for s in bare} <= {"completed", "truncated"}
    assert slime_samples(SessionResult(session_id="s", task_id="t", status=SessionStatus.ERROR)) == []


def test_slime_sample_rejects_misaligned_fields():
    with pytest.raises(ValueError, match="response_length"):
        type(slime_samples(built())[0]).model_validate(
            {"tokens": [1, 2], "response_length": 1, "reward": 0.0, "loss_mask": [1, 1],
             "rollout_log_probs": [0.0], "status": "completed"})


# -- NeMo Gym / NeMo RL -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [CFG, MERGE_RERENDER])
def test_nemo_items_of_merged_traces_are_contiguous(config):
    records = (*RECORDS, rec(7, [1, 2, 3, 60, 61, 23, EOT, 53, 24, 26, EOT, 54], [27, EOT]))  # drift at the end
    traj = built(records=records, config=config)
    chains = nemo_item_chains(traj)
    assert len(chains) == len(traj.traces) >= 3  # main, sub-agent, post-compaction (+ drift when breaking)
    for items, trace in zip(chains, traj.traces, strict=True):
        check_contiguity(items)
        check_contiguity([item.model_dump() for item in items])  # the JSON form too
        assert [i.completion_id for i in items] == trace.metadata["completion_ids"]
        assert items[0].prompt_token_ids == trace.prompt_ids
        last = items[-1]
        assert last.prompt_token_ids + last.generation_token_ids == trace.prompt_ids + trace.response_ids
    assert sum(len(c) for c in chains) == len(records)  # every completion is an item of exactly one chain


def test_nemo_items_follow_the_paper_example():
    records = (rec(0, [1, 2, 3], [10, 11, EOT]), rec(1, [1, 2, 3, 10, 11, EOT, 50, 51], [20, 21, EOT]))
    first, second = nemo_items(built(records=records).traces[0])
    assert (first.prompt_token_ids, first.generation_token_ids) == ([1, 2, 3], [10, 11, EOT])
    assert (second.prompt_token_ids, second.generation_token_ids) == ([1, 2, 3, 10, 11, EOT, 50, 51], [20, 21, EOT])
    assert (first.generation_log_probs, second.generation_log_probs) == tuple(r.response_logprobs for r in records)


def test_a_violating_list_is_caught():
    ok = NemoOutputItem(prompt_token_ids=[1, 2], generation_token_ids=[10, EOT], generation_log_probs=[-0.1, -0.2])
    dropped = NemoOutputItem(prompt_token_ids=[1, 2, 10, 50], generation_token_ids=[11],  # EOT dropped: not contiguous
                             generation_log_probs=[-0.3])
    with pytest.raises(ContiguityError, match="first difference at position 3") as info:
        check_contiguity([ok, dropped])
    assert (info.value.item, info.value.position) == (1, 3)
    short = NemoOutputItem(prompt_token_ids=[1, 2, 10], generation_token_ids=[11], generation_log_probs=[-0.3])
    with pytest.raises(ContiguityError, match="position 3"):  # a prompt shorter than what was seen
        check_contiguity([ok, short])
    with pytest.raises(ContiguityError, match="align"):
        check_contiguity([{"prompt_token_ids": [1], "generation_token_ids": [10, 11], "generation_log_probs": [0.0]}])
    # items without generation tokens (tool outputs) are skipped, as NeMo RL skips them
    check_contiguity([ok, {"type": "function_call_output", "output": "x"},
                      {"prompt_token_ids": [1, 2, 10, EOT, 50], "generation_token_ids": [11],
                       "generation_log_probs": [-0.3]}])


def test_nemo_items_of_a_trace_without_spans_use_mask_runs():
    trace = Trace(prompt_ids=[1], response_ids=[10, EOT, 50, 11, EOT], loss_mask=[1, 1, 0, 1, 1])
    items = nemo_items(trace)
    assert [i.generation_token_ids for i in items] == [[10, EOT], [11, EOT]]
    assert items[1].prompt_token_ids == [1, 10, EOT, 50]
    check_contiguity(items)


# -- trace lines and SFT ----------------------------------------------------------------------------------------------
def test_trace_lines_round_trip_as_jsonl():
    traj = built()
    lines = trace_lines(traj)
    assert [(line.session_id, line.trace_index, line.builder) for line in lines] == [
        ("s", i, "prefix_merging") for i in range(len(traj.traces))]
    for line, trace in zip(lines, traj.traces, strict=True):
        back = TraceLine.model_validate_json(orjson.dumps(line.model_dump()))
        assert back.response_ids == trace.response_ids and back.loss_mask == trace.loss_mask
        assert back.metadata["spans"] == trace.metadata["spans"]


TOOL = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
MSGS0 = [{"role": "system", "content": "You are a coder."},
         {"role": "user", "content": [{"type": "text", "text": "Fix "}, {"type": "text", "text": "it"}]}]
REPLY0 = {"role": "assistant", "content": "", "reasoning_content": "look first", "tool_calls": [CALL]}
MSGS1 = [*MSGS0, REPLY0, {"role": "tool", "tool_call_id": "call_1", "content": "a.py"}]
REPLY1 = {"role": "assistant", "content": "Fixed."}


def sft_session():
    def req(msgs):
        return {"model": "m", "messages": msgs, "tools": [TOOL]}
    first = rec(0, [1, 2], [10, EOT], normalized_request=req(MSGS0))
    second = rec(1, [1, 2, 10, EOT, 50], [11, EOT], normalized_request=req(MSGS1))
    return (first.model_copy(update={"response": {"message": REPLY0}}),
            second.model_copy(update={"response": {"message": REPLY1}}))


def test_sft_records_in_openai_chat_shape():
    evaluation = EvalResult(reward=1.0, passed=True)
    traj = apply_rewards(built(records=sft_session()), evaluation)
    (record,) = sft_records(result(traj, evaluation=evaluation), instance_id="repo__issue-1")
    assert (record.instance_id, record.task_id, record.session_id, record.reward, record.passed) == (
        "repo__issue-1", "task-1", "s", 1.0, True)
    assert [m["role"] for m in record.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert record.messages[1]["content"] == "Fix it"  # all-text parts collapse to a string
    assert record.messages[2] == {"role": "assistant", "content": "", "reasoning_content": "look first",
                                  "tool_calls": [CALL]}
    assert record.messages[3] == {"role": "tool", "content": "a.py", "tool_call_id": "call_1"}
    # tools as vLLM hands them to the chat template: name, description (null when missing), parameters
    assert record.tools == [{"type": "function", "function": {"name": "bash", "description": None,
                                                              "parameters": {"type": "object"}}}]
    assert record.metadata["num_assistant_turns"] == 2 and record.metadata["num_messages"] == 5
    (plain,) = sft_records(result(traj), include_reasoning=False)
    assert "reasoning_content" not in plain.messages[2] and plain.instance_id == "task-1"
    orjson.dumps(record.model_dump())  # serializable as one JSONL line


def test_sft_min_reward_keeps_accepted_attempts_only():
    traj = built(records=sft_session())
    assert sft_records(result(apply_rewards(traj, EvalResult(reward=0.0))), min_reward=1.0) == []
    assert len(sft_records(result(apply_rewards(traj, EvalResult(reward=1.0))), min_reward=1.0)) == 1
    assert sft_records(traj, min_reward=0.0) == []  # no reward at all is not accepted


def test_slime_sample_of_a_trace_without_logprobs_says_so():
    traj = prefix_merging(session(rec(0, [1], [10, EOT]), rec(1, [1, 10, EOT, 50], [11, EOT], response_logprobs=[]),
                                  rec(2, [200], [30, EOT])), MergeConfig(end_of_turn_ids=(EOT,)))
    none, full = slime_samples(traj)
    assert none.metadata["logprobs_missing"] is True and full.metadata["logprobs_missing"] is False
    assert full.rollout_log_probs == traj.traces[1].response_logprobs


def test_slime_and_nemo_carry_the_policy_version_of_every_span():
    """A trainer sees staleness and weights each span by the version that sampled it (issue 14)."""
    traj = built(records=(rec(0, [1, 2], [10, EOT], policy_version=3),
                          rec(1, [1, 2, 10, EOT, 50], [11, 12, EOT], policy_version=4)))
    [trace] = traj.traces
    [sample] = slime_samples(result(traj))
    assert sample.weight_versions == ["3", "4"]  # one per sampled turn, in order, as slime appends them
    assert [(s["start"], s["end"], s["policy_version"]) for s in sample.metadata["spans"]] == [(0, 2, 3), (3, 6, 4)]
    assert sample.rollout_log_probs == trace.response_logprobs
    items = nemo_items(trace)
    assert [(i.policy_version, i.logprobs_missing) for i in items] == [(3, False), (4, False)]
    assert [i.generation_log_probs for i in items] == [trace.response_logprobs[0:2], trace.response_logprobs[3:6]]
    bare = trace.model_copy(update={"response_logprobs": [], "metadata": {"policy_versions": [7]}})
    assert [(i.policy_version, i.logprobs_missing) for i in nemo_items(bare)] == [(7, True), (7, True)]
    [unversioned] = slime_samples(built(records=(rec(0, [1], [10, EOT]),)))
    assert unversioned.weight_versions == [] and unversioned.metadata["spans"][0]["policy_version"] is None


def test_slime_group_id_from_a_task_mapping():
    """A task given as a plain mapping (a dataset row) names the group; one without a group_id names none."""
    traj = built()
    assert {s.group_id for s in slime_samples(result(traj), {"group_id": 7})} == {"7"}
    assert {s.group_id for s in slime_samples(result(traj, metadata={"group_id": "g1"}), {"task_id": "t"})} == {None}


def test_slime_sample_carries_the_prompt_messages_and_a_default_weight():
    """slime's Sample has the prompt messages; a trajectory without session weights counts each trace fully."""
    traj = built(records=sft_session())
    [sample] = slime_samples(traj)
    assert sample.model_dump()["prompt"] == traj.traces[0].prompt_messages != []
    assert sample.metadata["weight"] == 1.0


def test_placeholder_logprobs_are_zeros():
    """A capture without log probs exports zeros (flagged by logprobs_missing), never values that look sampled."""
    trace = Trace(prompt_ids=[1], response_ids=[10, EOT, 50, 11, EOT], loss_mask=[1, 1, 0, 1, 1])
    [sample] = slime_samples(built(records=(rec(0, [1], [10, EOT], response_logprobs=[]),)))
    assert sample.rollout_log_probs == [0.0, 0.0] and sample.metadata["logprobs_missing"] is True
    assert [i.generation_log_probs for i in nemo_items(trace)] == [[0.0, 0.0], [0.0, 0.0]]


def test_slime_sample_validation_round_trips_and_bounds_the_response():
    """A sample read back from JSON is the same sample; an empty response or an empty prompt is valid, a response
    longer than the tokens is not; unknown fields (a typo in a hand-written record) are refused."""
    sample = slime_samples(built())[0]
    assert SlimeSample.model_validate(sample.model_dump()) == sample
    base = {"reward": 0.0, "status": "completed"}
    SlimeSample.model_validate({**base, "tokens": [1, 2], "response_length": 0, "loss_mask": [],
                                "rollout_log_probs": []})
    SlimeSample.model_validate({**base, "tokens": [1, 2], "response_length": 2, "loss_mask": [1, 1],
                                "rollout_log_probs": [0.0, 0.0]})
    with pytest.raises(ValueError, match="response_length must fit in tokens"):
        SlimeSample.model_validate({**base, "tokens": [1, 2], "response_length": 3, "loss_mask": [1, 1, 1],
                                    "rollout_log_probs": [0.0, 0.0, 0.0]})
    with pytest.raises(ValidationError, match="rewrad"):
        SlimeSample.model_validate({**sample.model_dump(), "rewrad": 1.0})


def test_nemo_item_read_from_json_without_the_flag_has_real_logprobs():
    item = NemoOutputItem.model_validate({"prompt_token_ids": [1], "generation_token_ids": [10],
                                          "generation_log_probs": [-0.5]})
    assert item.logprobs_missing is False and item.policy_version is None


def test_contiguity_error_message_is_the_explanation():
    ok = NemoOutputItem(prompt_token_ids=[1, 2], generation_token_ids=[10], generation_log_probs=[-0.1])
    bad = NemoOutputItem(prompt_token_ids=[1, 3], generation_token_ids=[11], generation_log_probs=[-0.1])
    with pytest.raises(ContiguityError) as info:
        check_contiguity([ok, bad])
    assert str(info.value) == ("item 1: prompt_token_ids (2 tokens) do not start with the 3 tokens seen before it; "
                               "first difference at position 1")


def test_openai_message_content_shapes_and_reasoning_by_default():
    """Text parts collapse to a string, a part list with an image stays parts, a tool-call turn's null content
    stays null; reasoning is kept unless asked otherwise."""
    image = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "data:x"}}]
    assert openai_message({"role": "user", "content": image})["content"] == image
    assert openai_message({"role": "assistant", "content": None, "tool_calls": [CALL]}) == {
        "role": "assistant", "content": None, "tool_calls": [CALL]}
    assert openai_message(REPLY0)["reasoning_content"] == "look first"
