"""ATIF export (polar_gym.merge.atif): steps from the normalized messages, tool calls paired with their outputs,
reasoning, the exact token IDs and logprobs of every sampled completion, every chain kept as an embedded sub-agent
trajectory with a reference that resolves, errored sessions, and hostile content. Every document is read back with
the `atif` package's own models."""

from __future__ import annotations

from typing import Any

import atif
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_gym.merge.atif import ATIF_SCHEMA_VERSION, atif_json, atif_trajectory
from polar_gym.merge.base import MergeConfig
from polar_gym.merge.per_request import per_request
from polar_gym.merge.prefix_merging import prefix_merging
from polar_gym.schema import CompletionRecord, EvalResult, SessionResult, SessionStatus, Trajectory
from tests.merge._sessions import EOT, check_invariants, rec, session

CFG = MergeConfig(end_of_turn_ids=(EOT,))
SYSTEM = {"role": "system", "content": "You are a coder."}
USER = {"role": "user", "content": "Fix calc.py."}
SUB_SYSTEM = {"role": "system", "content": "You are a searcher."}


def call(call_id: str | None, name: str = "bash", arguments: Any = '{"command": "ls"}') -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def asked(*calls: dict[str, Any], content: Any = "", reasoning: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": list(calls)}
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def output(call_id: str | None, content: Any) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def said(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def answered(record: CompletionRecord, message: dict[str, Any]) -> CompletionRecord:
    return record.model_copy(update={"response": {"message": message}})


def reread(source: Trajectory | SessionResult, **options: Any) -> atif.Trajectory:
    """Export, serialize as the CLI does, and validate with the atif package's models."""
    doc = atif_json(source, **options)
    return atif.Trajectory.model_validate_json(orjson.dumps(doc))


def build(*records: CompletionRecord, builder=prefix_merging) -> Trajectory:
    sess = session(*records)
    traj = builder(sess, CFG)
    check_invariants(sess, traj)
    return traj


CALL_LS = asked(call("call_ls"), reasoning="Look first.")
CALL_TASK = asked(call("call_task", "task", {"prompt": "find the bug"}), call("call_cat", arguments='{"command": '
                                                                                                   '"cat calc.py"}'))
# a main agent: ls, then a task delegated to a sub-agent next to a cat, then the answer
MAIN_AND_SUB = (
    answered(rec(0, [1, 2, 3], [10, 11, EOT], messages=[SYSTEM, USER]), CALL_LS),
    answered(rec(1, [1, 2, 3, 10, 11, EOT, 50], [12, 13, EOT],
                 messages=[SYSTEM, USER, CALL_LS, output("call_ls", "calc.py")]), CALL_TASK),
    answered(rec(2, [200, 201], [30, EOT], messages=[SUB_SYSTEM, {"role": "user", "content": "find the bug"}]),
             said("the bug is on line 3")),
    answered(rec(3, [1, 2, 3, 10, 11, EOT, 50, 12, 13, EOT, 51, 52], [20, EOT],
                 messages=[SYSTEM, USER, CALL_LS, output("call_ls", "calc.py"), CALL_TASK,
                           output("call_task", "Sub-agent: the bug is on line 3"), output("call_cat", "def add")]),
             said("Fixed.")),
)


def test_steps_follow_the_messages_and_carry_each_completions_tokens():
    traj = build(*MAIN_AND_SUB)
    doc = reread(traj)
    assert doc.schema_version == ATIF_SCHEMA_VERSION == "ATIF-v1.8" and doc.session_id == "s"
    assert [(s.source, s.step_id) for s in doc.steps] == [("system", 1), ("user", 2), ("agent", 3), ("agent", 4),
                                                          ("agent", 5)]
    first, second, last = doc.steps[2:]
    assert first.reasoning_content == "Look first." and first.message == ""
    assert first.metrics is not None and first.metrics.completion_token_ids == [10, 11, EOT]
    assert first.metrics.prompt_token_ids == [1, 2, 3] and first.metrics.prompt_tokens == 3
    assert first.metrics.logprobs == MAIN_AND_SUB[0].response_logprobs
    assert second.metrics is not None and second.metrics.prompt_token_ids == MAIN_AND_SUB[1].prompt_ids
    assert last.message == "Fixed." and last.metrics is not None and last.metrics.completion_token_ids == [20, EOT]
    assert last.metrics.extra == {"completion_id": "c3", "chain": 0, "response_start": 9, "response_end": 11}
    assert all(s.llm_call_count == 1 and not s.is_copied_context for s in (first, second, last))
    assert doc.final_metrics is not None and doc.final_metrics.total_steps == 5
    assert doc.final_metrics.total_completion_tokens == 3 + 3 + 2
    assert doc.final_metrics.total_prompt_tokens == 3 + 7 + 12


def test_tool_calls_are_paired_with_their_outputs():
    doc = reread(build(*MAIN_AND_SUB))
    ls, task = doc.steps[2], doc.steps[3]
    assert ls.tool_calls == [atif.ToolCall(tool_call_id="call_ls", function_name="bash", arguments={"command": "ls"})]
    assert ls.observation is not None and [(r.source_call_id, r.content) for r in ls.observation.results] == [
        ("call_ls", "calc.py")]
    assert [c.arguments for c in task.tool_calls or []] == [{"prompt": "find the bug"}, {"command": "cat calc.py"}]
    assert task.observation is not None
    assert [(r.source_call_id, r.content) for r in task.observation.results] == [
        ("call_task", "Sub-agent: the bug is on line 3"), ("call_cat", "def add")]


def test_every_chain_is_an_embedded_trajectory_referenced_from_the_step_that_delegated():
    doc = reread(build(*MAIN_AND_SUB))
    (sub,) = doc.subagent_trajectories or []
    assert sub.trajectory_id == "s/chain-1" and sub.extra == {"chain_cause": "new_context", "trace_index": 1,
                                                             "finish_reason": "stop", "has_logprobs": True}
    assert [s.source for s in sub.steps] == ["system", "user", "agent"]
    assert sub.steps[2].metrics is not None and sub.steps[2].metrics.completion_token_ids == [30, EOT]
    task = doc.steps[3].observation
    assert task is not None
    delegated = {r.source_call_id: r.subagent_trajectory_ref for r in task.results}
    # the reference sits on the call whose output holds the sub-agent's answer, not on its sibling
    assert delegated["call_cat"] is None and delegated["call_task"] is not None
    assert [ref.trajectory_id for ref in delegated["call_task"]] == ["s/chain-1"]


def test_a_compaction_chain_and_a_side_request_are_kept_and_every_reference_resolves():
    title = answered(rec(0, [300], [40, EOT], messages=[{"role": "user", "content": "Title?"}]), said("Calc fix"))
    main = [r.model_copy(update={"index": r.index + 1, "completion_id": f"c{r.index + 1}"}) for r in MAIN_AND_SUB]
    compacted = answered(rec(5, [1, 2, 3, 60, 61], [23, EOT], messages=[SYSTEM, {"role": "user", "content":
                                                                                "Summary: fixed."}]), said("Done."))
    records = [title.model_copy(update={"side_request": True}), *main, compacted]
    traj = build(*records)
    assert [t.metadata["chain_cause"] for t in traj.traces] == ["first", "new_context", "new_context", "compaction"]
    doc = reread(traj)
    assert doc.extra is not None and doc.extra["trace_index"] == 1  # the main conversation, not the title request
    subs = {s.trajectory_id: s for s in doc.subagent_trajectories or []}
    assert set(subs) == {"s/chain-0", "s/chain-2", "s/chain-3"}
    refs = [ref for step in doc.steps for r in (step.observation.results if step.observation else [])
            for ref in r.subagent_trajectory_ref or []]
    assert sorted(ref.trajectory_id or "" for ref in refs) == sorted(subs)
    causes = {ref.trajectory_id: (ref.extra or {}).get("chain_cause") for ref in refs}
    assert causes == {"s/chain-0": "first", "s/chain-2": "new_context", "s/chain-3": "compaction"}
    assert subs["s/chain-0"].extra and subs["s/chain-0"].extra["side_request"] is True
    # every sampled completion of the session is an agent step somewhere in the document
    sampled = [s.metrics.extra["completion_id"] for d in [doc, *subs.values()] for s in d.steps
               if s.metrics and s.metrics.extra]
    assert sorted(sampled) == sorted(r.completion_id for r in records)


def test_history_a_chain_did_not_sample_is_marked_as_copied_context():
    """A fork re-sends the earlier chain's turn: its assistant step carries no metrics and says it is a copy."""
    records = [answered(rec(0, [1, 2], [10, EOT], messages=[SYSTEM, USER]), CALL_LS),
               answered(rec(1, [1, 2, 10, EOT, 50], [20, EOT],
                            messages=[SYSTEM, USER, CALL_LS, output("call_ls", "a")]), said("one")),
               answered(rec(2, [7, 8, 9, 10, 11], [21, EOT], messages=[SYSTEM, USER, CALL_LS, output("call_ls", "b")]),
                        said("two"))]
    doc = reread(build(*records))
    (other,) = doc.subagent_trajectories or []
    copied = [s for s in other.steps if s.source == "agent" and s.is_copied_context]
    assert len(copied) == 1 and copied[0].metrics is None and copied[0].tool_calls
    assert copied[0].observation is not None and copied[0].observation.results[0].content == "b"


def test_per_request_traces_export_too():
    doc = reread(build(*MAIN_AND_SUB, builder=per_request))
    assert len(doc.subagent_trajectories or []) == 3
    assert doc.extra is not None and doc.extra["builder"] == "per_request"


def test_session_outcome_and_the_harness_go_with_the_document():
    traj = build(*MAIN_AND_SUB)
    result = SessionResult(session_id="s", task_id="task-7", status=SessionStatus.COMPLETED, trajectory=traj,
                           evaluation=EvalResult(reward=1.0, passed=True))
    doc = reread(result, agent_name="claude_code", agent_version="2.1.197", model_name="policy")
    assert (doc.agent.name, doc.agent.version, doc.agent.model_name) == ("claude_code", "2.1.197", "policy")
    assert doc.agent.tool_definitions is None  # the session sent no tools
    assert doc.extra is not None and (doc.extra["task_id"], doc.extra["reward"], doc.extra["passed"],
                                      doc.extra["status"]) == ("task-7", 1.0, True, "COMPLETED")


def test_an_errored_session_exports_its_reason_and_what_it_captured():
    empty = SessionResult(session_id="e", task_id="t", status=SessionStatus.ERROR, reason="sandbox failed to start")
    doc = reread(empty)
    assert doc.steps == [] and doc.notes == "session ERROR: sandbox failed to start"
    assert doc.extra is not None and doc.extra["status"] == "ERROR" and doc.extra["traces"] == 0
    failed = rec(1, [1, 2, 3, 10, 11, EOT, 50], [], status="error", error="upstream 500")
    partial = SessionResult(session_id="s", task_id="t", status=SessionStatus.TIMEOUT, reason="deadline",
                            trajectory=build(MAIN_AND_SUB[0], failed))
    doc = reread(partial)
    assert [s.source for s in doc.steps] == ["system", "user", "agent"]
    assert doc.extra is not None and doc.extra["diagnostics"]["excluded"] == {"error": ["c1"]}
    assert doc.extra["status"] == "TIMEOUT" and doc.extra["reason"] == "deadline"


def test_prompt_ids_can_be_left_out_and_missing_logprobs_stay_missing():
    records = [r.model_copy(update={"response_logprobs": []}) for r in MAIN_AND_SUB[:2]]
    doc = reread(build(*records), prompt_token_ids=False)
    metrics = [s.metrics for s in doc.steps if s.metrics]
    assert len(metrics) == 2 and all(m.prompt_token_ids is None and m.logprobs is None for m in metrics)
    assert [m.completion_token_ids for m in metrics] == [[10, 11, EOT], [12, 13, EOT]]
    assert doc.extra is not None and doc.extra["has_logprobs"] is False


PNG = "data:image/png;base64," + "iVBORw0KGgo" * 10
HOSTILE_OUTPUTS = [
    ("huge", "x" * 5_000_000, "x" * 5_000_000),
    ("unicode", "日本語 🙂 مرحبا e\u0301 \x00 \u2028", "日本語 🙂 مرحبا e\u0301 \x00 \u2028"),
    ("text parts", [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "ab"),
    ("json object", {"exit_code": 0, "stdout": "ok"}, '{"exit_code": 0, "stdout": "ok"}'),
    ("number", 42, "42"),
    ("nothing", None, ""),
]


@pytest.mark.parametrize(("kind", "content", "expected"), HOSTILE_OUTPUTS, ids=[h[0] for h in HOSTILE_OUTPUTS])
def test_hostile_tool_outputs(kind, content, expected):
    records = [answered(rec(0, [1, 2], [10, EOT], messages=[SYSTEM, USER]), CALL_LS),
               answered(rec(1, [1, 2, 10, EOT, 50], [20, EOT],
                            messages=[SYSTEM, USER, CALL_LS, output("call_ls", content)]), said("ok"))]
    doc = reread(build(*records))
    observation = doc.steps[2].observation
    assert observation is not None and observation.results[0].content == expected, kind


def test_images_in_tool_output_become_image_parts():
    content = [{"type": "text", "text": "screenshot:"}, {"type": "image_url", "image_url": {"url": PNG}},
               {"type": "image_url", "image_url": {"url": "https://example.com/a.webp?x=1"}},
               {"type": "image_url", "image_url": {"url": "https://example.com/unknown"}}]
    records = [answered(rec(0, [1, 2], [10, EOT], messages=[SYSTEM, USER]), CALL_LS),
               answered(rec(1, [1, 2, 10, EOT, 50], [20, EOT],
                            messages=[SYSTEM, USER, CALL_LS, output("call_ls", content)]), said("ok"))]
    doc = reread(build(*records))
    assert doc.has_multimodal_content()
    observation = doc.steps[2].observation
    assert observation is not None
    parts = observation.results[0].content
    assert isinstance(parts, list) and [p.type for p in parts] == ["text", "image", "image", "text"]
    assert parts[1].source is not None and parts[1].source.media_type == "image/png" and parts[1].source.path == PNG
    assert parts[2].source is not None and parts[2].source.media_type == "image/webp"
    assert parts[3].text is not None and "https://example.com/unknown" in parts[3].text  # no media type: kept as text


def test_hostile_tool_calls_and_unpaired_outputs():
    odd = asked(call(None, "edit", "not json {"), call("c-list", "run", "[1, 2]"), call("c-empty", "noop", ""),
                content=[{"type": "text", "text": "Trying "}, {"type": "text", "text": "things."}])
    orphans = [output("orphan", "before any call"), output(None, "and another")]
    records = [answered(rec(0, [1, 2], [10, EOT], messages=[SYSTEM, *orphans, USER]), odd),
               answered(rec(1, [1, 2, 10, EOT, 50], [20, EOT], messages=[SYSTEM, *orphans, USER, odd,
                                      output("c-list", "ran"), output("not-a-call", "stray")]), said("ok"))]
    doc = reread(build(*records))
    assert [s.source for s in doc.steps] == ["system", "system", "user", "agent", "agent"]
    orphan = doc.steps[1]
    assert orphan.extra == {"orphan_tool_results": True} and orphan.observation is not None
    assert [(r.source_call_id, r.content, r.extra) for r in orphan.observation.results] == [
        (None, "before any call", {"tool_call_id": "orphan"}), (None, "and another", None)]
    step = doc.steps[3]
    assert step.message == "Trying things."
    calls = step.tool_calls or []
    assert [(c.tool_call_id, c.arguments, c.extra) for c in calls] == [
        ("call-4-0", {}, {"raw_arguments": "not json {"}), ("c-list", {}, {"raw_arguments": "[1, 2]"}),
        ("c-empty", {}, None)]
    assert step.observation is not None
    assert [(r.source_call_id, r.extra) for r in step.observation.results] == [
        ("c-list", None), (None, {"tool_call_id": "not-a-call"})]


def test_a_bare_trajectory_needs_no_session_result():
    doc = atif_trajectory(Trajectory(session_id="nothing"))
    assert doc.steps == [] and doc.agent.name == "unknown" and doc.trajectory_id == "nothing"
    atif.Trajectory.model_validate(doc.to_json_dict())


SCALARS = st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=20)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                         max_size=3), max_leaves=8)
PARTS = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)})
                 | st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries(
                     {"url": st.sampled_from([PNG, "https://x.test/a.gif", "data:text/plain,hi", "nope"])})})
                 | JSON, max_size=3)
