"""The node's scheduling on scripted stage functions (no sandboxes): stage order, pool limits, the READY buffer,
deadline, cancellation in every stage, fault isolation, drain and stop."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import polar_gym.gateway as gateway
from polar_gym.causes import cause_of
from polar_gym.gateway import DuplicateSession, GatewayClosed, GatewayConfig, GatewayNode, Pool, UtilizationTracker
from polar_gym.gateway.session import Session
from polar_gym.runtime.errors import SandboxEnvError
from polar_gym.schema import AgentSpec, SessionResult, SessionSpec, SessionStatus
from tests._waiting import BOUND
from tests.gateway._gw_doubles import ScriptedStages

S = SessionStatus


def spec(session_id: str, timeout: float = 30, **metadata: Any) -> SessionSpec:
    return SessionSpec(session_id=session_id, task_id="t", instruction="x", timeout_seconds=timeout,
                       agent=AgentSpec(harness="none"), metadata=metadata)


def node(stages: ScriptedStages | None = None, **config: Any) -> GatewayNode:
    """A node with the pools as given (these tests are about scheduling with known sizes, not about sizing)."""
    return GatewayNode(stages or ScriptedStages(), GatewayConfig(**{"pool_sizing": "fixed", **config}))


async def wait_status(n: GatewayNode, session_id: str, status: SessionStatus, timeout: float = BOUND) -> None:
    reached = asyncio.Event()
    n.listeners.append(lambda s, st: reached.set() if (s.session_id, st) == (session_id, status) else None)
    if n.get(session_id).status is status:
        return
    await asyncio.wait_for(reached.wait(), timeout)


def statuses(result: SessionResult) -> list[str]:
    return [h["status"] for h in result.metadata["status_history"]]


def test_exports() -> None:
    for name in gateway.__all__:
        assert hasattr(gateway, name), name


async def test_a_session_walks_every_stage() -> None:
    stages = ScriptedStages(prewarm=True)
    n = node(stages)
    result = (await n.run([spec("a")]))[0]
    assert result.status is S.COMPLETED and result.reason is None
    assert statuses(result) == ["REGISTERED", "INITIALIZING", "READY", "RUNNING", "POST_RUN", "BUILDING",
                                "EVALUATING", "COMPLETED"]
    assert result.evaluation is not None and result.evaluation.details["prewarmed"] is True
    assert {"queued", "init", "ready_wait", "run", "prewarm", "build", "evaluate", "postrun", "teardown",
            "total"} <= set(result.timings)
    assert stages.teardowns == {"a": 1}
    health = n.health()
    assert health["finished"] == {"COMPLETED": 1} and health["live_sessions"] == 0
    assert health["latency_seconds"]["run"]["count"] == 1


async def test_pools_are_respected_and_ready_buffer_is_bounded() -> None:
    stages = ScriptedStages()
    n = node(stages, init_workers=3, ready_buffer=2, run_slots=2, postrun_workers=1)
    seen_running = []
    n.listeners.append(lambda s, st: seen_running.append(
        sum(1 for x in n.sessions() if x.status is S.RUNNING)))
    durations = {"init": 0.01, "run": 0.03, "build": 0.005, "evaluate": 0.005}
    results = await n.run([spec(f"s{i}", durations=durations) for i in range(12)])
    assert all(r.status is S.COMPLETED for r in results)
    assert stages.peak["run"] == 2 and max(seen_running) <= 2
    assert stages.peak["init"] <= 3 and stages.peak["build"] <= 1 and stages.peak["evaluate"] <= 1
    assert stages.peak_warm <= 3 + 2  # init slots + READY buffer
    assert n.run_pool.peak_busy == 2 and n.run_pool.busy == 0 and n.init_pool.busy == 0
    assert sorted(stages.teardowns) == sorted(f"s{i}" for i in range(12))
    assert all(c == 1 for c in stages.teardowns.values())


async def test_ready_buffer_zero_holds_the_init_slot() -> None:
    stages = ScriptedStages()
    n = node(stages, init_workers=2, ready_buffer=0, run_slots=1)
    results = await n.run([spec(f"s{i}", durations={"run": 0.02}) for i in range(5)])
    assert all(r.status is S.COMPLETED for r in results)
    assert stages.peak_warm <= 2


async def test_fault_isolation_a_failing_stage_ends_only_its_session() -> None:
    stages = ScriptedStages()
    n = node(stages, init_workers=1, run_slots=1, postrun_workers=1)
    specs = [spec("bad-init", fail="init"), spec("ok-1"), spec("bad-run", fail="run"),
             spec("bad-eval", fail="evaluate"), spec("ok-2")]
    results = {r.session_id: r for r in await n.run(specs)}
    assert results["bad-init"].status is S.ERROR and "init exploded" in (results["bad-init"].reason or "")
    assert results["bad-run"].status is S.ERROR and "run exploded" in (results["bad-run"].reason or "")
    # a failure after the harness ran keeps what was built (here: salvaged for bad-run, built for bad-eval)
    assert results["bad-run"].trajectory is not None and results["bad-eval"].trajectory is not None
    assert results["ok-1"].status is S.COMPLETED and results["ok-2"].status is S.COMPLETED
    assert all(c == 1 for c in stages.teardowns.values()) and len(stages.teardowns) == 5
    assert n.init_pool.busy == n.run_pool.busy == n.postrun_pool.busy == 0


async def test_run_past_the_deadline_still_goes_to_postrun() -> None:
    n = node(run_grace_seconds=0.05)
    result = (await n.run([spec("slow", timeout=1, hold="run")]))[0]  # the run never ends by itself
    assert result.status is S.TIMEOUT and "deadline" in (result.reason or "")
    assert "BUILDING" in statuses(result) and result.trajectory is not None


async def test_deadline_while_waiting_for_a_run_slot() -> None:
    stages = ScriptedStages()
    n = node(stages, run_slots=1, init_workers=2)
    hog = n.submit(spec("hog", hold="run"))  # holds the only run slot until the starved session is over
    await wait_status(n, "hog", S.RUNNING)
    starved = n.submit(spec("starved", timeout=1))
    result = await n.wait(starved.session_id, timeout=BOUND)
    assert result.status is S.TIMEOUT and "waiting for a run slot" in (result.reason or "")
    stages.gate("hog").set()
    assert (await n.wait(hog.session_id, timeout=BOUND)).status is S.COMPLETED


async def test_time_waiting_for_a_run_slot_is_not_taken_from_the_run() -> None:
    """A warm sandbox waiting for a run slot does not spend its session's timeout: under load, a run that fits its
    timeout timed out because the gateway's queue had eaten part of it."""
    stages, at_run = ScriptedStages(), {}
    n = node(stages, run_slots=1, init_workers=2)
    original = stages.run

    async def run(session: Session) -> None:
        at_run[session.session_id] = session.remaining()
        await original(session)

    stages.run = run  # type: ignore[method-assign]
    n.submit(spec("hog", hold="run"))
    await wait_status(n, "hog", S.RUNNING)
    waiter = n.submit(spec("waiter", timeout=30))
    await wait_status(n, "waiter", S.READY)
    await asyncio.sleep(1.0)  # the wait to be refunded: a lower bound however loaded the machine is
    stages.gate("hog").set()
    result = await n.wait(waiter.session_id, timeout=BOUND)
    assert result.status is S.COMPLETED and result.timings["ready_wait"] >= 1.0
    # without the refund it would be at most 30 - init - ready_wait
    assert at_run["waiter"] > 30 - result.timings["init"] - result.timings["ready_wait"] / 2


