"""The part every launcher shares: submit a job's tasks to a rollout server, show a live view of the fleet while
they run (sessions by stage from the gateways' heartbeats, rewards, throughput), and gather one SessionOutcome per
session. Why through the server even on one machine: the local run then exercises exactly the path a cluster run
takes (dispatch, heartbeats, durable store), and its API stays open for a trainer or a curious user."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import signal
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from polar_gym.launch.config import LaunchJob
from polar_gym.launch.outputs import SessionOutcome
from polar_gym.schema import SessionResult, SessionSpec, TaskRequest
from polar_gym.server.client import RolloutClient

__all__ = ["RunDriver", "fleet_in_flight", "outcome_of", "run_job", "sigterm_cancels_run"]

_STAGES = ["queued", "init", "ready", "run", "postrun"]
_FINISHED = {"COMPLETED", "ERROR", "CANCELLED", "TIMEOUT"}


@contextlib.contextmanager
def sigterm_cancels_run() -> Iterator[None]:
    """SIGTERM (kill, scancel of a launcher running as a job) cancels the running task like Ctrl-C does, so the
    run's tasks are cancelled on the server and its gateways and jobs are stopped before the process ends."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def outcome_of(request: TaskRequest, result: SessionResult, waited: float) -> SessionOutcome:
    """A SessionOutcome from a server-side result: the spec is rebuilt from the task (with the real session id),
    the completion count comes from the gateway's artifacts and the seconds from its own total timing."""
    sample_index = int(result.metadata.get("sample_index", 0))
    spec = SessionSpec.from_task(request, sample_index).model_copy(update={"session_id": result.session_id})
    artifacts = result.metadata.get("artifacts") or {}
    completions = artifacts.get("completions", 0) if isinstance(artifacts, dict) else 0
    return SessionOutcome(spec, result, int(completions or 0), float(result.timings.get("total", waited)))