CALLS = st.lists(st.fixed_dictionaries({"id": st.none() | st.sampled_from(["a", "b", "c"]),
                                        "function": st.fixed_dictionaries({"name": st.text(max_size=8),
                                                                           "arguments": JSON | st.text(max_size=20)})}),
                 max_size=3)
MESSAGES = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "narrator"]),
                           "content": st.text(max_size=20) | PARTS | JSON}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.text(max_size=20) | PARTS | st.none(),
                           "reasoning_content": st.none() | st.text(max_size=20) | JSON, "tool_calls": CALLS}),
    st.fixed_dictionaries({"role": st.sampled_from(["tool", "function"]),
                           "tool_call_id": st.none() | st.sampled_from(["a", "b", "zz"]),
                           "content": st.text(max_size=20) | PARTS | JSON})), max_size=8)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(MESSAGES, MESSAGES)
def test_any_messages_export_to_a_valid_document_that_loses_no_tool_output(first, reply):
    """Whatever a harness sent (roles, content and call shapes a parser never promised), the document validates,
    every tool output is an observation result and every message a step or a result."""
    records = [answered(rec(0, [1, 2], [10, EOT], messages=first), {"role": "assistant", "content": "x"}),
               answered(rec(1, [3], [20, EOT], messages=reply), {"role": "assistant", "content": "y"})]
    doc = reread(build(*records, builder=per_request))
    for trajectory, messages in zip([doc, *(doc.subagent_trajectories or [])], [first, reply], strict=True):
        tools = sum(m["role"] in ("tool", "function") for m in messages)
        results = [r for step in trajectory.steps for r in (step.observation.results if step.observation else [])
                   if r.content is not None]  # not a result holding only a reference to another chain
        assert len(results) == tools
        orphans = sum(1 for step in trajectory.steps if step.extra == {"orphan_tool_results": True})
        assert len(trajectory.steps) == len(messages) + 1 - tools + orphans  # + the reply
