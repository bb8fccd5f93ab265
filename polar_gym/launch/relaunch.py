"""Runs that outlive a Slurm job's time limit: before the limit, the launch hands over to a successor job.

A run started inside a Slurm batch job (``sbatch --wrap 'python -m polar_gym.launch ...'``) learns the job's time
left from ``squeue``. ``relaunch.margin_seconds`` before the limit it hands over:

1. every gateway is drained through the rollout server: no new session starts, the sessions not yet running
   (queued, INIT, READY) are withdrawn to the store's queue with their attempt refunded, the running ones finish
   (the margin should exceed a session's timeout; a session still running at the limit is re-run by the
   successor, and the hand-over row says so);
2. the rollout server's store is the checkpoint (it is durable by design: tasks, sessions, results);
3. the successor is submitted with ``sbatch --dependency=afterany:THIS_JOB``, the same command with
   ``out_dir=THE_SAME resume=true``, the same partition, time limit, nodes, CPUs, memory and GPUs (``--gres``); it
   starts when this job ends, takes the unfinished sessions from the store and runs them. Nothing finished runs
   again.

A GRPO run (``+trainer=grpo``) hands over at a step boundary, its trainer state saved after each step
(:mod:`polar_gym.trainer.resume`; :func:`polar_gym.launch.training._handing_over`). Every hand-over appends a row to
``out_dir/relaunches.jsonl``. Why not ``scontrol requeue``: a requeued job runs
the same command, and the default ``out_dir`` is a timestamp, so the run would start afresh in a new folder.

``SIGUSR1`` starts the hand-over at once, whatever the time left: Slurm's own notice (``sbatch
--signal=B:USR1@SECONDS``), a site's preemption warning, or a user's ``scancel --batch --signal=USR1 JOB``. The
successor's batch script runs the launch with ``exec``, so such a signal reaches it, not a shell that would die of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from polar_gym.private_files import open_private

__all__ = [
    "COUNT_ENV",
    "HAND_OVER_SIGNAL",
    "HandOver",
    "RelaunchSettings",
    "Relay",
    "parse_time_left",
    "relay_for",
    "sbatch_argv",
    "successor_argv",
]

log = logging.getLogger(__name__)

#: how many hand-overs came before this job (set by the predecessor on its successor)
COUNT_ENV = "POLAR_RELAUNCH_COUNT"
#: the run's file of hand-overs, one JSON line each
RELAUNCHES = "relaunches.jsonl"
#: the signal that starts a hand-over now (what ``sbatch --signal=B:USR1@SECONDS`` sends to the batch script)
HAND_OVER_SIGNAL = signal.SIGUSR1


class RelaunchSettings(BaseModel):
    """The ``relaunch`` keys."""

    model_config = ConfigDict(extra="forbid")

    enabled: Literal["auto", "true", "false"] | bool = Field(
        default="auto", description="auto: hand over before the time limit when the launch runs inside a Slurm job "
        "that has one; true: the same, and a launch outside such a job is refused; false: never")
    margin_seconds: float = Field(default=900.0, gt=0, description="the hand-over starts this long before the "
                                  "job's time limit: no session starts after it, the running ones finish (make it "
                                  "longer than a session's timeout, or those still running are re-run)")
    max_relaunches: int = Field(default=100, ge=0, description="hand-overs allowed in one run (a run that makes no "
                                "progress in a job stops instead of handing over forever)")

    @property
    def wanted(self) -> bool | None:
        """True: required; None: if possible; False: off."""
        return {"auto": None, "true": True, "false": False, True: True, False: False}[self.enabled]


def parse_time_left(text: str) -> float | None:
    """Seconds from squeue's ``%L`` (``MM:SS``, ``HH:MM:SS``, ``D-HH:MM:SS``); None for no limit (UNLIMITED,
    NOT_SET, INVALID) or a shape Slurm does not print."""
    text = text.strip()
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text)
    if match is None:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


@dataclass(frozen=True)
class SlurmJob:
    """What this launch knows of the batch job it runs in."""

    job_id: str
    time_left: float
    time_limit: str  # as squeue prints it (sbatch --time takes the same forms)
    partition: str | None
    name: str | None
    account: str | None
    qos: str | None
    gres: str | None = None  # the generic resources per node it asked for (GPUs), as sbatch --gres takes them
    nodes: str | None = None


def current_job(run: Callable[[list[str]], str] | None = None) -> SlurmJob | None:
    """The Slurm job this process runs in, if it has a time limit (None outside Slurm, or without a limit)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    run = run or _squeue
    try:
        line = run(["squeue", "-h", "-j", job_id, "-o", "%L|%l|%P|%j|%a|%q|%b|%D"]).strip().splitlines()
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("relaunch: squeue could not say job %s's time left: %s", job_id, exc)
        return None
    if not line:
        return None
    left, limit, partition, name, account, qos, gres, nodes = (line[0].split("|") + [""] * 8)[:8]
    seconds = parse_time_left(left)
    if seconds is None:
        return None

    def given(value: str) -> str | None:
        return value if value and value not in ("(null)", "N/A") else None

    return SlurmJob(job_id, seconds, limit.strip(), given(partition), given(name), given(account), given(qos),
                    _gres(given(gres)), given(nodes.strip()))


