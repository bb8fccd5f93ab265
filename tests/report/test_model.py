"""The report's numbers from constructed sessions: counts by status and cause, reward per task, stage timing
statistics, run-slot use over wall time from the status histories."""

from __future__ import annotations

import pytest

from polar_gym.report.model import (
    SessionRow,
    cause_counts,
    percentile,
    reward_per_task,
    slot_use,
    stage_intervals,
    stage_stats,
    status_counts,
)
from tests.report._synthetic import row


def rows(*lines: dict) -> list[SessionRow]:
    return [SessionRow.from_row(line) for line in lines]


def test_counts_by_status_and_cause() -> None:
    sessions = rows(row("a", "t1"), row("b", "t1"), row("c", "t2", status="ERROR", reward=None,
                                                          cause="upstream_unreachable"),
                    row("d", "t2", status="ERROR", reward=None, cause="upstream_unreachable"),
                    row("e", "t3", status="TIMEOUT", reward=0.0, cause="timeout"))
    assert status_counts(sessions) == {"COMPLETED": 2, "ERROR": 2, "TIMEOUT": 1}
    assert cause_counts(sessions) == {"upstream_unreachable": 2, "timeout": 1}
    assert list(status_counts(sessions)) == ["COMPLETED", "ERROR", "TIMEOUT"]  # most frequent first


def test_reward_per_task_skips_unscored_sessions() -> None:
    sessions = rows(row("a", "t1", reward=1.0), row("b", "t1", reward=0.0), row("c", "t1", status="ERROR",
                                                                                  reward=None),
                    row("d", "t2", status="ERROR", reward=None))
    (t1, t2) = reward_per_task(sessions)
    assert (t1.task_id, t1.sessions, t1.scored, t1.mean) == ("t1", 3, 2, 0.5)
    assert (t2.task_id, t2.sessions, t2.scored, t2.mean) == ("t2", 1, 0, None)


def test_stage_stats_p50_p90_max() -> None:
    sessions = rows(*(row(str(i), "t", stages=(0.0, 0.1, float(i), 1.0)) for i in range(1, 11)))
    run = next(s for s in stage_stats(sessions) if s.stage == "run")
    assert (run.count, run.p50, run.max) == (10, 5.5, 10.0)
    assert run.p90 == pytest.approx(9.1)
    assert [s.stage for s in stage_stats(sessions)] == ["queued", "init", "run", "postrun"]
    assert percentile([3.0], 90) == 3.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_two_overlapping_sessions_fill_two_run_slots() -> None:
    a = row("a", "t", start=0.0, stages=(0.0, 1.0, 10.0, 1.0))  # runs 1..11
    b = row("b", "t", start=5.0, stages=(0.0, 1.0, 10.0, 1.0))  # runs 6..16
    use = slot_use(rows(a, b))
    assert use.peak("run") == 2 and use.start == 0.0
    at = dict(zip(use.times, use.counts["run"], strict=True))
    assert at[1.0] == 1 and at[6.0] == 2 and at[11.0] == 1 and at[16.0] == 0
    assert use.peak("postrun") == 1


def test_a_session_leaving_a_stage_as_another_enters_does_not_count_twice() -> None:
    a = row("a", "t", start=0.0, stages=(0.0, 0.0, 5.0, 1.0))  # runs 0..5
    b = row("b", "t", start=5.0, stages=(0.0, 0.0, 5.0, 1.0))  # runs 5..10
    assert slot_use(rows(a, b)).peak("run") == 1


def test_status_history_intervals_merge_one_stage_and_skip_the_end() -> None:
    history = [("queued", 0.0), ("init", 1.0), ("postrun", 2.0), ("postrun", 3.0), ("done", 4.0)]
    assert stage_intervals(history) == [("queued", 0.0, 1.0), ("init", 1.0, 2.0), ("postrun", 2.0, 4.0)]
    assert stage_intervals([("run", 1.0)]) == []
    empty = slot_use([])
    assert empty.times == [] and empty.peak("run") == 0


def test_a_row_without_optional_fields_still_reads() -> None:
    session = SessionRow.from_row({"session_id": "s", "task_id": "t", "status": "ERROR"})
    assert (session.reward, session.cause, session.history, session.chains) == (None, None, [], None)
