"""SessionTracer on made-up sessions (the launch tests run the real gateway): the stage intervals of a status
history, a failed session's status and cause, a failed model call's error, and odd input that makes no spans."""

from __future__ import annotations

from pathlib import Path

from polar_gym.schema import CompletionRecord, EvalResult, SessionResult, SessionStatus
from polar_gym.telemetry import SessionTracer, TelemetrySettings, stage_intervals
from tests.telemetry._readers import file_spans

T0 = 1_700_000_000.0
HISTORY = [{"status": s, "at": T0 + i} for i, s in enumerate(
    ["REGISTERED", "INITIALIZING", "READY", "RUNNING", "POST_RUN", "BUILDING", "EVALUATING", "ERROR"])]


def test_stage_intervals_of_a_history() -> None:
    assert stage_intervals(HISTORY) == [("queued", T0, T0 + 1), ("init", T0 + 1, T0 + 2), ("ready", T0 + 2, T0 + 3),
                                        ("run", T0 + 3, T0 + 4), ("postrun", T0 + 4, T0 + 7),
                                        ("build", T0 + 5, T0 + 6), ("evaluate", T0 + 6, T0 + 7)]
    cancelled_early = [{"status": "REGISTERED", "at": T0}, {"status": "CANCELLED", "at": T0 + 2}]
    assert stage_intervals(cancelled_early) == [("queued", T0, T0 + 2)]
    assert stage_intervals([]) == []


def _record(index: int, **extra: object) -> CompletionRecord:
    fields: dict[str, object] = {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "response_logprobs": [-0.1, -0.2],
                                 "finish_reason": "stop", **extra}
    return CompletionRecord.model_validate({
        "completion_id": f"c{index}", "session_id": "s1", "index": index, "provider": "anthropic", "engine": "vllm",
        "model": "policy", "path": "/v1/messages", "policy_version": 7, "started_at": T0 + 3.1 + index * 0.3,
        "total_seconds": 0.2, **fields})


def test_a_failed_session_and_a_failed_call(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    tracer = SessionTracer(TelemetrySettings(file=str(path), resource={"polar_gym.launch_id": "L"}))
    result = SessionResult(session_id="s1", task_id="t1", status=SessionStatus.ERROR,
                           reason="upstream_unreachable: the engine did not answer",
                           evaluation=EvalResult(reward=0.0), metadata={"status_history": HISTORY,
                                                                       "artifacts": {"error_cause":
                                                                                     "upstream_unreachable"}})
    failed = _record(1, status="error", error="UpstreamUnreachable: connection refused", token_faithful=False,
                     prompt_ids=[], response_ids=[], response_logprobs=[])
    tracer.session(result, harness="claude_code", records=[_record(0), failed], teardown_seconds=0.5)
    tracer.session(result.model_copy(update={"metadata": {}}), harness="x")  # no history: no spans
    tracer.close()
    tracer.close()  # a second stop does nothing
    spans = {s.name if s.name != "chat policy" else s.attributes["polar_gym.completion_id"]: s
             for s in file_spans(path)}
    assert sorted(spans) == ["build", "c0", "c1", "evaluate", "init", "postrun", "queued", "ready", "run", "session"]
    root = spans["session"]
    assert root.status == "ERROR" and root.resource["polar_gym.launch_id"] == "L"
    assert root.attributes["polar_gym.cause"] == "upstream_unreachable"
    assert root.attributes["polar_gym.reward"] == 0.0 and root.attributes["polar_gym.harness"] == "claude_code"
    assert root.end - root.start == 7_500_000_000  # through teardown
    assert spans["c0"].parent_id == spans["run"].span_id and spans["c0"].status == "UNSET"
    assert spans["c0"].attributes["polar_gym.policy_version"] == "7"
    assert spans["c0"].attributes["gen_ai.usage.input_tokens"] == 3
    assert spans["c1"].status == "ERROR" and spans["c1"].attributes["error.type"] == "UpstreamUnreachable"
    assert spans["build"].parent_id == spans["postrun"].span_id


def test_a_timeout_without_an_artifact_cause_is_named_by_its_status(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    tracer = SessionTracer(TelemetrySettings(file=str(path)))
    history = [*HISTORY[:4], {"status": "TIMEOUT", "at": T0 + 9}]
    for status, reason in ((SessionStatus.TIMEOUT, "killed at the deadline"), (SessionStatus.ERROR, "init: boom")):
        tracer.session(SessionResult(session_id=f"s-{status.value}", task_id="t", status=status, reason=reason,
                                     metadata={"status_history": history}), harness="pi")
    tracer.close()
    causes = sorted(s.attributes["polar_gym.cause"] for s in file_spans(path) if s.name == "session")
    assert causes == ["init_failed", "timeout"]