@pytest.mark.parametrize("where", ["queued", "init", "ready", "run", "prewarm", "postrun"])
async def test_cancel_in_every_stage(where: str) -> None:
    stages = ScriptedStages(prewarm=True)
    n = node(stages, init_workers=1, run_slots=1)
    # "hold": a session stays in that stage until cancelled (no duration to guess for a slow machine)
    blocker = n.submit(spec("blocker", hold="run" if where == "ready" else "init"))
    target_hold = {"queued": None, "init": "init", "ready": None, "run": "run", "prewarm": "prewarm",
                   "postrun": "build"}[where]
    if where in ("init", "run", "prewarm", "postrun"):
        n.cancel("blocker")
    n.submit(spec("target", hold=target_hold))
    expected = {"queued": S.REGISTERED, "init": S.INITIALIZING, "ready": S.READY, "run": S.RUNNING,
                "prewarm": S.EVALUATING, "postrun": S.BUILDING}[where]
    await wait_status(n, "target", expected)
    assert n.cancel("target")
    assert not n.cancel("target")  # already on its way out
    result = await n.wait("target", timeout=BOUND)
    stage = {"prewarm": "postrun"}.get(where, where)
    assert result.status is S.CANCELLED and f"(in {stage})" in (result.reason or "")
    assert stages.teardowns["target"] == 1
    await n.stop()
    assert stages.live_runtimes() == 0
    assert (await n.wait(blocker.session_id)).status is S.CANCELLED
    assert n.init_pool.busy == n.ready_pool.busy == n.run_pool.busy == n.postrun_pool.busy == n.prewarm_pool.busy == 0


async def test_duplicate_ids_are_refused() -> None:
    n = node()
    n.submit(spec("same"))
    with pytest.raises(DuplicateSession):
        n.submit(spec("same"))
    await n.stop()


async def test_drain_finishes_in_flight_and_refuses_new() -> None:
    stages = ScriptedStages()
    n = node(stages, run_slots=2)
    for i in range(5):
        n.submit(spec(f"d{i}", durations={"run": 0.05}))
    drain = asyncio.create_task(n.drain())
    await asyncio.sleep(0)
    with pytest.raises(GatewayClosed):
        n.submit(spec("late"))
    await drain
    assert [n.get(f"d{i}").status for i in range(5)] == [S.COMPLETED] * 5
    assert n.health()["status"] == "draining" and stages.live_runtimes() == 0


