"""Staged pools against one-worker-does-everything, on synthetic stage durations, in the same run.

    .venv/bin/python benchmarks/bench_gateway.py [--quick] [--slots 16] [--sessions 800] [--out benchmarks/results]

The gateway node's real scheduler (polar_gym.gateway.GatewayNode: pools, READY buffer, deadlines, statuses) runs
with injected stage functions that only ``asyncio.sleep`` for per-session durations, so what is measured is the
staging, not sandboxes. Scenarios (R = mean harness run time):

- ``init-heavy``: INIT 2R (image pull, repo checkout, installs), RUN R, POSTRUN 0.2R;
- ``eval-heavy``: INIT 0.2R, RUN R, POSTRUN 2R (test suites in a fresh runtime);
- ``long-tail``: INIT 0.5R, RUN lognormal with a heavy tail (p99 about 8x the median), POSTRUN 0.5R.

Baseline: ``slots`` workers, each doing INIT, RUN, POSTRUN and teardown of one session after another (the same run
slots, nothing staged). Measured: sessions per minute, and run-slot utilization (harnesses running / run slots, the
stand-in for rollout GPU utilization), overall and while work is queued (some session dispatched but not yet
running). Target: staged run slots busy >= 90 % while work is queued. The staged pools are sized from the
scenario's mean stage times (enough INIT and POSTRUN workers to keep up with the run slots, with 30 % headroom).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from polar_gym.gateway import GatewayConfig, GatewayNode, Session, Stages, UtilizationTracker  # noqa: E402
from polar_gym.schema import AgentSpec, EvalResult, SessionSpec, SessionStatus, Trajectory  # noqa: E402

STAGES = ("init", "run", "build", "evaluate")


@dataclass(frozen=True)
class Scenario:
    name: str
    init: float  # mean, in units of R
    postrun: float  # build + evaluate, in units of R
    tail_sigma: float = 0.0  # lognormal sigma of RUN (0: uniform +-30 %)

    def durations(self, rng: random.Random, r: float) -> dict[str, float]:
        def jitter(mean: float) -> float:
            return mean * rng.uniform(0.7, 1.3)

        if self.tail_sigma:
            median = math.exp(-self.tail_sigma ** 2 / 2)  # lognormal with mean 1
            run = min(rng.lognormvariate(math.log(median), self.tail_sigma), 20.0) * r
        else:
            run = jitter(r)
        post = jitter(self.postrun * r)
        return {"init": jitter(self.init * r), "run": run, "build": 0.2 * post, "evaluate": 0.8 * post}


SCENARIOS = [Scenario("init-heavy", 2.0, 0.2), Scenario("eval-heavy", 0.2, 2.0),
             Scenario("long-tail", 0.5, 0.5, tail_sigma=1.0)]


class SleepStages(Stages):
    """Stage functions that sleep for the session's precomputed durations (``metadata.durations``)."""

    @staticmethod
    async def _sleep(session: Session, stage: str) -> None:
        await asyncio.sleep(session.spec.metadata.model_dump()["durations"][stage])

    async def init(self, session: Session) -> None:
        await self._sleep(session, "init")

    async def run(self, session: Session) -> None:
        await self._sleep(session, "run")

    async def build(self, session: Session) -> None:
        await self._sleep(session, "build")
        session.trajectory = Trajectory(session_id=session.session_id)

    async def evaluate(self, session: Session) -> None:
        await self._sleep(session, "evaluate")
        session.evaluation = EvalResult(reward=1.0)

    async def teardown(self, session: Session) -> None:
        return None


def make_specs(scenario: Scenario, n: int, r: float, seed: int) -> list[SessionSpec]:
    rng = random.Random(seed)
    return [SessionSpec(session_id=f"{scenario.name}-{i}", task_id=scenario.name, instruction="-",
                        timeout_seconds=3600, agent=AgentSpec(harness="none"),
                        metadata={"durations": scenario.durations(rng, r)})
            for i in range(n)]


