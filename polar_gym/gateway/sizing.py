"""Pools that size themselves: INIT, READY and POSTRUN sized from the stage times the node observes, so its run slots
stay busy without a hand-set pool size.

Why Little's law and not a controller on slot use: the run slots consume ``run_slots / mean(RUN)`` sessions a
second at steady state, so INIT needs that rate times ``mean(INIT)`` workers busy to keep up (and POSTRUN likewise),
plus headroom for jitter. That is the rule an operator applies by hand from known stage means; here the means are
the recent window's, so a workload whose stage times change mid-run (an image cache that warms, a test suite that
grows) is followed within a window of sessions. A feedback loop on slot use would oscillate: slot use reacts to a
pool change only an INIT time later.

Each held slot holds a runtime (a sandbox), so growth stops at the node's limits: ``max_runtimes``, free memory,
free disk. The plan says which limit held it, and when run slots are full but the engine is the bottleneck (model
calls much slower than the best seen), it says that too: more sessions would not run faster.

The functions here are pure (observations in, a plan out); :class:`~polar_gym.gateway.node.GatewayNode` feeds
them and applies the plan to its pools.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

from polar_gym.schema import PoolSizing

__all__ = ["NodePressure", "PoolPlanner", "Sizes", "StageWindow", "plan_pools"]

#: the stages whose times size the pools (POSTRUN's work is build + evaluate; teardown holds no slot)
SIZED_STAGES = ("init", "run", "build", "evaluate")
#: workers per steady-state need: covers the jitter of stage times around their mean
HEADROOM = 1.25
#: a model call this many times slower than the best window seen: the engine, not the pools, is the limit
ENGINE_SLOW_FACTOR = 2.0


class StageWindow:
    """The last ``size`` durations of each stage, with running sums (a mean is O(1))."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self._samples: dict[str, collections.deque[float]] = {s: collections.deque() for s in SIZED_STAGES}
        self._sums: dict[str, float] = dict.fromkeys(SIZED_STAGES, 0.0)

    def add(self, stage: str, seconds: float) -> None:
        samples = self._samples.get(stage)
        if samples is None or not math.isfinite(seconds) or seconds < 0:
            return
        samples.append(seconds)
        self._sums[stage] += seconds
        if len(samples) > self.size:
            self._sums[stage] -= samples.popleft()

    def count(self, stage: str) -> int:
        return len(self._samples[stage])

    def mean(self, stage: str) -> float | None:
        n = len(self._samples[stage])
        return max(0.0, self._sums[stage] / n) if n else None


@dataclass(frozen=True)
class NodePressure:
    """What the node's stages report about its resources (``None``: not known, never a limit)."""

    memory_available_mb: float | None = None
    disk_free_mb: float | None = None
    #: mean seconds of the model calls finished since the last reading, and how many there were
    model_call_seconds: float | None = None
    model_calls: int = 0


@dataclass(frozen=True)
class Sizes:
    init_workers: int
    ready_buffer: int
    postrun_workers: int


def plan_pools(means: dict[str, float | None], run_slots: int, current: Sizes, *, max_runtimes: int | None,
               pressure: NodePressure, memory_reserve_mb: float, disk_reserve_mb: float) -> PoolSizing:
    """The pool sizes the observed stage means call for, within the node's limits, and why they are what they are.
    Pure: same inputs, same plan."""
    run, init = means.get("run"), means.get("init")
    warming = run is None or init is None
    if warming:
        wanted = current
    else:
        post = (means.get("build") or 0.0) + (means.get("evaluate") or 0.0)
        rate = run_slots / max(run or 0.0, 1e-3)  # sessions a second the run slots take at steady state
        wanted = Sizes(init_workers=max(1, math.ceil(HEADROOM * rate * (init or 0.0))),
                       ready_buffer=max(1, math.ceil(run_slots / 2)),
                       postrun_workers=max(1, math.ceil(HEADROOM * rate * post)))
    sizes, limited_by = wanted, None
    reason = "warming up: no INIT and RUN measured yet, the configured sizes stand" if warming else None
    if max_runtimes is not None:
        budget = max(3, max_runtimes - run_slots)  # each INIT, READY and POSTRUN slot holds a runtime
        if _total(sizes) > budget:
            sizes = _fit(sizes, budget)
            limited_by = "max_runtimes"
            reason = (f"max_runtimes={max_runtimes} leaves {budget} runtimes beside the {run_slots} run slots; "
                      f"{_total(wanted)} are wanted")
    held = _held(pressure, memory_reserve_mb, disk_reserve_mb)
    if held is not None:
        grown = Sizes(*(min(new, old) for new, old in zip(_tuple(sizes), _tuple(current), strict=True)))
        if grown != sizes:
            sizes, (limited_by, reason) = grown, held
    return PoolSizing(init_workers=sizes.init_workers, ready_buffer=sizes.ready_buffer,
                      postrun_workers=sizes.postrun_workers,
                      wanted={"init_workers": wanted.init_workers, "ready_buffer": wanted.ready_buffer,
                              "postrun_workers": wanted.postrun_workers},
                      stage_means=_rounded(means), limited_by=limited_by, reason=reason)


