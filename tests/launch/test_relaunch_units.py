"""polar_gym.launch.relaunch without Slurm: squeue's time left, the successor's command and sbatch line, when a run
hands over, and the hand-over itself against a fake fleet (drain, wait for running sessions, submit, record)."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from polar_gym.launch.relaunch import (
    COUNT_ENV,
    HAND_OVER_SIGNAL,
    RelaunchSettings,
    Relay,
    SlurmJob,
    current_job,
    parse_time_left,
    relay_for,
    sbatch_argv,
    successor_argv,
)


@pytest.mark.parametrize(("text", "seconds"), [
    ("0:45", 45.0), ("12:05", 725.0), ("1:00:00", 3600.0), ("2-03:04:05", 2 * 86400 + 3 * 3600 + 4 * 60 + 5.0),
    ("UNLIMITED", None), ("NOT_SET", None), ("INVALID", None), ("", None), ("1:2:3:4", None), ("-1:00", None),
])
def test_squeue_time_left_is_parsed(text: str, seconds: float | None) -> None:
    assert parse_time_left(text) == seconds


def _job(left: float = 3600.0) -> SlurmJob:
    return SlurmJob("42", left, "1:00:00", "debug", "polar run", None, None)


def test_the_current_job_is_read_from_squeue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert current_job(lambda argv: "unused") is None  # outside Slurm
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    asked: list[list[str]] = []

    def squeue(argv: list[str]) -> str:
        asked.append(argv)
        return "58:20|1:00:00|debug|polar run|(null)|normal|N/A|1\n"

    job = current_job(squeue)
    assert asked[0][:4] == ["squeue", "-h", "-j", "42"]
    assert job == SlurmJob("42", 3500.0, "1:00:00", "debug", "polar run", None, "normal", None, "1")
    for shown in ("gres/gpu:4", "gres:gpu:4", "gpu:4"):  # as Slurm versions print a GPU job's %b
        gpu = current_job(lambda argv, s=shown: f"58:20|1:00:00|gpu|x|acct|normal|{s}|2\n")
        assert gpu is not None and (gpu.gres, gpu.nodes, gpu.account) == ("gpu:4", "2", "acct")
    assert current_job(lambda argv: "UNLIMITED|UNLIMITED|debug|x||\n") is None  # no limit: nothing to outlive
    assert current_job(lambda argv: "") is None  # the job is not listed (any more)


def test_the_successor_runs_the_same_overrides_in_the_same_folder(tmp_path: Path) -> None:
    argv = ["launcher=local", "out_dir=elsewhere", "resume=false", "+tasks.ids=[a,b]", "harness=shell"]
    command = successor_argv(argv, tmp_path / "run")
    assert command == [sys.executable, "-m", "polar_gym.launch", "launcher=local", "+tasks.ids=[a,b]",
                       "harness=shell", f"out_dir={(tmp_path / 'run').resolve()}", "resume=true"]


def test_the_successor_is_submitted_after_this_job_with_its_resources(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "8192")
    command = [sys.executable, "-m", "polar_gym.launch", "out_dir=/x y", "resume=true"]
    argv = sbatch_argv(_job(), command, tmp_path, 3, tmp_path)
    assert argv[:3] == ["sbatch", "--parsable", "--dependency=afterany:42"]
    for flag in ("--time=1:00:00", "--partition=debug", "--job-name=polar run", "--cpus-per-task=4", "--mem=8192M",
                 f"--export=ALL,{COUNT_ENV}=3", f"--chdir={tmp_path}"):
        assert flag in argv
    assert not any(a.startswith(("--account", "--qos", "--gres", "--nodes")) for a in argv)  # not set on this job
    gpus = sbatch_argv(SlurmJob("42", 3600.0, "4:00:00", "gpu", "run", None, None, "gpu:8", "2"), command, tmp_path,
                       1, tmp_path)
    assert "--gres=gpu:8" in gpus and "--nodes=2" in gpus  # the successor gets the GPUs and nodes this job had
    # quoted (the space survives); exec: a signal to the batch script (--signal=B:USR1@N) reaches the launch
    assert argv[-2] == "--wrap" and shlex.split(argv[-1]) == ["exec", *command]


def test_when_a_run_hands_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(COUNT_ENV, raising=False)
    auto = RelaunchSettings(margin_seconds=600)
    relay, line = relay_for(auto, tmp_path, [], job=_job(3600))
    assert relay is not None and line is not None and "hands over 600 s before" in line
    assert relay_for(RelaunchSettings(enabled="false"), tmp_path, [], job=_job())[0] is None
    short, why = relay_for(auto, tmp_path, [], job=_job(605))  # the limit is inside the margin: it would loop
    assert short is None and why is not None and "too close to relaunch.margin_seconds=600" in why
    with pytest.raises(ValueError, match="too close to"):
        relay_for(RelaunchSettings(enabled=True, margin_seconds=600), tmp_path, [], job=_job(605))
    monkeypatch.setenv(COUNT_ENV, "5")
    capped, why = relay_for(RelaunchSettings(max_relaunches=5), tmp_path, [], job=_job())
    assert capped is None and why is not None and "5 hand-overs already" in why
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert relay_for(auto, tmp_path, []) == (None, None)  # outside Slurm, auto: silently off
    with pytest.raises(ValueError, match="needs a Slurm batch job"):
        relay_for(RelaunchSettings(enabled="true"), tmp_path, [])


class FakeFleet:
    """The rollout client's calls a hand-over makes."""

    def __init__(self, running: list[int]) -> None:
        self.drained: list[str] = []
        self.running = running

    async def gateways(self) -> list[dict[str, Any]]:
        return [{"gateway_id": "gw-a", "state": "healthy"}, {"gateway_id": "gw-b", "state": "dead"}]

    async def drain_gateway(self, gateway_id: str, *, withdraw: bool = False) -> dict[str, Any]:
        assert withdraw  # what is not running yet goes back to the queue, for the successor
        self.drained.append(gateway_id)
        return {}

    async def in_flight(self) -> int:
        return self.running.pop(0) if len(self.running) > 1 else self.running[0]