def pool_sizes(specs: list[SessionSpec], slots: int) -> dict[str, int]:
    """Enough INIT / POSTRUN workers to feed ``slots`` run slots at steady state, plus 30 % headroom."""
    mean = {k: statistics.fmean(s.metadata.model_dump()["durations"][k] for s in specs) for k in STAGES}
    post = mean["build"] + mean["evaluate"]
    return {"init_workers": max(1, math.ceil(1.3 * slots * mean["init"] / mean["run"])),
            "ready_buffer": max(2, slots // 2), "run_slots": slots,
            "postrun_workers": max(1, math.ceil(1.3 * slots * post / mean["run"]))}


async def run_staged(specs: list[SessionSpec], sizes: dict[str, int]) -> dict[str, Any]:
    node = GatewayNode(SleepStages(), GatewayConfig(**sizes, pool_sizing="fixed"))
    t0 = time.perf_counter()
    results = await node.run(specs)
    seconds = time.perf_counter() - t0
    assert all(r.status is SessionStatus.COMPLETED for r in results), {r.status for r in results}
    util = node.utilization.snapshot()
    return {"seconds": seconds, "sessions_per_minute": len(specs) / seconds * 60, "utilization": util["overall"],
            "utilization_while_queued": util["while_queued"], "peak_run_slots": node.run_pool.peak_busy}


async def run_baseline(specs: list[SessionSpec], slots: int) -> dict[str, Any]:
    """``slots`` workers; each does every stage of one session, then takes the next."""
    stages = SleepStages()
    tracker = UtilizationTracker(slots)
    queue: asyncio.Queue[SessionSpec] = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    tracker.change(pending=len(specs))

    async def worker() -> None:
        while not queue.empty():
            session = Session(queue.get_nowait())
            await stages.init(session)
            tracker.change(running=+1, pending=-1)
            await stages.run(session)
            tracker.change(running=-1)
            await stages.build(session)
            await stages.evaluate(session)
            await stages.teardown(session)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(slots)))
    seconds = time.perf_counter() - t0
    util = tracker.snapshot()
    return {"seconds": seconds, "sessions_per_minute": len(specs) / seconds * 60, "utilization": util["overall"],
            "utilization_while_queued": util["while_queued"], "peak_run_slots": slots}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"slots": args.slots, "sessions": args.sessions, "run_mean_seconds": args.r,
                           "target_utilization_while_queued": 0.9, "scenarios": {}}
    for i, scenario in enumerate(SCENARIOS):
        specs = make_specs(scenario, args.sessions, args.r, seed=args.seed + i)
        sizes = pool_sizes(specs, args.slots)
        staged = await run_staged(specs, sizes)
        baseline = await run_baseline(specs, args.slots)
        out["scenarios"][scenario.name] = {
            "pools": sizes, "staged": staged, "baseline": baseline,
            "throughput_ratio": staged["sessions_per_minute"] / baseline["sessions_per_minute"],
            "meets_target": staged["utilization_while_queued"] >= 0.9,
        }
    return out


def render(results: dict[str, Any], console: Console) -> None:
    table = Table(title=f"gateway staging: {results['slots']} run slots, {results['sessions']} sessions per scenario, "
                        f"R = {results['run_mean_seconds']} s")
    for col in ("scenario", "mode", "pools (init/ready/run/postrun)", "sessions/min", "run-slot util",
                "util while queued", "ratio"):
        table.add_column(col, justify="left" if col in ("scenario", "mode") else "right")
    for name, sc in results["scenarios"].items():
        p = sc["pools"]
        for mode in ("staged", "baseline"):
            m = sc[mode]
            pools = (f"{p['init_workers']}/{p['ready_buffer']}/{p['run_slots']}/{p['postrun_workers']}"
                     if mode == "staged" else f"{results['slots']} serial workers")
            ratio = f"{sc['throughput_ratio']:.2f}x" if mode == "staged" else "1.00x"
            table.add_row(name, mode, pools, f"{m['sessions_per_minute']:.0f}", f"{m['utilization']:.1%}",
                          f"{m['utilization_while_queued']:.1%}", ratio)
    console.print(table)
    verdict = {n: ("meets" if sc["meets_target"] else "MISSES") for n, sc in results["scenarios"].items()}
    console.print(f"target run slots >= 90 % busy while work is queued: {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--sessions", type=int, default=800)
    parser.add_argument("--r", type=float, default=0.1, help="mean harness run time in seconds")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="8 slots, 160 sessions")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.quick:
        args.slots, args.sessions = 8, 160
    results = asyncio.run(main_async(args))
    render(results, Console(width=140))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_gateway.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