def _held(pressure: NodePressure, memory_reserve_mb: float, disk_reserve_mb: float) -> tuple[str, str] | None:
    """Why the pools may not grow now (they may still shrink), if something says so."""
    if pressure.memory_available_mb is not None and pressure.memory_available_mb < memory_reserve_mb:
        return "memory", (f"{pressure.memory_available_mb:.0f} MB of memory available, under the "
                          f"{memory_reserve_mb:.0f} MB reserve: the pools do not grow")
    if pressure.disk_free_mb is not None and pressure.disk_free_mb < disk_reserve_mb:
        return "disk", (f"{pressure.disk_free_mb:.0f} MB free on the work directory's disk, under the "
                        f"{disk_reserve_mb:.0f} MB reserve: the pools do not grow")
    return None


def _total(s: Sizes) -> int:
    return s.init_workers + s.ready_buffer + s.postrun_workers


def _tuple(s: Sizes) -> tuple[int, int, int]:
    return s.init_workers, s.ready_buffer, s.postrun_workers


def _fit(wanted: Sizes, budget: int) -> Sizes:
    """Shrink to ``budget`` runtimes: READY first (it only absorbs jitter), then INIT and POSTRUN in proportion to
    what each wants (each keeps at least one)."""
    ready = max(1, min(wanted.ready_buffer, budget - wanted.init_workers - wanted.postrun_workers))
    left = budget - ready
    both = wanted.init_workers + wanted.postrun_workers
    if both <= left:
        return Sizes(wanted.init_workers, ready, wanted.postrun_workers)
    init = min(left - 1, max(1, round(left * wanted.init_workers / both)))
    return Sizes(init, ready, max(1, left - init))


def _rounded(means: dict[str, float | None]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in means.items() if v is not None}


@dataclass
class PoolPlanner:
    """The node's sizing state: the stage window, the engine's best model-call time, the last plan."""

    run_slots: int
    window: StageWindow
    max_runtimes: int | None = None
    memory_reserve_mb: float = 1024.0
    disk_reserve_mb: float = 2048.0
    best_call_seconds: float | None = None
    engine: str | None = None
    last: PoolSizing | None = None
    changes: int = 0
    _call_seconds: collections.deque[tuple[float, int]] = field(default_factory=lambda: collections.deque(maxlen=8))

    def plan(self, current: Sizes, pressure: NodePressure) -> PoolSizing:
        means = {stage: self.window.mean(stage) for stage in SIZED_STAGES}
        planned = plan_pools(means, self.run_slots, current, max_runtimes=self.max_runtimes, pressure=pressure,
                             memory_reserve_mb=self.memory_reserve_mb, disk_reserve_mb=self.disk_reserve_mb)
        if self.engine is not None:
            planned = planned.model_copy(update={"engine": self.engine})
        planned = planned.model_copy(update={"changes": self.changes})
        self.last = planned
        return planned

    def applied(self) -> None:
        """The node changed a pool's size after the last plan (a growth deferred for room is not a change)."""
        self.changes += 1
        if self.last is not None:
            self.last = self.last.model_copy(update={"changes": self.changes})

    def observe(self, pressure: NodePressure) -> None:
        """Take one resource reading (once each; it carries the model calls since the previous one). The engine is
        called saturated when the recent readings' model calls take much longer than the best recent window."""
        if pressure.model_call_seconds is None or pressure.model_calls <= 0:
            return
        self._call_seconds.append((pressure.model_call_seconds, pressure.model_calls))
        calls = sum(n for _, n in self._call_seconds)
        if calls < 8:
            return
        recent = sum(s * n for s, n in self._call_seconds) / calls
        if self.best_call_seconds is None or recent < self.best_call_seconds:
            self.best_call_seconds = recent
        self.engine = None
        if recent > ENGINE_SLOW_FACTOR * self.best_call_seconds:
            self.engine = (f"engine saturated: model calls take {recent:.2f} s, {recent / self.best_call_seconds:.1f}x "
                           f"the best seen ({self.best_call_seconds:.2f} s); more sessions would not run faster")
