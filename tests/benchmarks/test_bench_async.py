"""benchmarks/bench_async.py's pure parts on synthetic rows: when an arm reaches bench_learning's thresholds, the
acceptance lines (ratio against the 0.7 target, staleness bound, pinning), the staleness plot's points and the files
the summary writes. No engine, no fleet."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests._benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("bench_async")


def _rows(shares: list[float], p_rights: list[float], seconds: list[float],
          staleness: list[list[int]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [{"step": 0, "eval/share_right": 0.5, "eval/p_right": 0.48, "wall_seconds": 10.0}]
    for i, (share, p, t, ages) in enumerate(zip(shares, p_rights, seconds, staleness, strict=True), start=1):
        rows.append({"step": i, "eval/share_right": share, "eval/p_right": p, "wall_seconds": t, "trained": True,
                     "reward_mean": share, "staleness/per_sample": ages, "staleness/max": max(ages),
                     "stale_groups_dropped": 0})
    return rows


def _run(bench: ModuleType, name: str, staleness: int, rows: list[dict[str, Any]],
         affinity: dict[str, list[str]] | None = None) -> Any:
    return bench.ArmRun(bench.ArmSpec(name, staleness), rows, float(rows[-1]["wall_seconds"]),
                        affinity if affinity is not None else {"engine": ["0"], "trainer": ["1"], "loop": ["1"],
                                                               "harness": ["1"]},
                        0.8)


def test_the_threshold_row_needs_both_the_share_and_the_rise_of_p_right(bench: ModuleType) -> None:
    # step 1: share passes but P(right) rose only 0.12; step 2: both; step 3 later
    rows = _rows([0.9, 0.9, 0.95], [0.60, 0.70, 0.80], [100.0, 200.0, 300.0], [[0], [0], [0]])
    hit = bench.threshold_row(rows)
    assert hit is not None and hit["step"] == 2 and hit["wall_seconds"] == 200.0
    assert bench.threshold_row(rows[:2]) is None
    assert bench.threshold_row(rows[1:]) is None  # no step 0: no starting P(right) to rise from


def test_acceptance_passes_a_fast_enough_async_arm_and_fails_a_slow_one(bench: ModuleType) -> None:
    sync = _run(bench, "sync", 0, _rows([0.7, 0.9], [0.6, 0.8], [100.0, 200.0], [[0, 0], [0, 0]]))
    fast = _run(bench, "async", 1, _rows([0.7, 0.9], [0.6, 0.8], [70.0, 130.0], [[0, 1], [1, 1]]))
    checks = bench.acceptance({"sync": sync, "async": fast}, "0", "1", judge_learning=True)
    assert all(c.passed for c in checks), [c.text for c in checks if not c.passed]
    ratio = next(c for c in checks if c.text.startswith("async / sync"))
    assert "= 0.65 <= 0.7" in ratio.text
    slow = _run(bench, "async", 1, _rows([0.7, 0.9], [0.6, 0.8], [90.0, 150.0], [[0, 1], [1, 1]]))
    failed = [c for c in bench.acceptance({"sync": sync, "async": slow}, "0", "1", judge_learning=True)
              if not c.passed]
    assert [c.text.split(":")[0] for c in failed] == ["async / sync wall time to the thresholds"]


def test_acceptance_fails_staleness_past_the_bound_and_pinning_that_did_not_hold(bench: ModuleType) -> None:
    sync = _run(bench, "sync", 0, _rows([0.9], [0.8], [100.0], [[0, 0]]),
                affinity={"engine": ["0", "0-1"], "trainer": ["1"]})
    stale = _run(bench, "async", 1, _rows([0.9], [0.8], [60.0], [[0, 2]]))
    failed = {c.text.split(":")[0] for c in bench.acceptance({"sync": sync, "async": stale}, "0", "1",
                                                             judge_learning=True) if not c.passed}
    assert failed == {"async", "pinning"}


@pytest.mark.parametrize(("threads", "held"), [(["0"], True), (["0", "1"], True), (["0-1"], False)])
def test_with_the_sessions_on_the_engines_cpu_only_the_trainers_threads_may_use_its_own(
        bench: ModuleType, threads: list[str], held: bool) -> None:
    """--rollout-cpus 0: the event loop and the sessions on CPU 0; other threads of the process on CPU 0, or on
    CPU 1 when the trainer's thread started them (they inherit its CPUs); none may float over both."""
    affinity = {"engine": ["0"], "trainer": ["1"], "loop": ["0"], "harness": ["0"], "threads": threads}
    run = _run(bench, "sync", 0, _rows([0.9], [0.8], [100.0], [[0]]), affinity=affinity)
    pinning = next(c for c in bench.acceptance({"sync": run}, "0", "1", judge_learning=True, rollout_cpus="0")
                   if c.text.startswith("pinning"))
    assert pinning.passed is held, pinning.text
    moved = {**affinity, "loop": ["1"]}  # the event loop on the trainer's CPU: not the layout asked for
    run = _run(bench, "sync", 0, _rows([0.9], [0.8], [100.0], [[0]]), affinity=moved)
    assert not next(c for c in bench.acceptance({"sync": run}, "0", "1", judge_learning=True, rollout_cpus="0")
                    if c.text.startswith("pinning")).passed


