"""The launcher's watch over its Slurm jobs for the whole run (``launcher=slurm``): a service job (gateway, rollout
server, inference server) should run until the launcher cancels it, so one that ends before (NODE_FAIL, FAILED, a
process killed, TIMEOUT, CANCELLED by someone else) or that squeue no longer lists while accounting still says
RUNNING (its node is gone) is *lost*. Lost jobs are reported on the console, in ``jobs.json`` and in the run's
summary. A lost gateway costs capacity only: the rollout server re-dispatches its sessions once it misses its
heartbeats, and with ``launcher.replace_lost_gateways`` a new gateway job is submitted in its place. A lost server
or inference job ends the run: the sessions not finished then are recorded as errors with cause ``job_lost``.

Why the launcher replaces gateways itself rather than Slurm's ``--requeue``: requeue only covers some end states
(node failure, preemption) and is often disabled by the site (``JobRequeue=0``); a killed or OOM-killed job would
stay lost. A job Slurm requeues (``additional_parameters: {requeue: true}``) shows PENDING / REQUEUED and is not
counted lost. The pure rules live here; the sacct / squeue calls are one small function."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from polar_gym.launch.driver import outcome_of
from polar_gym.launch.outputs import SessionOutcome
from polar_gym.schema import SessionResult, SessionSpec, SessionStatus, TaskRequest
from polar_gym.server.store import SessionRow, Store

__all__ = ["JOB_LOST", "LIVE_STATES", "UNREACHABLE", "JobLost", "JobWatch", "LostJob", "fatal", "lost_outcomes",
           "lost_result", "lost_state", "query_states", "role_of"]

#: the error cause of sessions a lost server or inference job left unfinished (see polar_gym.causes)
JOB_LOST = "job_lost"
#: the state of a gateway job whose gateway the rollout server declared dead (missed heartbeats) before Slurm says
#: anything: a node's death reaches Slurm only after SlurmdTimeout (300 s by default), the server in seconds
UNREACHABLE = "UNREACHABLE"
#: states of a job that still counts as the run's (requeued ones included: Slurm brings them back; QUEUED is
#: submitit's debug executor)
LIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD",
                         "REQUEUE_FED", "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "RESV_DEL_HOLD",
                         "QUEUED"})
Role = Literal["gateway", "server", "inference", "other"]


def role_of(name: str) -> Role:
    """What a job of this launcher runs, from the name it was submitted under."""
    if name.startswith("polar-gateway"):
        return "gateway"
    if name.startswith("polar-server"):
        return "server"
    if name.startswith("polar-inference"):
        return "inference"
    return "other"


def lost_state(state: str | None, in_queue: bool | None) -> str | None:
    """Why a service job counts as lost (its final state, or NODE_GONE when squeue no longer lists a job accounting
    still shows live); None while it lives. ``state`` None: accounting does not know the job (yet);
    ``in_queue`` None: squeue could not be asked."""
    word = (state or "").split()[0].upper() if state and state.strip() else ""
    if word in LIVE_STATES:
        if word in ("RUNNING", "COMPLETING") and in_queue is False:
            return "NODE_GONE"
        return None
    if not word or word == "UNKNOWN":
        return None
    return word


@dataclass
class LostJob:
    """One job the run lost: which, when (seconds into the run), in what state, and its replacement if any."""

    job_id: str
    name: str
    role: str
    state: str
    seconds: float
    replaced_by: str | None = None

    def line(self) -> str:
        extra = f", replaced by job {self.replaced_by}" if self.replaced_by else ""
        return f"{self.role} job {self.job_id} ({self.name}) lost: {self.state} after {self.seconds:.0f} s{extra}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class JobLost(RuntimeError):
    """A job the run cannot go on without was lost (the rollout server, an inference server, every gateway)."""

    def __init__(self, lost: LostJob, why: str) -> None:
        super().__init__(f"{lost.line()}: {why}")
        self.lost = lost


def fatal(lost: LostJob, gateways_left: int, replacing: bool) -> str | None:
    """Why losing this job ends the run (None: the run goes on without it)."""
    if lost.role == "server":
        return "the rollout server is gone; the sessions not finished cannot be"
    if lost.role == "inference":
        return "its model server is gone; the sessions not finished would only fail their model calls"
    if lost.role == "gateway" and gateways_left == 0 and not replacing:
        return "no gateway job is left to run the sessions (launcher.replace_lost_gateways=true submits new ones)"
    return None


def lost_result(session_id: str, task_id: str, sample_index: int, lost: LostJob) -> SessionResult:
    """The result a session gets when a lost job left it unfinished: ERROR with cause ``job_lost``."""
    return SessionResult(session_id=session_id, task_id=task_id, status=SessionStatus.ERROR,
                         reason=f"{JOB_LOST}: {lost.line()}",
                         metadata={"sample_index": sample_index, "artifacts": {"error_cause": JOB_LOST},
                                   "lost_job": lost.as_dict()})


async def lost_outcomes(db: Path | str | None, requests: list[TaskRequest], lost: LostJob,
                        waited: float) -> list[SessionOutcome]:
    """Every session of the run after a fatal loss: its result where the server's store (``db``: a SQLite file the
    launcher's host sees, the server writes it in OUT_DIR; or the server workers' PostgreSQL URL; None: a store in
    a lost server job's node, out of reach) has a final one, else ERROR ``job_lost``."""
    rows: dict[tuple[str, int], SessionRow] = {}
    if db is not None and (isinstance(db, str) or await asyncio.to_thread(db.exists)):
        store = Store(db)
        try:
            for request in requests:
                for stored in await store.sessions_of(request.task_id):
                    rows[(request.task_id, stored.spec.sample_index)] = stored
        finally:
            store.close()
    out = []
    for request in requests:
        for i in range(request.num_samples):
            row = rows.get((request.task_id, i))
            if row is not None and row.status.terminal and row.result is not None:
                result = row.result
            else:
                session_id = row.session_id if row is not None else SessionSpec.from_task(request, i).session_id
                result = lost_result(session_id, request.task_id, i, lost)
            out.append(outcome_of(request, result, waited))
    return out


