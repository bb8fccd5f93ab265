"""Self-sizing pools (``pool_sizing: auto``): the pure plan from stage means and limits, Pool.resize, the node
following a workload whose stage times change mid-run within a runtime budget. (The rollout server taking a
gateway's new dispatch capacity from its heartbeat: tests/server/test_parts.py.)"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from polar_gym.gateway import GatewayConfig, GatewayNode
from polar_gym.gateway.pools import Pool
from polar_gym.gateway.sizing import NodePressure, PoolPlanner, Sizes, StageWindow, plan_pools
from polar_gym.schema import AgentSpec, SessionSpec, SessionStatus
from tests.gateway._gw_doubles import ScriptedStages

START = Sizes(init_workers=4, ready_buffer=4, postrun_workers=4)
NONE = NodePressure()


def _plan(means: dict[str, float | None], *, current: Sizes = START, max_runtimes: int | None = None,
          pressure: NodePressure = NONE, run_slots: int = 8) -> Any:
    return plan_pools(means, run_slots, current, max_runtimes=max_runtimes, pressure=pressure,
                      memory_reserve_mb=1024, disk_reserve_mb=2048)


def test_before_init_and_run_are_measured_the_configured_sizes_stand() -> None:
    plan = _plan({"init": 3.0, "run": None, "build": None, "evaluate": None})
    assert (plan.init_workers, plan.ready_buffer, plan.postrun_workers) == (4, 4, 4)
    assert "warming up" in plan.reason and plan.limited_by is None


def test_the_sizes_follow_littles_law_with_headroom() -> None:
    """8 run slots of 10 s take 0.8 sessions a second: INIT of 20 s needs 16 busy workers (20 with headroom),
    POSTRUN of 2 + 3 s needs 4 (5)."""
    plan = _plan({"init": 20.0, "run": 10.0, "build": 2.0, "evaluate": 3.0})
    assert (plan.init_workers, plan.ready_buffer, plan.postrun_workers) == (20, 4, 5)
    assert plan.wanted == {"init_workers": 20, "ready_buffer": 4, "postrun_workers": 5}
    assert plan.limited_by is None and plan.reason is None
    quick = _plan({"init": 0.01, "run": 10.0, "build": 0.0, "evaluate": 0.0})
    assert (quick.init_workers, quick.postrun_workers) == (1, 1)  # never below one


@pytest.mark.parametrize("max_runtimes", [11, 20, 31, 60])
def test_a_runtime_budget_is_split_by_what_each_stage_wants(max_runtimes: int) -> None:
    plan = _plan({"init": 20.0, "run": 10.0, "build": 10.0, "evaluate": 0.0}, max_runtimes=max_runtimes)
    wanted = plan.wanted  # 20 / 4 / 10
    budget = max(3, max_runtimes - 8)
    held = plan.init_workers + plan.ready_buffer + plan.postrun_workers
    if sum(wanted.values()) <= budget:
        assert plan.limited_by is None and held == sum(wanted.values())
    else:
        assert plan.limited_by == "max_runtimes" and f"max_runtimes={max_runtimes}" in plan.reason
        assert held == budget and min(plan.init_workers, plan.ready_buffer, plan.postrun_workers) >= 1
        assert plan.init_workers >= plan.postrun_workers  # INIT wants twice what POSTRUN does


@pytest.mark.parametrize(("pressure", "limit", "words"), [
    (NodePressure(memory_available_mb=500), "memory", "500 MB of memory available"),
    (NodePressure(disk_free_mb=100, memory_available_mb=9000), "disk", "100 MB free"),
])
def test_low_memory_or_disk_holds_growth_but_not_shrinking(pressure: NodePressure, limit: str, words: str) -> None:
    grow = _plan({"init": 20.0, "run": 10.0, "build": 0.1, "evaluate": 0.1}, pressure=pressure)
    assert (grow.init_workers, grow.ready_buffer, grow.postrun_workers) == (4, 4, 1)  # init held, postrun shrank
    assert grow.limited_by == limit and words in grow.reason
    assert grow.wanted["init_workers"] == 20
    shrink = _plan({"init": 1.0, "run": 10.0, "build": 0.1, "evaluate": 0.1}, pressure=pressure)
    assert shrink.limited_by is None and (shrink.init_workers, shrink.postrun_workers) == (1, 1)


def test_a_saturated_engine_is_reported_and_cleared() -> None:
    planner = PoolPlanner(run_slots=8, window=StageWindow(8))
    for _ in range(4):
        planner.observe(NodePressure(model_call_seconds=0.5, model_calls=10))
    assert planner.engine is None
    for _ in range(8):  # the window of readings fills with slow calls
        planner.observe(NodePressure(model_call_seconds=2.0, model_calls=10))
    assert planner.engine is not None and "engine saturated" in planner.engine and "0.50 s" in planner.engine
    assert planner.plan(START, NONE).engine == planner.engine
    for _ in range(8):
        planner.observe(NodePressure(model_call_seconds=0.6, model_calls=10))
    assert planner.engine is None
    planner.observe(NodePressure(model_call_seconds=None, model_calls=0))  # no calls: no news
    assert planner.engine is None


def test_the_stage_window_keeps_the_recent_samples_only() -> None:
    window = StageWindow(3)
    for seconds in (10.0, 10.0, 1.0, 1.0, 1.0, -5.0, math.nan):
        window.add("init", seconds)
    window.add("teardown", 99.0)  # not a sized stage
    assert window.mean("init") == pytest.approx(1.0) and window.count("init") == 3
    assert window.mean("run") is None


async def test_a_pool_grows_for_its_waiters_and_shrinks_as_holders_leave() -> None:
    pool = Pool("init", 1)
    await pool.acquire()
    waiters = [asyncio.create_task(pool.acquire()) for _ in range(3)]
    await asyncio.sleep(0)
    assert pool.waiting == 3
    pool.resize(3)  # two waiters get the new slots at once
    await asyncio.sleep(0)
    assert pool.busy == 3 and sum(w.done() for w in waiters) == 2
    pool.resize(1)  # nobody loses a slot; the surplus disappears as they release
    pool.release()
    pool.release()
    await asyncio.sleep(0)
    assert pool.busy == 1 and sum(w.done() for w in waiters) == 2
    pool.release()  # now at capacity: the slot passes to the last waiter
    await asyncio.sleep(0)
    assert pool.busy == 1 and all(w.done() for w in waiters)
    with pytest.raises(ValueError):
        pool.resize(-1)


def _spec(i: int, init: float, post: float) -> SessionSpec:
    return SessionSpec(session_id=f"s{i}", task_id="t", instruction="x", timeout_seconds=60,
                       agent=AgentSpec(harness="none"),
                       metadata={"durations": {"init": init, "run": 0.01, "build": 0.0, "evaluate": post}})


async def test_a_self_sizing_node_follows_a_mid_run_change_within_its_budget() -> None:
    """INIT-heavy sessions, then POSTRUN-heavy ones: the pools move from INIT to POSTRUN, the node never holds much
    more than its budget of runtimes (a shrunk pool's surplus leaves as its holders do), health says why."""
    stages = ScriptedStages()
    node = GatewayNode(stages, GatewayConfig(run_slots=2, pool_sizing="auto", max_runtimes=14))
    assert node.dispatch_capacity() <= 14
    held: list[int] = []
    sizes: list[tuple[int, int]] = []

    def sample(*_: Any) -> None:
        held.append(sum(p.busy for p in (node.init_pool, node.ready_pool, node.run_pool, node.postrun_pool)))
        sizes.append((node.init_pool.capacity, node.postrun_pool.capacity))

    node.listeners.append(sample)
    specs = [_spec(i, 0.1, 0.0) for i in range(30)] + [_spec(i, 0.0, 0.1) for i in range(30, 60)]
    results = await node.run(specs)
    assert {r.status for r in results} == {SessionStatus.COMPLETED}
    most_init = max(sizes, key=lambda s: s[0])
    assert most_init[0] > 4 and most_init[0] > most_init[1]  # the first half grew INIT past its start
    final = node.planner.last if node.planner is not None else None
    assert final is not None and final.postrun_workers > final.init_workers  # the second half moved it to POSTRUN
    assert final.changes >= 2 and final.stage_means["run"] > 0
    assert max(held) <= 14 + 2  # at most a shrink's stragglers over the budget
    health = node.health_view()
    assert health.sizing is not None and health.sizing.limited_by == "max_runtimes"
    assert health.dispatch_capacity == node.dispatch_capacity() <= 14


async def test_a_fixed_node_keeps_its_sizes() -> None:
    node = GatewayNode(ScriptedStages(), GatewayConfig(run_slots=2, init_workers=3, pool_sizing="fixed"))
    await node.run([_spec(i, 0.05, 0.0) for i in range(6)])
    assert node.planner is None and node.init_pool.capacity == 3 and node.health_view().sizing is None