async def test_stop_cancels_everything() -> None:
    stages = ScriptedStages()
    n = node(stages, run_slots=1, init_workers=1)
    for i in range(4):
        n.submit(spec(f"x{i}", hold="run"))
    await wait_status(n, "x0", S.RUNNING)
    await n.stop()
    assert {n.get(f"x{i}").status for i in range(4)} == {S.CANCELLED}
    assert len(stages.teardowns) == 4 and stages.live_runtimes() == 0


async def test_hooks_get_every_result_and_a_failing_hook_is_harmless() -> None:
    seen: list[str] = []

    async def hook(result: SessionResult) -> None:
        seen.append(result.session_id)

    def bad(result: SessionResult) -> None:
        raise RuntimeError("hook bug")

    n = node(hooks=[bad, hook])
    await n.run([spec("h1"), spec("h2", fail="init")])
    assert sorted(seen) == ["h1", "h2"]


async def test_pool_is_fifo_and_passes_a_slot_on_when_a_waiter_is_cancelled() -> None:
    pool = Pool("p", 1)
    await pool.acquire()
    order: list[int] = []

    async def waiter(i: int) -> None:
        await pool.acquire()
        order.append(i)

    tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
    await asyncio.sleep(0)
    assert pool.waiting == 3
    tasks[0].cancel()
    pool.release()
    await asyncio.sleep(0)
    pool.release()
    await asyncio.sleep(0)
    await asyncio.gather(*tasks, return_exceptions=True)
    assert order == [1, 2] and pool.busy == 1 and pool.peak_busy == 1


def test_utilization_counts_only_while_work_is_queued() -> None:
    now = [0.0]
    tracker = UtilizationTracker(2, clock=lambda: now[0])
    tracker.change(pending=+2)
    now[0] = 1.0  # 1 s queued with nothing running
    tracker.change(running=+1, pending=-1)
    now[0] = 2.0  # 1 s queued with one of two slots busy
    tracker.change(running=+1, pending=-1)
    now[0] = 4.0  # 2 s with nothing queued, both busy
    snap = tracker.snapshot()
    assert snap["while_queued"] == pytest.approx(0.25)
    assert snap["overall"] == pytest.approx((1 + 4) / 8)


async def test_the_finished_table_is_bounded_and_keeps_only_results() -> None:
    """Fault 9 (issue 11): a long-lived node remembers at most ``max_finished`` finished sessions, and those keep
    their result, not what only a live session needs (runtimes, harness output, scratch)."""
    n = node(max_finished=5)
    results = await n.run([spec(f"f{i}") for i in range(20)])
    assert [r.status for r in results] == [S.COMPLETED] * 20
    assert {s.session_id for s in n.sessions()} == {f"f{i}" for i in range(15, 20)}
    with pytest.raises(gateway.UnknownSession):
        n.get("f0")
    for s in n.sessions():
        assert s.result is not None and s.result.metadata["attempt_id"] == s.attempt_id
        assert s.runtime is None and s.harness_result is None and s.trajectory is None and s.scratch == {}
    assert n.health()["finished"] == {"COMPLETED": 20}


async def test_every_dispatch_is_a_new_attempt() -> None:
    """Fault 8 (issue 11): the same session dispatched again (after the node forgot it) is a new attempt."""
    n = node(max_finished=1)
    first = (await n.run([spec("again")]))[0]
    await n.run([spec("other")])  # pushes "again" out of the finished table
    second = (await n.run([spec("again")]))[0]
    assert first.metadata["attempt_id"] != second.metadata["attempt_id"]
    assert n.get("again").describe()["attempt_id"] == second.metadata["attempt_id"]


async def test_stages_hear_of_each_attempt_before_submit_returns() -> None:
    """Issue 35: the journal must name a new attempt as the session's latest before its caller can read the session
    (INIT may wait for a slot; until then a restarted gateway's disk still names the dead attempt)."""
    heard: list[tuple[str, str]] = []

    class Hearing(ScriptedStages):
        def registered(self, session: gateway.Session) -> None:
            heard.append((session.session_id, session.attempt_id))

    n = node(Hearing())
    first = n.submit(spec("a"))
    assert heard == [("a", first.attempt_id)]  # no await in between: before any stage ran
    await n.wait("a")
    second = n.submit(spec("a"))  # its result was never taken: a new attempt
    assert heard[-1] == ("a", second.attempt_id) != heard[0]
    await n.wait("a")


async def test_an_env_the_sandbox_refuses_ends_the_session_as_the_tasks_fault() -> None:
    """Issue 35: a task's exec env naming what a host loader reads (refused by the runtime backend) is the task's
    fault: ERROR with cause invalid_task and the stage, not a stage failure with a traceback."""
    class Refusing(ScriptedStages):
        async def evaluate(self, session: gateway.Session) -> None:
            raise SandboxEnvError("the exec's env may not set 'LD_PRELOAD': ...")

    result = (await node(Refusing()).run([spec("a")]))[0]
    assert result.status is S.ERROR
    assert result.reason == "invalid_task: the exec's env may not set 'LD_PRELOAD': ... (in postrun)"
    assert cause_of(result.status.value, result.reason, result.metadata) == "invalid_task"