def query_states(job_ids: list[str], timeout: float = 30.0) -> dict[str, tuple[str | None, bool | None]]:
    """job id -> (sacct's state, whether squeue lists it) for Slurm jobs; (None, None) when a tool cannot answer."""
    out: dict[str, tuple[str | None, bool | None]] = {j: (None, None) for j in job_ids}
    if not job_ids:
        return out
    ids = ",".join(job_ids)
    states: dict[str, str] = {}
    try:
        acct = subprocess.run(["sacct", "-j", ids, "-X", "-n", "-o", "JobID,State", "--parsable2"],
                              capture_output=True, text=True, timeout=timeout)
        for line in acct.stdout.splitlines():
            job, _, state = line.partition("|")
            if job.strip() in out and state.strip():
                states[job.strip()] = state.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    queued: set[str] | None
    try:
        queue = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ids], capture_output=True, text=True,
                               timeout=timeout)
        # squeue fails (exit 1, "Invalid job id") once every listed job has left the queue
        queued = {line.strip() for line in queue.stdout.splitlines() if line.strip()} \
            if queue.returncode == 0 or "Invalid job id" in queue.stderr else None
    except (OSError, subprocess.TimeoutExpired):
        queued = None
    for job in job_ids:
        out[job] = (states.get(job), None if queued is None else job in queued)
    return out