class RunDriver:
    """Submit, watch and gather through one RolloutClient. ``run`` can be called again (a datagen retry round)."""

    def __init__(self, client: RolloutClient, console: Console | None = None, *, progress: bool = True,
                 poll_seconds: float = 0.5) -> None:
        self.client = client
        self.console = console or Console(stderr=True)
        self.progress = progress
        self.poll_seconds = poll_seconds
        self.stages: dict[str, int] = {}
        self.gateways = 0
        #: set by a hand-over to a successor job (polar_gym.launch.relaunch): ``run`` returns the tasks finished so
        #: far and cancels nothing (the successor runs the rest from the store)
        self.handed_over = False

    async def run(self, requests: list[TaskRequest]) -> tuple[list[SessionOutcome], float]:
        """Every session of ``requests`` finished (in request then sample order) and the wall time. On
        cancellation (Ctrl-C) the tasks still running are cancelled on the server before the error propagates."""
        started = time.monotonic()
        by_id = {r.task_id: r for r in requests}
        total = sum(r.num_samples for r in requests)
        outcomes: dict[str, list[SessionOutcome]] = {}
        bar = Progress(TextColumn("[bold]sessions"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       console=self.console)
        bar_task = bar.add_task("sessions", total=total)
        live = Live(self._view(bar, outcomes, started), console=self.console, refresh_per_second=4)
        try:
            for request in requests:  # inside the try: a Ctrl-C while submitting cancels what was submitted
                await self.client.submit(request)
            with live if self.progress else contextlib.nullcontext():
                while len(outcomes) < len(requests):
                    for task_id in [t for t in by_id if t not in outcomes]:
                        view = await self.client.status(task_id)
                        if view["status"] in _FINISHED:
                            outcomes[task_id] = self._outcomes(by_id[task_id], view, time.monotonic() - started)
                    await self._fleet()
                    bar.update(bar_task, completed=sum(len(o) for o in outcomes.values()))
                    live.update(self._view(bar, outcomes, started))
                    pending = len(requests) - len(outcomes)
                    if self.handed_over:
                        break
                    if pending:  # one status call per pending task per round: slow down for big runs
                        await asyncio.sleep(max(self.poll_seconds, pending * 0.002))
        except (asyncio.CancelledError, KeyboardInterrupt):
            await asyncio.shield(self._cancel([t for t in by_id if t not in outcomes]))
            raise
        ordered = [o for r in requests if r.task_id in outcomes
                   for o in sorted(outcomes[r.task_id], key=lambda o: o.spec.sample_index)]
        return ordered, time.monotonic() - started

    @staticmethod
    def _outcomes(request: TaskRequest, view: dict[str, Any], waited: float) -> list[SessionOutcome]:
        return [outcome_of(request, SessionResult.model_validate(r), waited) for r in view["results"]]

    async def _cancel(self, task_ids: list[str]) -> None:
        for task_id in task_ids:
            with contextlib.suppress(Exception):
                await self.client.cancel(task_id)

    async def _fleet(self) -> None:
        """Sessions by stage, summed over the gateways' last heartbeats (best effort: the view is cosmetic)."""
        try:
            gateways = await self.client.gateways()
        except Exception:
            return
        stages: collections.Counter[str] = collections.Counter()
        for gw in gateways:
            if gw.get("state") != "dead":
                stages.update((gw.get("health") or {}).get("stages") or {})
        self.stages, self.gateways = dict(stages), sum(g.get("state") != "dead" for g in gateways)

    def _view(self, bar: Progress, outcomes: dict[str, list[SessionOutcome]], started: float) -> Group:
        done = [o for group in outcomes.values() for o in group]
        statuses = collections.Counter(o.result.status.value for o in done)
        rewards = [o.reward for o in done if o.reward is not None]
        elapsed = max(time.monotonic() - started, 1e-9)
        finished = ", ".join(f"{k.lower()} {v}" for k, v in sorted(statuses.items())) or "none yet"
        mean = f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"
        stage_line = (f"gateways [bold]{self.gateways}[/] · stages: "
                      + " · ".join(f"{name} [bold]{self.stages.get(name, 0)}[/]" for name in _STAGES))
        rate = len(done) / elapsed * 60
        result_line = f"finished: {finished} · mean reward [bold]{mean}[/] · {rate:.1f} sessions/min"
        return Group(bar, stage_line, result_line)

    async def unfinished(self, requests: list[TaskRequest]) -> int:
        """Sessions of ``requests`` without a result yet, as the rollout server counts them."""
        left = 0
        for request in requests:
            view = await self.client.status(request.task_id)
            left += request.num_samples - len(view.get("results") or [])
        return left

    async def in_flight(self) -> int:
        return await fleet_in_flight(self.client)


async def fleet_in_flight(client: RolloutClient) -> int:
    """Sessions the gateways run now, as the rollout server counts them."""
    return sum(int(gw.get("in_flight") or 0) for gw in await client.gateways() if gw.get("state") != "dead")


async def run_job(driver: RunDriver, job: LaunchJob) -> tuple[list[SessionOutcome], float]:
    """Every task of the job; for a datagen run, the empty generations once more (paper §4.2: one retry). With a
    relay (a run inside a Slurm job with a time limit), the tasks finished when it hands over, ``job.handover`` set."""
    if job.relay is None:
        outcomes, wall = await driver.run(job.requests)
    else:
        work = asyncio.ensure_future(driver.run(job.requests))
        unfinished = functools.partial(driver.unfinished, job.requests)
        watch = asyncio.ensure_future(job.relay.watch(driver.client, driver.in_flight, unfinished))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            for future in (work, watch):
                future.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)
            raise
        if not work.done():
            try:
                job.handover = watch.result()
            except BaseException:  # a hand-over that failed stops the run (its unfinished tasks are cancelled)
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                raise
            driver.handed_over = job.handover is not None
        else:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        outcomes, wall = await work
        if job.handover is not None:
            return outcomes, wall
    if job.datagen is not None and job.datagen.retry_empty:
        from polar_gym.datagen import retry_plan, retry_requests

        retries = retry_requests(retry_plan([o.result for o in outcomes]), job.requests)
        if retries:
            driver.console.print(f"datagen: retrying {sum(r.num_samples for r in retries)} empty generation(s) once")
            more, extra = await driver.run(retries)
            outcomes, wall = outcomes + more, wall + extra
    return outcomes, wall
