"""The gateway node's scheduler: one driver task per session walks it through the staged pools.

    REGISTERED ─init slot─► INITIALIZING ─ready slot─► READY ─run slot─► RUNNING ─postrun slot─► POST_RUN
        (queued)             (deadline starts)         (warm, bounded)   (+ evaluator prewarm)    BUILDING → EVALUATING
                                                                                                  → COMPLETED | TIMEOUT
    any stage ── cancel ──► CANCELLED;   a stage that raises ──► ERROR (reason);   deadline ──► TIMEOUT

A session holds its init slot until it has a place in the READY buffer (backpressure: no more warm runtimes than
``init_workers + ready_buffer``) and its ready place until it has a run slot, so a run slot that frees up is refilled
from a runtime that is already warm. A run slot is held only while the harness runs: preparation, evaluation and
teardown never hold one. Whatever happens, teardown runs once and the session ends in a :class:`SessionResult`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

from polar_gym.causes import INVALID_TASK
from polar_gym.gateway.config import GatewayConfig
from polar_gym.gateway.errors import DeadlineExceeded, DuplicateSession, GatewayClosed, StageError, UnknownSession
from polar_gym.gateway.pools import LatencyStats, Pool, UtilizationTracker
from polar_gym.gateway.session import Session, stage_of
from polar_gym.gateway.sizing import SIZED_STAGES, NodePressure, PoolPlanner, Sizes, StageWindow
from polar_gym.gateway.stages import Stages
from polar_gym.gateway.telemetry import GatewayTelemetry
from polar_gym.runtime.base import ExecStatus
from polar_gym.runtime.errors import SandboxEnvError
from polar_gym.schema import GatewayHealth, SessionResult, SessionSpec, SessionStatus

__all__ = ["GatewayNode", "StatusListener"]

log = logging.getLogger("polar_gym.gateway")

#: called on every status change (session, new status); must not block
StatusListener = Callable[[Session, SessionStatus], None]
S = SessionStatus


class GatewayNode:
    def __init__(self, stages: Stages, config: GatewayConfig | None = None,
                 telemetry: GatewayTelemetry | None = None) -> None:
        self.stages = stages
        self.config = config or GatewayConfig()
        self.telemetry = telemetry
        c = self.config
        self.init_pool = Pool("init", c.init_workers)
        self.ready_pool = Pool("ready", c.ready_buffer)
        self.run_pool = Pool("run", c.run_slots)
        self.postrun_pool = Pool("postrun", c.postrun_workers)
        self.prewarm_pool = Pool("prewarm", c.prewarm_workers)
        self.utilization = UtilizationTracker(c.run_slots)
        #: auto sizing (``pool_sizing: auto``): plans INIT, READY and POSTRUN from the stage times seen here
        self.planner = (PoolPlanner(c.run_slots, StageWindow(max(8, 2 * c.run_slots)), max_runtimes=c.max_runtimes)
                        if c.pool_sizing == "auto" else None)
        self._pressure: tuple[float, NodePressure] | None = None
        self.latency = LatencyStats()
        self.listeners: list[StatusListener] = []
        self.finished_counts: collections.Counter[str] = collections.Counter()
        self.accepting = True
        self.draining = False
        self._sessions: dict[str, Session] = {}
        #: set (and replaced) whenever a session finishes: what a batch poll waits on
        self._any_finished = asyncio.Event()
        self._finished_order: collections.deque[str] = collections.deque()
        if self.planner is not None:
            self.resize_pools(NodePressure())  # a budget (max_runtimes) holds from the start; no reading yet

    # -- public API ------------------------------------------------------------------------------------------

    def submit(self, spec: SessionSpec) -> Session:
        """Dispatch one session; its driver starts at once and waits for an init slot. A session id that still
        runs here is refused (DuplicateSession); one that finished here starts a new attempt (the rollout server
        re-dispatches a session whose earlier attempt here it gave up, e.g. after this node was partitioned)."""
        if not self.accepting:
            raise GatewayClosed("the gateway is draining or stopped and takes no new sessions")
        earlier = self._sessions.get(spec.session_id)
        if earlier is not None and earlier.result is None:
            raise DuplicateSession(f"session {spec.session_id!r} was already dispatched to this gateway")
        if earlier is not None:  # its result was never taken (the server gave that attempt up): a new attempt
            with contextlib.suppress(ValueError):
                self._finished_order.remove(spec.session_id)
        session = Session(spec)
        self.stages.registered(session)
        self._sessions[spec.session_id] = session
        self._record(session, S.REGISTERED)
        self.utilization.change(pending=+1)
        session.task = asyncio.create_task(self._drive(session), name=f"session-{spec.session_id}")
        return session

    async def run(self, specs: list[SessionSpec]) -> list[SessionResult]:
        """Submit ``specs`` and wait for all their results (in order)."""
        sessions = [self.submit(spec) for spec in specs]
        return [await self.wait(s.session_id) for s in sessions]

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise UnknownSession(f"no session {session_id!r} on this gateway")
        return session

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    async def wait_any(self, session_ids: list[str], wait: float) -> tuple[list[SessionResult], dict[str, str],
                                                                          list[str]]:
        """One long poll for many sessions (the rollout server's watch): returns as soon as one of them has a
        result, or after ``wait`` seconds: the finished results, the others' statuses and the ids not known here.
        Why batched: one request per gateway instead of one open long-poll per session."""
        deadline = time.monotonic() + min(max(wait, 0.0), 600.0)
        while True:
            known = [s for s in (self._sessions.get(i) for i in session_ids) if s is not None]
            results = [s.result for s in known if s.result is not None]
            remaining = deadline - time.monotonic()
            if results or remaining <= 0 or not known:
                break
            finished = self._any_finished
            try:
                await asyncio.wait_for(finished.wait(), remaining)
            except TimeoutError:
                break
        statuses = {s.session_id: s.status.value for s in known if s.result is None}
        unknown = [i for i in session_ids if i not in self._sessions]
        return results, statuses, unknown

    async def wait(self, session_id: str, timeout: float | None = None) -> SessionResult:
        session = self.get(session_id)
        await asyncio.wait_for(session.done.wait(), timeout)
        assert session.result is not None
        return session.result

    def cancel(self, session_id: str, reason: str = "cancelled") -> bool:
        """Ask a live session to stop wherever it is; True if it was live. Its driver tears down and records
        CANCELLED."""
        session = self.get(session_id)
        if session.status.terminal or session.cancelled or session.task is None:
            return False
        session.cancel_reason = reason
        if session.driving:  # a task cancelled before its first step would never run its teardown
            session.task.cancel()
        return True

    def withdraw(self, session_ids: list[str]) -> list[str]:
        """Cancel the sessions among ``session_ids`` whose harness has not started (queued, INIT, READY); the ids
        cancelled. Why: the rollout server takes them back to run elsewhere (a hand-over to the next Slurm job),
        and an attempt whose harness never ran has not run. Nothing awaits between the check and the cancel, so a
        session cannot start running in between."""
        withdrawn = []
        for session_id in session_ids:
            session = self._sessions.get(session_id)
            if session is None or session.status not in (S.REGISTERED, S.INITIALIZING, S.READY):
                continue
            if self.cancel(session_id, "withdrawn by the rollout server before its harness ran"):
                withdrawn.append(session_id)
        return withdrawn

    async def drain(self, timeout: float | None = None) -> None:
        """Take no new sessions and let every dispatched one finish."""
        self.accepting, self.draining = False, True
        tasks = [s.task for s in self._sessions.values() if s.task is not None and not s.task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        await self._close_client()

    async def stop(self, reason: str = "gateway stopped") -> None:
        """Cancel every live session and wait until each is torn down."""
        self.accepting = False
        for session in list(self._sessions.values()):
            if not session.status.terminal:
                self.cancel(session.session_id, reason)
        tasks = [s.task for s in self._sessions.values() if s.task is not None and not s.task.done()]
        if tasks:
            await asyncio.wait(tasks)
        await self._close_client()

    def health(self) -> dict[str, Any]:
        """What GET /gateway/health answers and the heartbeats carry (see :meth:`health_view`)."""
        return self.health_view().model_dump(mode="json")

    def health_view(self) -> GatewayHealth:
        live = [s for s in self._sessions.values() if not s.status.terminal]
        by_status = collections.Counter(s.status.value for s in live)
        by_stage = collections.Counter(s.stage for s in live)
        pools = {p.name: p.snapshot() for p in
                 (self.init_pool, self.ready_pool, self.run_pool, self.postrun_pool, self.prewarm_pool)}
        return GatewayHealth(
            status="draining" if self.draining else ("ok" if self.accepting else "stopped"),
            accepting=self.accepting,
            live_sessions=len(live),
            statuses=dict(by_status),
            stages={name: by_stage.get(name, 0) for name in ("queued", "init", "ready", "run", "postrun")},
            queue_depths={"init": self.init_pool.waiting, "ready": self.ready_pool.waiting,
                          "run": self.run_pool.waiting, "postrun": self.postrun_pool.waiting},
            pools=pools,
            latency_seconds=self.latency.snapshot(),
            run_slot_utilization=self.utilization.snapshot(),
            finished=dict(self.finished_counts),
            runtimes_live=self.stages.live_runtimes(),
            job_id=os.environ.get("SLURM_JOB_ID"),
            dispatch_capacity=self.dispatch_capacity(),
            sizing=self.planner.last if self.planner is not None else None,
        )

    def dispatch_capacity(self) -> int:
        """Room in every stage now (see :meth:`GatewayPools.dispatch_capacity`); a self-sizing node's changes."""
        return sum(p.capacity for p in (self.init_pool, self.ready_pool, self.run_pool, self.postrun_pool))

    def resize_pools(self, pressure: NodePressure | None = None) -> None:
        """Apply the planner's sizes for the stage times seen so far (auto sizing only). Resource readings (memory,
        disk, model calls) are taken at most once a second."""
        if self.planner is None:
            return
        now = time.monotonic()
        if pressure is None:
            if self._pressure is None or now - self._pressure[0] >= 1.0:
                self._pressure = (now, self.stages.pressure())
                self.planner.observe(self._pressure[1])
            pressure = self._pressure[1]
        current = Sizes(self.init_pool.capacity, self.ready_pool.capacity, self.postrun_pool.capacity)
        before = self.planner.last
        plan = self.planner.plan(current, pressure)
        for why in ("limited_by", "engine"):  # the reasons are news, the sizes are not (they change often)
            if getattr(plan, why) is not None and (before is None or getattr(before, why) != getattr(plan, why)):
                log.info("pools: %s", plan.engine if why == "engine" else plan.reason)
        if (plan.init_workers, plan.ready_buffer, plan.postrun_workers) != (current.init_workers,
                                                                             current.ready_buffer,
                                                                             current.postrun_workers):
            log.debug("pools resized: init %d -> %d, ready %d -> %d, postrun %d -> %d (stage means %s)",
                      current.init_workers, plan.init_workers, current.ready_buffer, plan.ready_buffer,
                      current.postrun_workers, plan.postrun_workers, plan.stage_means)
            self._apply(plan.init_workers, plan.ready_buffer, plan.postrun_workers)
            if (self.init_pool.capacity, self.ready_pool.capacity, self.postrun_pool.capacity) != (
                    current.init_workers, current.ready_buffer, current.postrun_workers):
                self.planner.applied()

    def _apply(self, *targets: int) -> None:
        """Resize INIT, READY and POSTRUN: shrinks at once, growth only into room the budget has now. Why: a shrunk
        pool's holders keep their slots until they leave, so growing another pool at once would put more sandboxes
        on the node than ``max_runtimes`` for a while."""
        pools = (self.init_pool, self.ready_pool, self.postrun_pool)
        for pool, target in zip(pools, targets, strict=True):
            if target < pool.capacity:
                pool.resize(target)
        room = None
        if self.config.max_runtimes is not None:
            budget = max(3, self.config.max_runtimes - self.run_pool.capacity)
            room = budget - sum(max(p.capacity, p.busy) for p in pools)
        for pool, target in zip(pools, targets, strict=True):
            if target > pool.capacity:
                if room is not None:
                    occupied = max(pool.capacity, pool.busy)
                    target = min(target, occupied + max(0, room)) if target > occupied else target
                    room -= max(target, pool.busy) - occupied
                pool.resize(max(pool.capacity, target))

    # -- the driver ------------------------------------------------------------------------------------------

    async def _drive(self, s: Session) -> None:
        held: list[Pool] = []
        started = time.monotonic()
        s.driving = True
        try:
            for step in (self._init, self._ready, self._run, self._postrun):
                if s.cancelled:  # a cancel that landed between two awaits is honoured at the next stage
                    raise asyncio.CancelledError
                await step(s, held)
            if s.timed_out:
                self._end(s, S.TIMEOUT, s.reason)
            elif s.problem:
                self._end(s, S.ERROR, s.problem)
            else:
                self._end(s, S.COMPLETED, None)
        except asyncio.CancelledError:
            self._uncancel()
            self._end(s, S.CANCELLED, f"{s.cancel_reason or 'cancelled'} (in {s.stage})")
        except DeadlineExceeded as exc:
            self._end(s, S.TIMEOUT, exc.message)
        except StageError as exc:
            self._end(s, S.ERROR, f"{exc.stage}: {exc.message}")
        except SandboxEnvError as exc:  # the task's own env names what a host loader reads: the task is at fault
            self._end(s, S.ERROR, f"{INVALID_TASK}: {exc} (in {s.stage})")
        except Exception as exc:  # fault isolation: a bug or a failing plug-in ends this session only
            log.warning("session %s failed in %s", s.session_id, s.stage, exc_info=True)
            self._end(s, S.ERROR, f"{s.stage}: {exc.__class__.__name__}: {exc}")
        finally:
            for pool in held:
                pool.release()
            held.clear()
        if s.status in (S.ERROR, S.TIMEOUT) and s.trajectory is None and _reached(s, S.RUNNING):
            await self._shielded(self._salvage(s))
        await self._shielded(self._teardown(s))
        s.timings["total"] = time.monotonic() - started
        self.latency.add("total", s.timings["total"])
        await self._shielded(self._finish(s))

    async def _init(self, s: Session, held: list[Pool]) -> None:
        t0 = time.monotonic()
        await self._acquire(s, self.init_pool, held, deadline=False)
        s.timings["queued"] = time.monotonic() - t0
        s.start_deadline()
        self._set(s, S.INITIALIZING)
        await self._timed(s, "init", self.stages.init(s), s.remaining())

    async def _ready(self, s: Session, held: list[Pool]) -> None:
        self._set(s, S.READY)
        t0 = time.monotonic()
        if self.ready_pool.capacity > 0:
            await self._acquire(s, self.ready_pool, held)
            self._release(self.init_pool, held)
        await self._acquire(s, self.run_pool, held)
        self._release(self.init_pool, held)
        self._release(self.ready_pool, held)
        s.timings["ready_wait"] = time.monotonic() - t0
        s.refund(s.timings["ready_wait"])  # bounded by the deadline (above), not charged to it
        self.latency.add("ready_wait", s.timings["ready_wait"])

    async def _run(self, s: Session, held: list[Pool]) -> None:
        self._set(s, S.RUNNING)
        self.utilization.change(running=+1, pending=-1)
        try:
            if self.stages.wants_prewarm(s):
                s.prewarm_task = asyncio.create_task(self._prewarm(s), name=f"prewarm-{s.session_id}")
            try:
                await self._timed(s, "run", self.stages.run(s), s.remaining() + self.config.run_grace_seconds)
            except DeadlineExceeded:
                s.timed_out = True
                s.reason = "the harness was stopped at the deadline (the runtime did not stop it in time)"
        finally:
            self.utilization.change(running=-1)
            self._release(self.run_pool, held)
        result = s.harness_result
        if result is not None and result.status is ExecStatus.TIMEOUT:
            s.timed_out = True
            s.reason = f"the harness was killed at the deadline after {result.seconds:.1f} s; partial traces kept"
        elif result is not None and result.status is ExecStatus.CANCELLED:
            s.problem = "the harness was cancelled by its runtime"
        elif result is not None and result.status is ExecStatus.CRASHED:
            s.problem = f"the harness's sandbox crashed: {result.reason}"

    async def _prewarm(self, s: Session) -> None:
        held: list[Pool] = []
        try:
            await self._acquire(s, self.prewarm_pool, held)
            await self._timed(s, "prewarm", self.stages.prewarm(s), s.remaining())
        finally:
            for pool in held:
                pool.release()

    async def _postrun(self, s: Session, held: list[Pool]) -> None:
        self._set(s, S.POST_RUN)
        loop = asyncio.get_running_loop()
        assert s.deadline is not None
        end = max(s.deadline, loop.time()) + self.config.postrun_grace_seconds  # the POSTRUN budget ends here
        t0 = time.monotonic()
        scope = asyncio.timeout_at(end)
        try:
            async with scope:
                await self._acquire(s, self.postrun_pool, held, deadline=False)
                self._set(s, S.BUILDING)
                await self._timed(s, "build", self.stages.build(s), None)
                if s.timed_out and not self.config.evaluate_on_timeout:
                    return
                self._set(s, S.EVALUATING)
                if s.prewarm_task is not None:
                    try:
                        await s.prewarm_task
                    except StageError as exc:
                        raise StageError("evaluate", f"the fresh evaluation runtime failed: {exc.message}") from exc
                    except Exception as exc:
                        raise StageError("evaluate", f"the fresh evaluation runtime failed: "
                                         f"{exc.__class__.__name__}: {exc}") from exc
                await self._timed(s, "evaluate", self.stages.evaluate(s), None)
        except TimeoutError as exc:
            if not scope.expired():
                raise
            raise DeadlineExceeded("postrun", f"POSTRUN did not finish within {self.config.postrun_grace_seconds} "
                                   f"s past the deadline (in {s.stage})") from exc
        finally:
            self._release(self.postrun_pool, held)
            s.timings["postrun"] = time.monotonic() - t0
            self.latency.add("postrun", s.timings["postrun"])

    async def _salvage(self, s: Session) -> None:
        """A session that failed after its harness started still returns the traces it captured (invariant 2)."""
        try:
            async with asyncio.timeout(self.config.teardown_timeout_seconds):
                await self.stages.build(s)
        except Exception:
            log.warning("could not build the partial trajectory of session %s", s.session_id, exc_info=True)

    async def _teardown(self, s: Session) -> None:
        t0 = time.monotonic()
        if s.prewarm_task is not None and not s.prewarm_task.done():
            s.prewarm_task.cancel()
        if s.prewarm_task is not None:
            await asyncio.gather(s.prewarm_task, return_exceptions=True)
        try:
            async with asyncio.timeout(self.config.teardown_timeout_seconds):
                await self.stages.teardown(s)
        except Exception:
            log.exception("teardown of session %s failed", s.session_id)
            s.artifacts["teardown_error"] = "teardown failed or timed out; see the gateway log"
        s.timings["teardown"] = time.monotonic() - t0
        self.latency.add("teardown", s.timings["teardown"])

    async def _finish(self, s: Session) -> None:
        """Publish the result; then hooks and telemetry, outside every pool (a result goes back only through the
        rollout server, never to a URL a task names)."""
        if not _reached(s, S.RUNNING):
            self.utilization.change(pending=-1)
        try:
            result = s.to_result()
        except Exception as exc:  # never leave a waiter without a result
            log.exception("could not assemble the result of session %s", s.session_id)
            result = SessionResult(session_id=s.session_id, task_id=s.spec.task_id, status=S.ERROR,
                                   reason=f"could not assemble the result: {exc.__class__.__name__}: {exc}",
                                   timings=dict(s.timings))
        try:
            await self.stages.finished(s, result)
        except Exception:
            log.exception("stages.finished failed for session %s", s.session_id)
        s.result = result
        s.shed()
        s.done.set()
        self._any_finished.set()
        self._any_finished = asyncio.Event()
        self.finished_counts[s.status.value] += 1
        self._finished_order.append(s.session_id)
        while len(self._finished_order) > self.config.max_finished:
            self._sessions.pop(self._finished_order.popleft(), None)
        for hook in self.config.hooks:
            try:
                out = hook(result)
                if inspect.isawaitable(out):
                    await out
            except Exception:
                log.exception("result hook failed for session %s", s.session_id)
        if self.telemetry is not None:  # spans last: never ahead of the result
            await self.telemetry.finished(s, result)

    async def _close_client(self) -> None:
        if self.telemetry is not None:
            await self.telemetry.close()

    # -- helpers ---------------------------------------------------------------------------------------------

    async def _acquire(self, s: Session, pool: Pool, held: list[Pool], deadline: bool = True) -> None:
        if not deadline:
            await pool.acquire()
        else:
            # asyncio.timeout, not wait_for: 3.11's wait_for drops a cancel that arrives as the inner call completes
            scope = asyncio.timeout(s.remaining())
            try:
                async with scope:
                    await pool.acquire()
            except TimeoutError as exc:
                if not scope.expired():
                    raise
                raise DeadlineExceeded(s.stage, f"the deadline passed while waiting for a {pool.name} slot "
                                       f"(in {s.stage})") from exc
        held.append(pool)

    @staticmethod
    def _release(pool: Pool, held: list[Pool]) -> None:
        if pool in held:
            held.remove(pool)
            pool.release()

    async def _timed(self, s: Session, stage: str, work: Coroutine[Any, Any, None], timeout: float | None) -> None:
        """Run one stage function under ``timeout`` (DeadlineExceeded when it is ours that fired)."""
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(timeout) as scope:
                await work
        except TimeoutError as exc:
            if scope.expired():
                raise DeadlineExceeded(stage, f"the deadline passed during {stage}") from exc
            raise
        else:
            if self.planner is not None and stage in SIZED_STAGES:  # a stage cut short says nothing of its length
                self.planner.window.add(stage, time.monotonic() - t0)
                self.resize_pools()
        finally:
            s.timings[stage] = time.monotonic() - t0
            self.latency.add(stage, s.timings[stage])

    def _set(self, s: Session, status: SessionStatus) -> None:
        s.status = status
        self._record(s, status)

    def _record(self, s: Session, status: SessionStatus) -> None:
        s.history.append({"status": status.value, "stage": stage_of(status), "at": time.time()})
        for listener in self.listeners:
            try:
                listener(s, status)
            except Exception:
                log.exception("status listener failed")

    def _end(self, s: Session, status: SessionStatus, reason: str | None) -> None:
        s.reason = reason
        self._set(s, status)

    @staticmethod
    def _uncancel() -> None:
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()

    @staticmethod
    async def _shielded(work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` to its end even if this task is cancelled meanwhile (teardown must not be cut short)."""
        task = asyncio.ensure_future(work)
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                GatewayNode._uncancel()
        task.result()


def _reached(s: Session, status: SessionStatus) -> bool:
    return any(h["status"] == status.value for h in s.history)
