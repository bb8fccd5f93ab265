"""The cause word of a session and whether its harness failed, as the launch and the report read them."""

from __future__ import annotations

from pathlib import Path

from polar_gym.causes import INFRA_CAUSES, error_cause, harness_failed, stderr_tail
from polar_gym.schema import SessionResult, SessionStatus


def test_an_infrastructure_cause_named_only_in_the_reason_counts() -> None:
    result = SessionResult(session_id="s", task_id="t", status=SessionStatus.ERROR,
                           reason="upstream_timeout: the engine did not answer in 600 s")
    assert error_cause(result) == "upstream_timeout" and "upstream_timeout" in INFRA_CAUSES


def test_harness_failed_and_its_stderr(tmp_path: Path) -> None:
    assert harness_failed({}) is None and harness_failed({"harness": {"status": "ok", "exit_code": 0}}) is None
    assert harness_failed({"harness": {"status": "completed"}}) is None
    assert harness_failed({"harness": {"status": "ok", "exit_code": 3}}) == ("ok", 3)
    assert harness_failed({"harness": {"status": "timeout", "exit_code": None}}) == ("timeout", None)
    assert stderr_tail({}) == "" and stderr_tail({"session_dir": str(tmp_path / "gone")}) == ""
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "harness.stderr").write_bytes(b"a" * 100 + b"\xff end")
    assert stderr_tail({"session_dir": str(tmp_path)}, tail_bytes=5) == "\ufffd end"


def test_a_failed_harness_stderr_travels_with_its_result(tmp_path: Path) -> None:
    """A session dir on a node's scratch is gone (or unreadable) where the report is written: the tail the result
    carries is used."""
    shipped = {"session_dir": str(tmp_path / "on-the-node"), "artifacts": {"harness_stderr_tail": "boom\nno key"}}
    assert stderr_tail(shipped) == "boom\nno key" and stderr_tail(shipped, tail_bytes=6) == "no key"
    assert stderr_tail({"artifacts": {"harness_stderr_tail": "x"}}) == "x"