class JobWatch:
    """Checks the launcher's jobs every ``interval`` seconds for the whole run, in Slurm (sacct, squeue) and, with
    ``gateways``, in the rollout server's view of its gateways (a dead node's gateway goes silent long before Slurm
    declares the node down). ``replace(lost)`` submits a new gateway job and returns its id (None: none is
    submitted); ``changed()`` is called after each change (to rewrite jobs.json). :meth:`run` returns never; it
    raises :class:`JobLost` when the run cannot go on."""

    def __init__(self, jobs: list[Any], names: dict[str, str], *, console: Any, cluster: str, interval: float,
                 replace: Callable[[LostJob], str | None] | None, max_replacements: int,
                 changed: Callable[[], None] = lambda: None,
                 gateways: Callable[[], Awaitable[list[dict[str, Any]]]] | None = None) -> None:
        self.jobs, self.names, self.console, self.cluster = jobs, names, console, cluster
        self.interval, self.replace, self.max_replacements = interval, replace, max_replacements
        self.changed, self.gateways = changed, gateways
        self.lost: dict[str, LostJob] = {}
        self.requeued: dict[str, str] = {}  # job id -> the state it was lost in before Slurm requeued it
        self.started = time.monotonic()
        self.replacements = 0

    def states(self) -> dict[str, str]:
        """job id -> what jobs.json says of it: ``lost: STATE`` for a lost one, ``back after STATE`` for one that
        came back (Slurm requeued it after a node failure, the default JobRequeue=1; or its gateway, silent for a
        while, registered again), else ``live``."""
        return {j.job_id: f"lost: {self.lost[j.job_id].state}" if j.job_id in self.lost
                else f"back after {self.requeued[j.job_id]}" if j.job_id in self.requeued else "live"
                for j in self.jobs}

    def _check(self) -> dict[str, str | None]:
        """job id -> lost state (None: it lives), for every job (runs in a thread: sacct and squeue block)."""
        if self.cluster == "slurm":
            answers = query_states([j.job_id for j in self.jobs])
            return {job: lost_state(*answers[job]) for job in answers}
        return {j.job_id: lost_state(_submitit_state(j), None) for j in self.jobs}  # submitit's local executor

    async def run(self) -> None:
        while True:
            await self.check()
            await self.check_gateways()
            await asyncio.sleep(self.interval)

    async def check_gateways(self) -> None:
        """The rollout server's view (``gateways``: its GET /gateways rows): a job whose gateway it declared dead is
        lost now; one whose gateway answers again is back. Each gateway says its job in its health
        (``job_id``); a job requeued onto another node registers a new gateway under the same job id."""
        if self.gateways is None:
            return
        try:
            rows = await self.gateways()
        except Exception:  # the server not answering is the driver's to report
            return
        alive: dict[str, bool] = {}
        for row in rows:
            job_id = (row.get("health") or {}).get("job_id")
            if isinstance(job_id, str):
                alive[job_id] = alive.get(job_id, False) or row.get("state") != "dead"
        for job_id, up in alive.items():
            if up:
                self.answers_again(job_id)
            else:
                await self.unreachable(job_id)

    async def check(self) -> None:
        """One look at every job not known lost; raises :class:`JobLost` for a loss the run cannot survive."""
        for job_id, state in (await asyncio.to_thread(self._check)).items():
            lost = self.lost.get(job_id)
            if lost is None:
                if state is not None:
                    await self._lost(job_id, state)
            elif lost.state == UNREACHABLE:
                if state is not None:  # Slurm's verdict on a job whose gateway went silent first
                    lost.state = f"{UNREACHABLE}, then {state}"
                    self.changed()
            elif state is None:
                self._back(job_id)

    async def unreachable(self, job_id: str) -> None:
        """The rollout server declared this job's gateway dead: the job is lost now (replaced if configured), not
        when Slurm finds out; raises :class:`JobLost` like any loss the run cannot survive."""
        if job_id not in self.lost and job_id in self.names:
            await self._lost(job_id, UNREACHABLE)

    def answers_again(self, job_id: str) -> None:
        """A gateway job counted lost as unreachable registered again (a partition healed): it works on; the
        sessions the server gave away meanwhile stay given away (its late results are refused)."""
        lost = self.lost.get(job_id)
        if lost is None or lost.state != UNREACHABLE:
            return
        del self.lost[job_id]
        self.requeued[job_id] = UNREACHABLE
        self.console.print(f"[yellow]{lost.role} job {job_id} ({lost.name}) answers again: the sessions the server "
                           "gave away meanwhile stay with the gateways that took them[/]", highlight=False)
        self.changed()

    def _back(self, job_id: str) -> None:
        """A job counted lost is in the queue again: Slurm requeued it after its node failed (the same job id runs
        once a node is free; a replacement, if one was submitted, runs as well)."""
        lost = self.lost.pop(job_id)
        self.requeued[job_id] = lost.state
        self.console.print(f"[yellow]{lost.role} job {job_id} ({lost.name}) requeued by Slurm after {lost.state}: it "
                           "runs again once a node is free[/]", highlight=False)
        self.changed()

    async def explain(self, timeout: float) -> None:
        """After the run failed on its own (the server stopped answering): raise :class:`JobLost` if a job loss
        is why, looking for ``timeout`` seconds (accounting lags the job's end); return if none is found."""
        deadline = time.monotonic() + timeout
        while True:
            await self.check()
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(self.interval)

    async def _lost(self, job_id: str, state: str) -> None:
        name = self.names.get(job_id, "?")
        lost = LostJob(job_id, name, role_of(name), state, time.monotonic() - self.started)
        self.lost[job_id] = lost
        replacing = lost.role == "gateway" and self.replace is not None \
            and self.replacements < self.max_replacements
        if replacing and self.replace is not None:
            self.replacements += 1
            try:
                lost.replaced_by = await asyncio.to_thread(self.replace, lost)
            except Exception as exc:  # sbatch refused: the run goes on with the gateways it has
                self.console.print(f"[yellow]could not submit a gateway in place of job {job_id}: {exc}[/]",
                                   highlight=False)
            replacing = lost.replaced_by is not None
        self.console.print(f"[bold red]{lost.line()}[/]", highlight=False)
        self.changed()
        left = sum(1 for j in self.jobs if role_of(self.names.get(j.job_id, "")) == "gateway"
                   and j.job_id not in self.lost)
        why = fatal(lost, left, replacing)
        if why is not None:
            raise JobLost(lost, why)


def _submitit_state(submitted: Any) -> str | None:
    try:
        return str(submitted.state)
    except Exception:
        return None
