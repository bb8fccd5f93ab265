"""benchmarks/scale_model.py, bench_scale's pure part: the sessions it asks for and the numbers it reads back."""

from __future__ import annotations

import random

from benchmarks.scale_model import Plan, analyse, draw_plan, make_task, refill_latencies, slot_series, use_stats
from polar_gym.schema import SessionSpec


def _row(sid: str, gw: str, created: float, running: float, postrun: float, done: float) -> dict[str, object]:
    return {"session_id": sid, "task_id": f"scale-{sid}", "status": "COMPLETED", "gateway": gw, "attempts": 1,
            "created": created, "dispatched": created + 0.1, "finished": done, "init_at": created + 0.1,
            "running_at": running, "postrun_at": postrun, "done_at": done, "timings": {"run": postrun - running},
            "plan": {"init": 1.0, "turns": 10, "run": 50.0, "evaluate": 2.0}, "completions": 4}


#: one gateway, one run slot, three sessions submitted at 0: a runs 1-3, b 3.5-5 (a slot idle 0.5 s while b waited),
#: c 5-6 (refilled at once); nothing is queued after 5
ROWS = [_row("a", "gw", 0.0, 1.0, 3.0, 3.2), _row("b", "gw", 0.0, 3.5, 5.0, 5.2), _row("c", "gw", 0.0, 5.0, 6.0, 6.5)]


def test_a_plan_becomes_a_valid_task_whose_commands_play_its_scaled_run_time() -> None:
    rng = random.Random(3)
    plans = [draw_plan(rng) for _ in range(200)]
    assert all(5 <= p.turns <= 150 and p.run > 0 and p.init > 0 and p.evaluate > 0 for p in plans)
    plan = Plan(init=10.0, turns=40, run=200.0, evaluate=20.0)
    task = make_task(7, plan, 0.01, 5, rng, "http://127.0.0.1:9/callback")
    commands = task.metadata.model_dump()["oracle"]["commands"]
    assert len(commands) == 4 and abs(sum(float(c.split()[1]) for c in commands) - 2.0) < 0.01
    assert task.runtime.prepare[0].command == "sleep 0.100"
    assert task.evaluator.config.model_dump()["command"] == "sleep 0.200"
    SessionSpec.from_task(task, 0)  # a session the gateway accepts
    one_call = make_task(8, plan, 0.01, 1, rng, None)
    assert one_call.metadata.model_dump()["oracle"]["commands"] == []


def test_slot_use_counts_running_harnesses_and_what_was_queued() -> None:
    series = slot_series(ROWS, {"gw": 1}, 0.5)
    busy = {p["t"]: p["busy"]["gw"] for p in series}
    assert busy[0.0] == 0 and busy[1.0] == 1 and busy[3.0] == 0 and busy[3.5] == 1 and busy[5.5] == 1
    assert [p["backlog"] for p in series if p["t"] in (0.0, 3.0, 5.5)] == [3, 2, 0]
    use = use_stats(series, {"gw": 1})
    assert use["makespan"]["mean"] == sum(busy.values()) / len(busy)
    assert use["while_queued"]["p10"] == 0.0  # the idle start and the gap at 3.0-3.5 were while work waited
    assert refill_latencies(ROWS) == [0.5, 0.0]  # a's slot after 0.5 s, b's at once; c's freed with nothing queued


def test_the_ideal_makespan_is_the_run_work_over_the_slots() -> None:
    summary, series = analyse(ROWS, {"gw": 1}, 0.01, 0.5)
    assert summary["run_work_s"] == 2.0 + 1.5 + 1.0 and summary["ideal_makespan_s"] == 4.5
    assert summary["makespan_s"] == 6.5 and summary["makespan_ratio"] == 6.5 / 4.5
    assert summary["latency"]["submitted_to_running"]["p50_ms"] == 3500.0
    assert summary["model_calls"] == 12 and summary["real_turns_per_session"] == 10
    assert series
