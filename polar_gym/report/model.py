"""The run report's data: one :class:`SessionRow` per session (from a results.jsonl line), and the pure numbers the
page shows: sessions by status and cause, reward per task, stage timings, run-slot use over time.

Everything here is a function of plain inputs (no files, no plotting), so a test builds rows by hand and checks the
numbers; :mod:`.files` reads a run's folder, :mod:`.figures` and :mod:`.render` draw and write the page."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from polar_gym.causes import INFRA_CAUSES
from polar_gym.merge.fidelity import Fidelity

__all__ = ["STAGES", "TIMED_STAGES", "HarnessFailureRow", "RunData", "SessionRow", "SlotUse", "StageStats",
           "TaskReward", "cause_counts", "percentile", "reward_per_task", "slot_use", "stage_intervals", "stage_stats",
           "status_counts"]

#: the stages a session passes through, as ``metadata.status_history`` names them
STAGES = ("queued", "init", "ready", "run", "postrun")
#: the stages whose durations SessionResult.timings reports and the report plots
TIMED_STAGES = ("queued", "init", "run", "postrun")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class SessionRow:
    """What the report needs of one session."""

    session_id: str
    task_id: str
    sample_index: int = 0
    harness: str = ""
    status: str = "COMPLETED"
    cause: str | None = None
    reason: str = ""
    reward: float | None = None
    traces: int = 0
    completions: int = 0
    seconds: float = 0.0
    timings: Mapping[str, float] = field(default_factory=dict)
    #: (stage, wall-clock time it was entered), in order
    history: Sequence[tuple[str, float]] = ()
    chains: int | None = None
    step: int | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> SessionRow:
        """From a results.jsonl line (a SessionResult without its trajectory, plus the launch's columns)."""
        metadata = row.get("metadata") if isinstance(row.get("metadata"), dict) else {}
        assert isinstance(metadata, dict)
        evaluation = row.get("evaluation")
        reward = _number(evaluation.get("reward")) if isinstance(evaluation, dict) else None
        history = [(str(h.get("stage") or ""), float(h["at"])) for h in metadata.get("status_history") or []
                   if isinstance(h, dict) and _number(h.get("at")) is not None]
        diagnostics = row.get("trajectory_diagnostics")
        chains = diagnostics.get("chains") if isinstance(diagnostics, dict) else None
        timings = {str(k): float(v) for k, v in (row.get("timings") or {}).items() if _number(v) is not None}
        step = row.get("step")
        return cls(session_id=str(row.get("session_id", "")), task_id=str(row.get("task_id", "")),
                   sample_index=int(metadata.get("sample_index", row.get("sample_index", 0)) or 0),
                   harness=str(row.get("harness") or ""), status=str(row.get("status", "")),
                   cause=None if row.get("error_cause") is None else str(row["error_cause"]),
                   reason=str(row.get("reason") or ""), reward=reward, traces=int(row.get("traces") or 0),
                   completions=int(row.get("completions") or 0),
                   seconds=float(row.get("seconds") or timings.get("total", 0.0)), timings=timings,
                   history=history, chains=int(chains) if isinstance(chains, int) else None,
                   step=int(step) if isinstance(step, int) else None)


@dataclass(frozen=True)
class HarnessFailureRow:
    """A session whose harness did not exit cleanly, with the end of its stderr (the agent wrote it: untrusted)."""

    session_id: str
    task_id: str
    sample_index: int
    harness: str
    status: str
    exit_code: int | None
    stderr_tail: str


@dataclass
class RunData:
    """Everything one report shows."""

    title: str
    sessions: list[SessionRow]
    fidelity: Fidelity
    config_text: str = ""
    harness_failures: list[HarnessFailureRow] = field(default_factory=list)
    wall_seconds: float | None = None
    out_dir: str = ""
    #: the training loop's train_metrics.jsonl rows, and the keys to plot from them (SFT / GRPO)
    train_rows: list[dict[str, Any]] = field(default_factory=list)
    train_keys: list[str] = field(default_factory=list)
    #: where the fidelity numbers came from, when not from the traces themselves
    fidelity_note: str = ""
    infra_causes: frozenset[str] = INFRA_CAUSES
    #: Slurm jobs the run lost (jobs.json rows whose state is ``lost: ...``: job_id, name, state, replaced_by)
    lost_jobs: list[dict[str, Any]] = field(default_factory=list)


def status_counts(sessions: Iterable[SessionRow]) -> dict[str, int]:
    """status -> sessions, most frequent first."""
    return dict(collections.Counter(s.status for s in sessions).most_common())


def cause_counts(sessions: Iterable[SessionRow]) -> dict[str, int]:
    """error cause -> sessions, most frequent first (sessions that completed cleanly have none)."""
    return dict(collections.Counter(s.cause for s in sessions if s.cause is not None).most_common())


@dataclass(frozen=True)
class TaskReward:
    task_id: str
    sessions: int
    scored: int
    mean: float | None


def reward_per_task(sessions: Iterable[SessionRow]) -> list[TaskReward]:
    """Per task (in first-seen order): its sessions, how many were scored, their mean reward."""
    by_task: dict[str, list[SessionRow]] = {}
    for s in sessions:
        by_task.setdefault(s.task_id, []).append(s)
    out = []
    for task, rows in by_task.items():
        rewards = [r.reward for r in rows if r.reward is not None]
        out.append(TaskReward(task, len(rows), len(rewards), sum(rewards) / len(rewards) if rewards else None))
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class StageStats:
    stage: str
    count: int
    p50: float
    p90: float
    max: float


def stage_stats(sessions: Iterable[SessionRow], stages: Sequence[str] = TIMED_STAGES) -> list[StageStats]:
    """p50 / p90 / max seconds of each stage over the sessions that report it."""
    rows = list(sessions)
    out = []
    for stage in stages:
        values = [s.timings[stage] for s in rows if stage in s.timings]
        if values:
            out.append(StageStats(stage, len(values), percentile(values, 50), percentile(values, 90), max(values)))
    return out


def stage_intervals(history: Sequence[tuple[str, float]]) -> list[tuple[str, float, float]]:
    """(stage, entered, left) of one session: consecutive entries of one stage merge; the last entry (the end,
    or where a session still was when its history was written) opens no interval."""
    out: list[tuple[str, float, float]] = []
    for (stage, at), (_, after) in itertools.pairwise(history):
        if out and out[-1][0] == stage and out[-1][2] == at:
            out[-1] = (stage, out[-1][1], after)
        else:
            out.append((stage, at, after))
    return out


@dataclass(frozen=True)
class SlotUse:
    """Sessions in each stage over wall time: ``counts[stage][i]`` holds from ``times[i]`` until the next time
    (seconds since ``start``, the first transition of the run)."""

    start: float
    times: list[float]
    counts: dict[str, list[int]]

    def peak(self, stage: str) -> int:
        return max(self.counts.get(stage) or [0])


def slot_use(sessions: Iterable[SessionRow], stages: Sequence[str] = STAGES) -> SlotUse:
    """From every session's status history. A session leaving a stage at the moment another enters it does not
    count twice (departures first at equal times)."""
    events: list[tuple[float, int, str]] = []
    for s in sessions:
        for stage, entered, left in stage_intervals(s.history):
            if stage in stages:
                events += [(entered, 1, stage), (left, -1, stage)]
    if not events:
        return SlotUse(0.0, [], {stage: [] for stage in stages})
    events.sort(key=lambda e: (e[0], e[1]))
    start = events[0][0]
    current = dict.fromkeys(stages, 0)
    times: list[float] = []
    counts: dict[str, list[int]] = {stage: [] for stage in stages}
    for at, delta, stage in events:
        current[stage] += delta
        t = at - start
        if times and times[-1] == t:  # one point per instant: the state after all its events
            for name in stages:
                counts[name][-1] = current[name]
        else:
            times.append(t)
            for name in stages:
                counts[name].append(current[name])
    return SlotUse(start, times, counts)
