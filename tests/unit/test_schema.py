"""The wire types: the paper's appendix examples validate, and bad input fails with a field-addressed error."""

from __future__ import annotations

import pydantic
import pytest

from polar_gym.schema import (
    CompletionRecord,
    SessionResult,
    SessionSpec,
    SessionStatus,
    TaskRequest,
    Trace,
    Trajectory,
)

# Shape of the Polar paper's appendix A.3 TaskRequest example.
TASK_REQUEST = {
    "task_id": "django__django-11099",
    "instruction": "Fix the failing test in the repository.",
    "num_samples": 4,
    "timeout_seconds": 1800,
    "runtime": {
        "backend": "apptainer",
        "image": "swebench/sweb.eval.x86_64.django_1776_django-11099:latest",
        "network": "none",
        "workdir": "/testbed",
        "prepare": [
            {"type": "exec", "command": "git config --global user.email polar@example.com"},
            {"type": "upload_file", "src": "/data/hints.md", "dst": "/testbed/HINTS.md"},
            {"type": "upload_dir", "src": "/data/skills", "dst": "/root/.claude/skills"},
        ],
    },
    "agent": {"harness": "claude_code", "model_name": "policy"},
    "builder": {"strategy": "prefix_merging"},
    "evaluator": {
        "strategy": "swebench_harness",
        "refresh_runtime": True,
        "config": {"repo_dir": "/testbed", "patch_command": "git diff HEAD", "instance": {"instance_id": "x"}},
    },
    "callback_url": "http://trainer:9000/rollouts",
    "metadata": {"group_id": "step-12-task-3", "policy_version": 12, "rollout_step": 12},
}

# Shape of the appendix A.4 Trace example.
TRACE = {
    "prompt_ids": [1, 2, 3],
    "response_ids": [10, 11, 99, 50, 51, 20, 21, 99],
    "loss_mask": [1, 1, 1, 0, 0, 1, 1, 1],
    "response_logprobs": [{"token": "a", "token_id": t, "logprob": -0.1} for t in [10, 11, 99, 50, 51, 20, 21, 99]],
    "prompt_messages": [{"role": "user", "content": "hi"}],
    "response_messages": [{"role": "assistant", "content": "ok"}],
    "tools": [],
    "finish_reason": "stop",
    "reward": 1.0,
    "metadata": {"completion_ids": ["c1", "c2"]},
}


def test_paper_task_request_validates_and_expands_to_sessions():
    task = TaskRequest.model_validate(TASK_REQUEST)
    assert task.runtime.prepare[1].dst == "/testbed/HINTS.md"
    assert task.evaluator.config.model_extra["repo_dir"] == "/testbed"
    sessions = [SessionSpec.from_task(task, i) for i in range(task.num_samples)]
    assert len({s.session_id for s in sessions}) == 4
    assert all(s.metadata.policy_version == 12 for s in sessions)


def test_paper_trace_validates_and_round_trips_json():
    trace = Trace.model_validate(TRACE)
    again = Trace.model_validate_json(trace.model_dump_json())
    assert again == trace
    trajectory = Trajectory(session_id="s", traces=[trace], builder="prefix_merging")
    result = SessionResult(session_id="s", task_id="t", status=SessionStatus.COMPLETED, trajectory=trajectory)
    assert SessionResult.model_validate_json(result.model_dump_json()).trajectory.traces[0].reward == 1.0


@pytest.mark.parametrize(("change", "where"), [
    ({"num_samples": 0}, "num_samples"),
    ({"agent": {}}, "agent.harness"),
    ({"runtime": {"network": "internet"}}, "runtime.network"),
    ({"runtime": {"prepare": [{"type": "exec"}]}}, "runtime.prepare.0"),
    ({"unknown_field": 1}, "unknown_field"),
])
def test_bad_task_requests_name_the_field(change, where):
    with pytest.raises(pydantic.ValidationError) as info:
        TaskRequest.model_validate({**TASK_REQUEST, **change})
    assert where in str(info.value)


def test_trace_logprobs_are_floats_in_python_and_the_papers_shape_on_the_wire():
    trace = Trace.model_validate(TRACE)
    assert trace.response_logprobs == [-0.1] * 8
    wire = trace.model_dump(mode="json")["response_logprobs"]
    assert wire[3] == {"token": None, "token_id": 50, "logprob": -0.1}
    assert Trace.model_validate({**TRACE, "response_logprobs": [-0.1] * 8}) == trace
    with pytest.raises(pydantic.ValidationError, match="token_id"):
        Trace.model_validate({**TRACE, "response_logprobs": [{"token_id": 7, "logprob": 0.0}] * 8})


def test_trace_rejects_misaligned_logprobs_and_masks():
    with pytest.raises(pydantic.ValidationError, match="loss_mask"):
        Trace.model_validate({**TRACE, "loss_mask": [1]})
    with pytest.raises(pydantic.ValidationError, match="response_logprobs"):
        Trace.model_validate({**TRACE, "response_logprobs": TRACE["response_logprobs"][:2]})
    with pytest.raises(pydantic.ValidationError, match="only 0 and 1"):
        Trace.model_validate({**TRACE, "loss_mask": [2] * 8})


def test_completion_record_requires_aligned_logprobs():
    with pytest.raises(pydantic.ValidationError, match="align"):
        CompletionRecord(completion_id="c", session_id="s", index=0, provider="openai_chat", engine="vllm",
                         response_ids=[1, 2], response_logprobs=[-0.1])


def test_terminal_statuses():
    assert SessionStatus.TIMEOUT.terminal and not SessionStatus.RUNNING.terminal


def test_setting_a_records_fields_at_once_is_assigning_each():
    """``CompletionRecord.set_fields`` leaves the record as assigning each field would: the same values, the same
    fields counted as set (what ``exclude_unset`` dumps), and a name the record lacks refused."""
    from polar_gym.schema import CompletionRecord

    def fresh() -> CompletionRecord:
        return CompletionRecord(completion_id="c", session_id="s", index=0, provider="openai_chat", engine="vllm",
                                started_at=1.0)

    values = {"prompt_ids": [1, 2], "response_ids": [3], "response_logprobs": [-0.5], "finish_reason": "stop",
              "server": "http://x", "upstream_seconds": 0.25}
    at_once, one_by_one = fresh(), fresh()
    at_once.set_fields(values)
    for name, value in values.items():
        setattr(one_by_one, name, value)
    assert at_once == one_by_one
    assert at_once.model_fields_set == one_by_one.model_fields_set
    assert at_once.model_dump(exclude_unset=True) == one_by_one.model_dump(exclude_unset=True)
    with pytest.raises(AttributeError, match="no field 'promt_ids'"):
        fresh().set_fields({"promt_ids": [1]})
