"""The lost-job rules of launcher=slurm (polar_gym.launch.lost_jobs) and the gateway workdir template, without
Slurm: states to verdicts, what ends a run, the watch over fake jobs, the results a fatal loss leaves, summary.md."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.console import Console

from polar_gym.launch.jobs import GatewayJobSettings, gateway_workdir, node_workdir
from polar_gym.launch.lost_jobs import JobLost, JobWatch, LostJob, fatal, lost_outcomes, lost_state, role_of
from polar_gym.launch.outputs import write_outputs
from polar_gym.schema import AgentSpec, SessionResult, SessionSpec, SessionStatus, TaskRequest
from polar_gym.server.store import Store


@pytest.mark.parametrize(("state", "in_queue", "verdict"), [
    ("RUNNING", True, None),
    ("PENDING", True, None),
    ("REQUEUED", None, None),  # Slurm's own requeue (--requeue): it comes back under the same id
    (None, True, None),  # accounting does not know it yet
    ("UNKNOWN", None, None),
    ("RUNNING", False, "NODE_GONE"),  # accounting still says running, the queue no longer lists it
    ("NODE_FAIL", False, "NODE_FAIL"),
    ("FAILED", False, "FAILED"),
    ("CANCELLED by 1000", False, "CANCELLED"),
    ("TIMEOUT", None, "TIMEOUT"),
    ("COMPLETED", False, "COMPLETED"),  # a service job should never end on its own
])
def test_lost_state(state: str | None, in_queue: bool | None, verdict: str | None) -> None:
    assert lost_state(state, in_queue) == verdict


def test_what_a_loss_costs() -> None:
    def lost(name: str) -> LostJob:
        return LostJob("7", name, role_of(name), "FAILED", 3.0)

    assert [role_of(n) for n in ("polar-gateway-0.1", "polar-server", "polar-inference-2", "x")] == \
        ["gateway", "server", "inference", "other"]
    assert fatal(lost("polar-gateway-0"), gateways_left=1, replacing=False) is None
    assert fatal(lost("polar-gateway-0"), gateways_left=0, replacing=True) is None
    assert "no gateway job is left" in (fatal(lost("polar-gateway-0"), gateways_left=0, replacing=False) or "")
    assert fatal(lost("polar-server"), 3, True) and fatal(lost("polar-inference-0"), 3, True)


@dataclass
class FakeJob:
    """A submitit job as the local executor shows it (``state``)."""

    job_id: str
    state: str = "RUNNING"


async def test_the_watch_replaces_a_lost_gateway_and_stops_on_a_lost_server() -> None:
    jobs = [FakeJob("1"), FakeJob("2"), FakeJob("3")]
    names = {"1": "polar-server", "2": "polar-gateway-0", "3": "polar-gateway-1"}
    replaced: list[str] = []
    changes: list[dict[str, str]] = []

    def replace(lost: LostJob) -> str:
        replaced.append(lost.name)
        jobs.append(FakeJob("4"))
        names["4"] = "polar-gateway-0.1"
        return "4"

    console = Console(record=True, width=200)
    watch = JobWatch(jobs, names, console=console, cluster="local", interval=0.01, replace=replace,
                     max_replacements=1, changed=lambda: changes.append(watch.states()))
    await watch.check()
    assert watch.lost == {} and changes == []
    jobs[1].state = "FAILED"
    await watch.check()
    assert replaced == ["polar-gateway-0"] and watch.lost["2"].replaced_by == "4"
    assert changes[-1] == {"1": "live", "2": "lost: FAILED", "3": "live", "4": "live"}
    jobs[3].state = "NODE_FAIL"  # no replacement left; the other gateway still runs
    await watch.check()
    assert watch.lost["4"].replaced_by is None
    jobs[0].state = "FAILED"
    with pytest.raises(JobLost, match=r"server job 1 \(polar-server\) lost: FAILED"):
        await asyncio.wait_for(watch.run(), 5)
    text = console.export_text()
    assert "gateway job 2 (polar-gateway-0) lost: FAILED after 0 s, replaced by job 4" in text


async def test_a_job_slurm_requeues_after_its_node_failed_is_reported_back() -> None:
    """JobRequeue=1 (Slurm's default): a batch job on a failed node shows NODE_FAIL, then PENDING under the same id
    and runs again elsewhere. The watch counts it lost, then back: jobs.json says so and the console tells why."""
    jobs = [FakeJob("1"), FakeJob("2")]
    names = {"1": "polar-gateway-0", "2": "polar-gateway-1"}
    console = Console(record=True, width=200)
    changes: list[dict[str, str]] = []
    watch = JobWatch(jobs, names, console=console, cluster="local", interval=0.01, replace=None,
                     max_replacements=0, changed=lambda: changes.append(watch.states()))
    jobs[0].state = "NODE_FAIL"
    await watch.check()
    assert changes[-1] == {"1": "lost: NODE_FAIL", "2": "live"}
    jobs[0].state = "PENDING"
    await watch.check()
    assert watch.lost == {} and changes[-1] == {"1": "back after NODE_FAIL", "2": "live"}
    jobs[0].state = "RUNNING"
    await watch.check()
    assert len(changes) == 2  # nothing new: it simply runs
    assert "gateway job 1 (polar-gateway-0) requeued by Slurm after NODE_FAIL" in console.export_text()


async def test_a_gateway_the_server_declared_dead_is_lost_before_slurm_knows() -> None:
    """A node's death reaches Slurm after SlurmdTimeout; the rollout server misses the gateway's heartbeats in
    seconds. The job whose gateway went silent (its health names its SLURM_JOB_ID) is lost and replaced at once;
    Slurm's verdict is added when it comes; a silent gateway that registers again (a partition healed) is back."""
    jobs = [FakeJob("1"), FakeJob("2")]
    names = {"1": "polar-gateway-0", "2": "polar-gateway-1"}
    rows = [{"gateway_id": "g1", "state": "healthy", "health": {"job_id": "1"}},
            {"gateway_id": "g2", "state": "healthy", "health": {"job_id": "2"}},
            {"gateway_id": "g0", "state": "healthy", "health": {}}]  # not one of ours (or an older gateway)

    async def gateways() -> list[dict[str, object]]:
        return rows

    def replace(lost: LostJob) -> str:
        jobs.append(FakeJob("3"))
        names["3"] = lost.name + ".1"
        return "3"

    console = Console(record=True, width=200)
    watch = JobWatch(jobs, names, console=console, cluster="local", interval=0.01, replace=replace,
                     max_replacements=1, gateways=gateways)
    await watch.check_gateways()
    assert watch.lost == {}
    rows[0]["state"] = rows[1]["state"] = "dead"
    await watch.check_gateways()
    assert watch.states() == {"1": "lost: UNREACHABLE", "2": "lost: UNREACHABLE", "3": "live"}
    assert watch.lost["1"].replaced_by == "3" and watch.lost["2"].replaced_by is None  # one replacement allowed
    jobs[0].state = "NODE_FAIL"  # Slurm finds out later
    await watch.check()
    assert watch.states()["1"] == "lost: UNREACHABLE, then NODE_FAIL"
    rows[1]["state"] = "healthy"  # gateway 1 was only cut off
    await watch.check_gateways()
    assert watch.states() == {"1": "lost: UNREACHABLE, then NODE_FAIL", "2": "back after UNREACHABLE", "3": "live"}
    text = console.export_text()
    assert "gateway job 1 (polar-gateway-0) lost: UNREACHABLE after 0 s, replaced by job 3" in text
    assert "gateway job 2 (polar-gateway-1) answers again" in text


async def test_the_last_gateway_lost_without_replacement_ends_the_run() -> None:
    jobs = [FakeJob("1", "CANCELLED")]
    watch = JobWatch(jobs, {"1": "polar-gateway-0"}, console=Console(quiet=True), cluster="local", interval=0.01,
                     replace=None, max_replacements=4)
    with pytest.raises(JobLost, match="no gateway job is left"):
        await watch.check()


async def test_a_fatal_loss_keeps_finished_results_and_ends_the_others_as_job_lost(tmp_path: Path) -> None:
    task = TaskRequest(task_id="t", instruction="x", num_samples=3, agent=AgentSpec(harness="shell"))
    other = TaskRequest(task_id="never-stored", instruction="x", num_samples=1, agent=AgentSpec(harness="shell"))
    specs = [SessionSpec.from_task(task, i) for i in range(3)]
    store = Store(tmp_path / "server.sqlite")
    await store.add_task(task, specs)
    await store.finish(SessionResult(session_id=specs[0].session_id, task_id="t", status=SessionStatus.COMPLETED,
                                     metadata={"sample_index": 0}))
    store.close()
    lost = LostJob("5", "polar-inference-0", "inference", "NODE_FAIL", 30.0)
    outcomes = await lost_outcomes(tmp_path / "server.sqlite", [task, other], lost, 31.0)
    assert [(o.spec.task_id, o.spec.sample_index, o.result.status.value) for o in outcomes] == [
        ("t", 0, "COMPLETED"), ("t", 1, "ERROR"), ("t", 2, "ERROR"), ("never-stored", 0, "ERROR")]
    assert outcomes[1].spec.session_id == specs[1].session_id
    assert outcomes[1].result.reason == "job_lost: inference job 5 (polar-inference-0) lost: NODE_FAIL after 30 s"
    totals = write_outputs(tmp_path / "out", outcomes, 31.0, lost_jobs=[lost.as_dict()])
    assert totals["errors_by_cause"] == {"job_lost": 3} and totals["lost_jobs"][0]["job_id"] == "5"
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "## Lost jobs" in summary and "| 5 | polar-inference-0 | inference | NODE_FAIL | 30 | - |" in summary


def test_the_gateway_workdir_template(tmp_path: Path) -> None:
    default, scratch = gateway_workdir(GatewayJobSettings(), tmp_path, "1")
    assert default == tmp_path / "gateways" / "gateway-1" and scratch is None  # unchanged for current users
    _, scratch = gateway_workdir(GatewayJobSettings(workdir="$TMPDIR/polar-{job_id}-{index}"), tmp_path, "0.1")
    assert scratch == {"template": "$TMPDIR/polar-{job_id}-{index}", "index": "0.1", "keep": False}
    env = {"TMPDIR": "/scratch/local", "SLURM_JOB_ID": "42"}
    assert node_workdir("$TMPDIR/polar-{job_id}-{index}", "0.1", env) == Path("/scratch/local/polar-42-0.1")
    assert node_workdir("${TMPDIR}/g{index}", "3", env) == Path("/scratch/local/g3")
    with pytest.raises(ValueError, match="names LOCAL_SCRATCH, which this node does not set"):
        node_workdir("$LOCAL_SCRATCH/x", "0", env)
    with pytest.raises(ValueError, match="is not an absolute path"):
        node_workdir("relative/{job_id}", "0", env)