def _gres(text: str | None) -> str | None:
    """squeue's ``%b`` (``gres/gpu:4``, ``gres:gpu:4`` or ``gpu:4``, comma-separated) as ``--gres`` takes it."""
    if text is None:
        return None
    parts = [re.sub(r"^gres[/:]", "", p.strip()) for p in text.split(",") if p.strip()]
    return ",".join(parts) or None


def _squeue(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout


def successor_argv(argv: Sequence[str], out_dir: Path) -> list[str]:
    """The successor's command: this launch's overrides with ``out_dir`` pinned and ``resume=true``."""
    kept = [a for a in argv if not re.match(r"^\+{0,2}(out_dir|resume)=", a)]
    return [sys.executable, "-m", "polar_gym.launch", *kept, f"out_dir={out_dir.resolve()}", "resume=true"]


def sbatch_argv(job: SlurmJob, command: list[str], out_dir: Path, count: int, workdir: Path) -> list[str]:
    """``sbatch`` for the successor: after this job ends, with its resources (partition, time limit, nodes, CPUs,
    memory, generic resources such as GPUs; the environment is exported, as sbatch does by default, with the
    hand-over count). Its batch script runs the launch with ``exec``, so a signal to the script (``--signal=B:...``,
    ``scancel --batch``) reaches the launch."""
    argv = ["sbatch", "--parsable", f"--dependency=afterany:{job.job_id}", f"--time={job.time_limit}",
            f"--chdir={workdir}", f"--output={out_dir.resolve() / 'relaunch-%j.log'}",
            f"--export=ALL,{COUNT_ENV}={count}"]
    for flag, value in (("--partition", job.partition), ("--job-name", job.name), ("--account", job.account),
                        ("--qos", job.qos), ("--nodes", job.nodes), ("--gres", job.gres),
                        ("--cpus-per-task", os.environ.get("SLURM_CPUS_PER_TASK")), ("--mem", _mem())):
        if value:
            argv.append(f"{flag}={value}")
    return [*argv, "--wrap", f"exec {shlex.join(command)}"]  # the batch script becomes the launch: signals reach it


def _mem() -> str | None:
    mem = os.environ.get("SLURM_MEM_PER_NODE")
    return f"{mem}M" if mem and mem.isdigit() else None


class HandOver(Exception):
    """The run handed over to a successor job (not an error: the successor finishes the run)."""

    def __init__(self, successor: str, row: dict[str, Any]) -> None:
        super().__init__(f"handed over to Slurm job {successor}")
        self.successor, self.row = successor, row


class Relay:
    """Watches the job's time left during a run and hands over at ``margin_seconds`` before the limit."""

    def __init__(self, settings: RelaunchSettings, job: SlurmJob, out_dir: Path, argv: Sequence[str], *,
                 count: int = 0, submit: Callable[[list[str]], str] | None = None) -> None:
        self.settings, self.job, self.out_dir, self.argv, self.count = settings, job, out_dir, list(argv), count
        self.started = time.monotonic()
        self.deadline = self.started + job.time_left  # the job's limit on this process's clock
        self.submit = submit or _sbatch

    @property
    def handover_at(self) -> float:
        return self.deadline - self.settings.margin_seconds

    async def watch(self, client: Any, in_flight: Callable[[], Any],
                    unfinished: Callable[[], Any] | None = None) -> HandOver | None:
        """Wait for the hand-over time (or :data:`HAND_OVER_SIGNAL`), drain the fleet, wait for the running sessions
        (until a few seconds before the limit), submit the successor; the hand-over, or None when the run finished
        meanwhile (``unfinished`` answers 0: nothing is left for a successor)."""
        trigger = await self._hand_over_time()
        log.warning("relaunch: %s, %.0f s left in job %s: draining the fleet, then handing over", trigger,
                    self.left(), self.job.job_id)
        gateways = await client.gateways()
        for gw in gateways:
            if gw.get("state") == "healthy":
                await client.drain_gateway(gw["gateway_id"], withdraw=True)
        running = await in_flight()
        while running and self.left() > 15.0:
            await asyncio.sleep(min(0.5, max(0.1, self.left() - 15.0)))
            running = await in_flight()
        if unfinished is not None and not await unfinished():
            log.warning("relaunch: every session finished while draining: no successor needed")
            return None
        command = successor_argv(self.argv, self.out_dir)
        successor = await asyncio.to_thread(self.submit, sbatch_argv(self.job, command, self.out_dir,
                                                                     self.count + 1, Path.cwd()))
        row = {"job_id": self.job.job_id, "successor": successor, "relaunch": self.count + 1, "at": time.time(),
               "seconds_in_job": round(time.monotonic() - self.started, 1), "trigger": trigger, "cut_sessions": running,
               "command": command}
        with open_private(self.out_dir / RELAUNCHES, "a") as f:
            f.write(json.dumps(row) + "\n")
        return HandOver(successor, row)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    async def _hand_over_time(self) -> str:
        """Wait for ``margin_seconds`` before the limit or for :data:`HAND_OVER_SIGNAL`, whichever comes first; what
        it was. The signal stays caught (and a repeat ignored) while the loop lives: its default action would end the
        launch in the middle of its hand-over."""
        now, loop = asyncio.Event(), asyncio.get_running_loop()
        try:
            loop.add_signal_handler(HAND_OVER_SIGNAL, now.set)
        except (RuntimeError, ValueError, NotImplementedError) as exc:  # not the main thread's loop
            log.warning("relaunch: %s will not start a hand-over here (%s)", HAND_OVER_SIGNAL.name, exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(now.wait(), max(0.0, self.handover_at - time.monotonic()))
        return HAND_OVER_SIGNAL.name if now.is_set() else "the time limit"


def _sbatch(argv: list[str]) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"sbatch of the successor job failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    return out.stdout.strip().split(";")[0]


def relay_for(settings: RelaunchSettings, out_dir: Path, argv: Sequence[str],
              job: SlurmJob | None = None) -> tuple[Relay | None, str | None]:
    """The run's relay (None: no hand-over) and a line for the console; raises ValueError when ``enabled: true``
    cannot be honoured (outside a Slurm job with a limit, or a limit inside the margin)."""
    wanted = settings.wanted
    if wanted is False:
        return None, None
    job = job if job is not None else current_job()
    count = int(os.environ.get(COUNT_ENV, "0") or 0)
    if job is None:
        if wanted:
            raise ValueError("relaunch.enabled=true needs a Slurm batch job with a time limit (none found: "
                             "SLURM_JOB_ID unset, or squeue shows no limit)")
        return None, None
    if job.time_left < settings.margin_seconds + 10:
        why = (f"job {job.job_id} has {job.time_left:.0f} s left, too close to relaunch.margin_seconds="
               f"{settings.margin_seconds:.0f} to do work before handing over")
        if wanted:
            raise ValueError(why)
        return None, f"relaunch off: {why}"
    if count >= settings.max_relaunches:
        return None, (f"relaunch off: {count} hand-overs already (relaunch.max_relaunches="
                      f"{settings.max_relaunches}); this job finishes what it can")
    relay = Relay(settings, job, out_dir, argv, count=count)
    return relay, (f"relaunch: job {job.job_id} hands over {settings.margin_seconds:.0f} s before its limit "
                   f"(in {relay.handover_at - time.monotonic():.0f} s); hand-over {count} so far")
