"""The gateway end to end with real sandboxes: the local (bubblewrap) runtime in network mode "gateway", the oracle
engine, and a curl harness calling the proxy through the relay. Every test ends with a /proc scan for its marker."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from polar_gym.schema import PrepareAction, SessionStatus
from tests._procs import processes_with
from tests._waiting import BOUND, until
from tests.gateway._gateway_kit import LiveGateway, MakeGateway, no_processes_with

S = SessionStatus


async def wait_status(gw: LiveGateway, session_id: str, status: SessionStatus, timeout: float = BOUND) -> None:
    reached = asyncio.Event()
    gw.node.listeners.append(lambda s, st: reached.set() if (s.session_id, st) == (session_id, status) else None)
    if gw.node.get(session_id).status is not status:
        await asyncio.wait_for(reached.wait(), timeout)


async def wait_running(gw: LiveGateway, command: str) -> None:
    """Until a process of this test's sandboxes runs ``command`` (found on the host by the test's marker)."""
    await until(lambda: any(command in line.split(": ", 1)[1] for line in processes_with(gw.marker)),
                what=f"{command!r} to run in a sandbox")


async def test_a_session_goes_through_every_stage_to_completed(make_gateway: MakeGateway) -> None:
    gw = await make_gateway()
    spec = gw.spec("full", calls=2, prepare=[PrepareAction(type="exec", command="echo prepared > prepared.txt")],
                   oracle={"commands": ["ls -la"], "final_answer": "fine"})
    result = (await gw.node.run([spec]))[0]
    assert result.status is S.COMPLETED, result.reason
    history = [h["status"] for h in result.metadata["status_history"]]
    assert history == ["REGISTERED", "INITIALIZING", "READY", "RUNNING", "POST_RUN", "BUILDING", "EVALUATING",
                       "COMPLETED"]
    traj = result.trajectory
    assert traj is not None and len(traj.traces) == 2  # per_request: one trace per model call
    assert all(t.reward == 1.0 and sum(t.loss_mask) > 0 for t in traj.traces)
    assert result.evaluation is not None and result.evaluation.passed
    # the oracle played this session's own script through the harness's bash tool
    first = traj.traces[0]
    assert "ls -la" in json.dumps(first.response_messages)
    # logs and outputs are artifacts; the never-written log is noted, not fatal
    artifacts = Path(result.metadata["artifacts"]["dir"])
    assert "calls done" in (artifacts / "logs" / "polar__home__harness.log").read_text()
    assert (artifacts / "harness.stdout").exists() and (artifacts / "result.json").exists()
    assert any("never-written" in m for m in result.metadata["artifacts"]["missing_logs"])
    assert {"init", "run", "build", "evaluate", "teardown", "total"} <= set(result.timings)
    # torn down: key forgotten, no runtime left
    assert gw.service.sessions.get("full") is None and gw.node.stages.live_runtimes() == 0


async def test_several_sessions_never_exceed_the_run_slots(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(init_workers=3, ready_buffer=2, run_slots=2, postrun_workers=2)
    running: list[int] = []
    gw.node.listeners.append(lambda s, st: running.append(
        sum(1 for x in gw.node.sessions() if x.status is S.RUNNING)))
    results = await gw.node.run([gw.spec(f"c{i}", sleep=0.2) for i in range(6)])
    assert [r.status for r in results] == [S.COMPLETED] * 6
    assert max(running) <= 2 and gw.node.run_pool.peak_busy == 2
    assert all(r.trajectory is not None and len(r.trajectory.traces) == 1 for r in results)


async def test_harness_past_the_deadline_returns_its_partial_trace(make_gateway: MakeGateway) -> None:
    gw = await make_gateway()
    # the deadline leaves a loaded machine room to start the sandbox and make the one call; the harness then
    # sleeps far past it, so only the deadline can end it
    result = (await gw.node.run([gw.spec("late", calls=1, sleep=600, timeout=10)]))[0]
    assert result.status is S.TIMEOUT, result.reason
    assert "partial traces kept" in (result.reason or "")
    assert result.metadata["harness"]["status"] == "timeout"
    assert result.trajectory is not None and len(result.trajectory.traces) == 1
    assert result.timings["total"] < 120
    assert await no_processes_with(gw.marker) == []


async def test_cancel_in_init(make_gateway: MakeGateway) -> None:
    gw = await make_gateway()
    gw.node.submit(gw.spec("c-init", prepare=[PrepareAction(type="exec", command="sleep 60")]))
    await wait_status(gw, "c-init", S.INITIALIZING)
    await wait_running(gw, "sleep 60")  # the prepare command is running inside the sandbox
    assert gw.node.cancel("c-init")
    result = await gw.node.wait("c-init", timeout=BOUND)
    assert result.status is S.CANCELLED and "(in init)" in (result.reason or "")
    assert gw.node.stages.live_runtimes() == 0 and await no_processes_with(gw.marker) == []


async def test_cancel_in_ready_and_in_running(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(run_slots=1)
    gw.node.submit(gw.spec("c-run", sleep=60))
    await wait_status(gw, "c-run", S.RUNNING)
    gw.node.submit(gw.spec("c-ready"))
    await wait_status(gw, "c-ready", S.READY)
    assert gw.node.cancel("c-ready")
    ready = await gw.node.wait("c-ready", timeout=BOUND)
    assert ready.status is S.CANCELLED and "(in ready)" in (ready.reason or "")
    await wait_running(gw, "sleep 60")  # the harness made its call and sleeps
    assert gw.node.cancel("c-run")
    run = await gw.node.wait("c-run", timeout=BOUND)
    assert run.status is S.CANCELLED and "(in run)" in (run.reason or "")
    assert gw.service.sessions.get("c-run") is None
    assert gw.node.stages.live_runtimes() == 0 and await no_processes_with(gw.marker) == []


async def test_cancel_in_postrun(make_gateway: MakeGateway) -> None:
    gw = await make_gateway()
    gw.node.submit(gw.spec("c-post", evaluator="SleepyEvaluator"))
    await wait_status(gw, "c-post", S.EVALUATING)
    await wait_running(gw, "sleep 30")  # the evaluator's sleep runs inside the live runtime
    assert gw.node.cancel("c-post")
    result = await gw.node.wait("c-post", timeout=BOUND)
    assert result.status is S.CANCELLED and "(in postrun)" in (result.reason or "")
    assert gw.node.stages.live_runtimes() == 0 and await no_processes_with(gw.marker) == []


async def test_a_failing_prepare_action_is_an_error_and_the_pool_keeps_serving(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(init_workers=1, run_slots=1)
    bad = gw.spec("bad", prepare=[PrepareAction(type="exec", command="echo nope >&2; exit 3")])
    results = await gw.node.run([bad, gw.spec("good-1"), gw.spec("good-2")])
    assert results[0].status is S.ERROR
    assert "prepare action 0" in (results[0].reason or "") and "exit code 3" in (results[0].reason or "")
    assert "nope" in (results[0].reason or "")
    assert [r.status for r in results[1:]] == [S.COMPLETED, S.COMPLETED]


async def test_evaluator_gets_a_prewarmed_fresh_runtime(make_gateway: MakeGateway) -> None:
    gw = await make_gateway()
    spec = gw.spec("fresh", evaluator="FreshEvaluator",
                   prepare=[PrepareAction(type="upload_file", dst="prepared.txt", content="prepared\n")])
    result = (await gw.node.run([spec]))[0]
    assert result.status is S.COMPLETED, result.reason
    assert result.evaluation is not None and result.evaluation.reward == 1.0
    assert "prewarm" in result.timings


async def test_a_broken_evaluator_keeps_the_traces(make_gateway: MakeGateway) -> None:
    gw = await make_gateway()
    result = (await gw.node.run([gw.spec("broken", evaluator="BrokenEvaluator")]))[0]
    assert result.status is S.ERROR and "evaluator is broken" in (result.reason or "")
    assert result.trajectory is not None and len(result.trajectory.traces) == 1


async def test_an_unknown_harness_is_an_error_before_any_runtime_starts(make_gateway: MakeGateway) -> None:
    gw = await make_gateway()
    spec = gw.spec("unknown")
    spec.agent.harness = "no_such_harness"
    result = (await gw.node.run([spec]))[0]
    assert result.status is S.ERROR and "no_such_harness" in (result.reason or "")


async def test_drain_finishes_sessions_in_flight(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(run_slots=2)
    for i in range(3):
        gw.node.submit(gw.spec(f"d{i}", sleep=0.3))
    await gw.node.drain()
    assert [gw.node.get(f"d{i}").status for i in range(3)] == [S.COMPLETED] * 3
    assert gw.node.stages.live_runtimes() == 0 and await no_processes_with(gw.marker) == []


def test_start_up_cleaning_removes_only_attempts_a_dead_gateway_left_unfinished(tmp_path: Path) -> None:
    """Fault 8 (issue 11): at a restart, attempt directories whose gateway process is gone and that never got a
    result are removed; finished ones, live ones (this process), other hosts' and non-attempt folders stay."""
    import os
    import socket
    import subprocess
    import sys

    from polar_gym.gateway.sandbox import OWNER_FILE, clean_dead_attempts

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead = {"pid": int(gone.stdout), "start": None, "host": socket.gethostname()}

    def attempt(path: str, owner: dict | None, finished: bool = False) -> Path:
        directory = tmp_path / path
        (directory / "sandbox" / "workspace").mkdir(parents=True)
        if owner is not None:
            (directory / OWNER_FILE).write_text(json.dumps(owner))
        if finished:
            (directory / "artifacts").mkdir()
            (directory / "artifacts" / "result.json").write_text("{}")
        return directory

    died = attempt("s1/aaaaaaaaaaaa", dead)
    never_owned = attempt("s1/dddddddddddd", None)  # killed between mkdir and writing its owner file
    finished = attempt("s1/bbbbbbbbbbbb", dead, finished=True)
    live = attempt("s2/cccccccccccc", {"pid": os.getpid(), "start": None, "host": socket.gethostname()})
    elsewhere = attempt("s3/eeeeeeeeeeee", {**dead, "host": "another-node"})
    legacy = attempt("s4/sandbox", dead)
    assert sorted(clean_dead_attempts(tmp_path)) == ["s1/aaaaaaaaaaaa", "s1/dddddddddddd"]
    assert not died.exists() and not never_owned.exists()
    assert finished.exists() and live.exists() and elsewhere.exists() and legacy.exists()
