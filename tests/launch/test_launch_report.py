"""finish() writes the report (a harness's stderr escaped), or says why it could not while keeping the run's files
and exit code. That a drifting launch's breaks show by cause in the console, summary.md and report.html is
tests/launch/test_launch_token_in.py's chat-mode launch."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from polar_gym.datagen.template import TaskTemplate
from polar_gym.fleet.settings import InferenceSettings
from polar_gym.launch import outputs
from polar_gym.launch.config import LaunchJob
from polar_gym.launch.outputs import SessionOutcome, finish
from polar_gym.launch.tasks import demo_requests
from polar_gym.schema import (
    AgentSpec,
    BuilderSpec,
    EvalResult,
    EvaluatorSpec,
    RuntimeSpec,
    SessionResult,
    SessionSpec,
    SessionStatus,
)
from polar_gym.tasks.refused import RefusedTask

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def _outcome(tmp_path: Path, status: SessionStatus, stderr: str | None = None,
             harness: dict[str, object] | None = None) -> SessionOutcome:
    request = demo_requests(TaskTemplate(agent=AgentSpec(harness="shell"), runtime=RuntimeSpec(),
                                         builder=BuilderSpec(), evaluator=EvaluatorSpec()), ids=["demo-calc-add"])[0]
    spec = SessionSpec.from_task(request, 0)
    metadata: dict[str, object] = {"harness": harness} if harness else {}
    if stderr is not None:
        (tmp_path / "s" / "artifacts").mkdir(parents=True)
        (tmp_path / "s" / "artifacts" / "harness.stderr").write_text(stderr)
        metadata["session_dir"] = str(tmp_path / "s")
    result = SessionResult(session_id=spec.session_id, task_id=spec.task_id, status=status, metadata=metadata,
                           evaluation=EvalResult(reward=0.0) if status is SessionStatus.COMPLETED else None)
    return SessionOutcome(spec, result, 1, 2.0)


def test_finish_writes_the_report_with_the_harness_failures_stderr_escaped(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("harness:\n  command: echo <b>\n")
    failed = _outcome(tmp_path, SessionStatus.COMPLETED, "oops <script>alert(1)</script>\x1b[2J",
                      {"status": "ok", "exit_code": 3})
    job = LaunchJob(requests=[], inference=InferenceSettings(), out_dir=out, resolved_config="")
    console = Console(record=True, file=io.StringIO(), width=200)
    assert finish(console, job, [failed], 1.0) == 0
    page = (out / "report.html").read_text()
    assert "Harness failures (1)" in page and "oops &lt;script&gt;alert(1)&lt;/script&gt;\ufffd[2J" in page
    assert "echo &lt;b&gt;" in page and "<script" not in page
    assert f"report: {out / 'report.html'}" in console.export_text()
    assert "Report: [report.html](report.html)" in (out / "summary.md").read_text()


def test_a_report_that_cannot_be_written_keeps_the_runs_files_and_exit_code(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object) -> Path:
        raise OSError("disk full")

    monkeypatch.setattr(outputs, "write_report_file", broken)
    job = LaunchJob(requests=[], inference=InferenceSettings(), out_dir=tmp_path / "run", resolved_config="")
    console = Console(record=True, file=io.StringIO(), width=200)
    assert finish(console, job, [_outcome(tmp_path, SessionStatus.ERROR)], 1.0) == 1
    assert "report.html was not written: OSError: disk full" in console.export_text()
    assert "Report: report.html was not written (OSError: disk full)" in (tmp_path / "run" / "summary.md").read_text()
    assert (tmp_path / "run" / "results.jsonl").exists() and not (tmp_path / "run" / "report.html").exists()


def test_a_refused_task_is_an_error_session_of_the_run_not_an_infrastructure_failure(tmp_path: Path) -> None:
    """Issue 35: a Harbor task refused at load is the task's error; the run's files and exit code say so (1, not 3)
    and name the task and the problem, beside the sessions that ran."""
    out = tmp_path / "run"
    ran = _outcome(tmp_path, SessionStatus.COMPLETED)
    request = demo_requests(TaskTemplate(agent=AgentSpec(harness="shell"), runtime=RuntimeSpec(),
                                         builder=BuilderSpec(), evaluator=EvaluatorSpec()), ids=["demo-calc-add"])[0]
    problem = "/tasks/evil: instruction.md: is a symbolic link to '/etc/shadow', which leaves the task directory"
    job = LaunchJob(requests=[request], inference=InferenceSettings(), out_dir=out, resolved_config="",
                    refused=[RefusedTask("evil", problem)])
    console = Console(record=True, file=io.StringIO(), width=300)
    assert finish(console, job, [ran], 1.0) == 1
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["task_id"], r["status"], r["error_cause"]) for r in rows] == [
        ("demo-calc-add", "COMPLETED", None), ("evil", "ERROR", "invalid_task")]
    assert rows[1]["reason"] == f"invalid_task: {problem}" and rows[1]["harness"] == "shell"
    summary = (out / "summary.md").read_text()
    assert "| evil | 0 | shell | ERROR | - |" in summary and f"(ERROR): invalid_task: {problem}" in summary
    assert "| invalid_task | 1 |" in summary and "infrastructure" not in summary
    text = console.export_text()
    assert "invalid_task: 1 session(s), e.g. /tasks/evil: instruction.md" in text
    assert "infrastructure reasons" not in text
    assert "evil" in (out / "report.html").read_text() and "invalid_task" in (out / "report.html").read_text()