async def test_a_hand_over_drains_waits_for_the_running_sessions_and_records_itself(tmp_path: Path) -> None:
    fleet = FakeFleet([2, 1, 0])
    submitted: list[list[str]] = []

    def submit(argv: list[str]) -> str:
        submitted.append(argv)
        return "43"

    relay = Relay(RelaunchSettings(margin_seconds=30), _job(left=30.2), tmp_path, ["launcher=local"], count=1,
                  submit=submit)
    t0 = time.monotonic()
    handover = await relay.watch(fleet, fleet.in_flight, unfinished=_answer(5))
    assert handover is not None and handover.successor == "43" and fleet.drained == ["gw-a"]
    assert time.monotonic() - t0 < 20  # it waited for the sessions, not for the limit
    assert len(submitted) == 1 and "--dependency=afterany:42" in submitted[0]
    assert f"--export=ALL,{COUNT_ENV}=2" in submitted[0]
    rows = [json.loads(line) for line in (tmp_path / "relaunches.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["successor"] == "43" and rows[0]["cut_sessions"] == 0
    assert rows[0]["relaunch"] == 2 and rows[0]["command"][-1] == "resume=true"
    assert rows[0]["trigger"] == "the time limit"


async def test_sigusr1_starts_the_hand_over_at_once_and_a_repeat_does_not_end_the_launch(tmp_path: Path) -> None:
    import asyncio
    import os

    fleet = FakeFleet([1, 0])
    relay = Relay(RelaunchSettings(margin_seconds=60), _job(left=3600.0), tmp_path, [], submit=lambda argv: "43")
    watch = asyncio.ensure_future(relay.watch(fleet, fleet.in_flight, unfinished=_answer(5)))
    await asyncio.sleep(0)  # the watch is listening
    assert not watch.done() and not fleet.drained
    os.kill(os.getpid(), HAND_OVER_SIGNAL)  # as `scancel --batch --signal=USR1 JOB` or sbatch --signal=B:USR1@N
    handover = await asyncio.wait_for(watch, 30)  # not the 3,540 s until the margin
    assert handover is not None and handover.successor == "43" and fleet.drained == ["gw-a"]
    os.kill(os.getpid(), HAND_OVER_SIGNAL)  # caught while the loop lives: a second notice is harmless
    await asyncio.sleep(0.05)
    (row,) = [json.loads(line) for line in (tmp_path / "relaunches.jsonl").read_text().splitlines()]
    assert row["trigger"] == "SIGUSR1" and row["seconds_in_job"] < 30


def _answer(n: int) -> Any:
    async def count() -> int:
        return n

    return count


async def test_a_run_that_finished_while_draining_needs_no_successor(tmp_path: Path) -> None:
    fleet = FakeFleet([0])
    relay = Relay(RelaunchSettings(margin_seconds=30), _job(left=30.0), tmp_path, [], submit=lambda argv: "never")
    assert await relay.watch(fleet, fleet.in_flight, unfinished=_answer(0)) is None
    assert fleet.drained == ["gw-a"] and not (tmp_path / "relaunches.jsonl").exists()


@pytest.mark.parametrize(("left", "results_after", "training_seconds", "successor"), [
    # the last step's results come in after the fleet is idle, then it trains, saves and pushes in this job:
    # nothing for a successor to do
    (30.0, 0.3, 0.2, False),
    (10.3, 0.0, 3.0, True),  # its training would run past the limit's last 10 s: the successor resumes it
    (12.0, None, 0.0, True),  # its groups do not come in within the grace (sessions withdrawn by the drain)
])
async def test_a_hand_over_during_the_last_step_submits_a_successor_only_if_the_step_cannot_finish(
        tmp_path: Path, left: float, results_after: float | None, training_seconds: float, successor: bool) -> None:
    import asyncio
    from types import SimpleNamespace

    from polar_gym.launch.training import _handing_over
    from polar_gym.trainer.loops import RunControl

    submitted: list[list[str]] = []
    relay = Relay(RelaunchSettings(margin_seconds=left), _job(left=left), tmp_path, [],
                  submit=lambda argv: submitted.append(argv) or "43")  # type: ignore[func-returns-value]
    job: Any = SimpleNamespace(trainer=SimpleNamespace(steps=3), relay=relay, handover=None)
    control = RunControl(last_step=2)

    async def last_step() -> Path:
        if results_after is None:
            await control.abandon.wait()  # left to the successor
            return tmp_path / "step-2"
        await asyncio.sleep(results_after)
        await control.groups_in(3)
        await asyncio.sleep(training_seconds)  # a step under way finishes, hand-over or not
        control.last_step = 3
        return tmp_path / "step-3"

    fleet = FakeFleet([0])
    assert await _handing_over(job, fleet, control, last_step()) == tmp_path / (  # type: ignore[arg-type]
        "step-2" if results_after is None else "step-3")
    assert bool(submitted) is successor and (job.handover is not None) is successor