def test_quick_mode_shows_the_learning_lines_without_judging_them(bench: ModuleType) -> None:
    runs = {"sync": _run(bench, "sync", 0, _rows([0.6], [0.5], [100.0], [[0]])),
            "async": _run(bench, "async", 1, _rows([0.6], [0.5], [80.0], [[1]]))}
    checks = bench.acceptance(runs, "0", "1", judge_learning=False)
    unjudged = [c for c in checks if not c.judged]
    assert len(unjudged) == 3 and not any(c.passed for c in unjudged)  # two arms not reached, no ratio
    assert all(c.passed for c in checks if c.judged)  # staleness within bounds, pinning held


def test_staleness_points_and_cpu_lists(bench: ModuleType) -> None:
    rows = _rows([0.6, 0.7], [0.5, 0.6], [1.0, 2.0], [[0, 1], [1]])
    assert bench.staleness_points(rows) == [(1, 0), (1, 1), (2, 1)]
    assert bench.cpu_list({0, 1, 2, 5}) == "0-2,5" and bench.cpu_list({1}) == "1"


def test_the_outputs_carry_each_arm_its_steps_and_the_figure(bench: ModuleType, tmp_path: Path) -> None:
    runs = {"sync": _run(bench, "sync", 0, _rows([0.7, 0.9], [0.6, 0.8], [100.0, 200.0], [[0, 0], [0, 0]])),
            "async": _run(bench, "async", 1, _rows([0.7, 0.9], [0.6, 0.8], [70.0, 130.0], [[0, 1], [1, 1]]))}
    checks = bench.acceptance(runs, "0", "1", judge_learning=True)
    lines = bench.write_outputs(tmp_path, "header", runs, checks, ["a note"])
    assert lines[0] == "header" and "a note" in lines
    assert (tmp_path / "summary.md").read_text().splitlines() == lines
    steps = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [(r["arm"], r["step"]) for r in steps] == [("sync", 0), ("sync", 1), ("sync", 2), ("async", 0),
                                                      ("async", 1), ("async", 2)]
    accepted = json.loads((tmp_path / "acceptance.json").read_text())
    assert accepted["arms"]["async"]["threshold_seconds"] == 130.0
    assert accepted["arms"]["sync"]["threshold_step"] == 2
    assert all(c["passed"] for c in accepted["checks"])
    figure = (tmp_path / "async.svg").read_text()
    assert figure.startswith("<svg") and "staleness per trained sample" in figure
    assert (tmp_path / "learning.svg").read_text().startswith("<svg")


def test_the_machines_busy_share_is_read_from_proc_stat(bench: ModuleType) -> None:
    before = bench.machine_ticks()
    sum(i * i for i in range(300_000))  # some work of this process between the readings
    after = bench.machine_ticks()
    busy = bench.machine_busy(before, after)
    assert after[1] >= before[1] and after[0] >= before[0]
    assert busy is None or 0.0 <= busy <= 1.0
    assert bench.machine_busy((10, 100), (60, 200)) == 0.5 and bench.machine_busy((1, 5), (1, 5)) is None
