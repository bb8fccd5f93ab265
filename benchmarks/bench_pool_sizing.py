"""Self-sizing pools against every hand-sized pool set on the same workload, with stage times that change mid-run.

    .venv/bin/python benchmarks/bench_pool_sizing.py [--quick] [--slots 16] [--sessions 1200] [--max-runtimes 64]

The gateway node's real scheduler (polar_gym.gateway.GatewayNode) runs with stage functions that sleep for each
session's precomputed durations (benchmarks/bench_gateway.py's ``SleepStages``), so what is measured is the pool
sizing, not sandboxes. The workload changes halfway: the first half is init-heavy (INIT 2R: image pulls, checkouts;
POSTRUN 0.2R), the second eval-heavy (INIT 0.2R; POSTRUN 2R: test suites), R being the mean harness run time.

Every INIT, READY, RUN and POSTRUN slot holds a sandbox, so a node has a budget of runtimes (``--max-runtimes``,
memory in practice). Within that budget no fixed pool set suits both halves. The hand-sized runs are a grid of every
split of the budget between INIT and POSTRUN (READY fixed at 4); the self-sizing run (``pool_sizing: auto``) starts
from the gateway's default sizes and is given only the budget. Measured: run-slot use (harnesses running / run slots)
overall and while work is queued, sessions per minute, mean sandboxes held. The issue's target: self-sizing reaches at
least the best hand-sized run's slot use. A second pair of runs without a budget compares self-sizing with the
generous hand-sized set that covers both halves (what it saves is sandboxes held).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_gateway import Scenario, SleepStages  # noqa: E402

from polar_gym.gateway import GatewayConfig, GatewayNode  # noqa: E402
from polar_gym.schema import AgentSpec, SessionSpec, SessionStatus  # noqa: E402

PHASES = (Scenario("init-heavy", 2.0, 0.2), Scenario("eval-heavy", 0.2, 2.0))
READY = 4


def make_specs(n: int, r: float, seed: int) -> list[SessionSpec]:
    """``n`` sessions, the first half of the first phase's shape, the rest of the second's (in dispatch order)."""
    rng = random.Random(seed)
    return [SessionSpec(session_id=f"s{i}", task_id=PHASES[i * 2 // n].name, instruction="-", timeout_seconds=3600,
                        agent=AgentSpec(harness="none"),
                        metadata={"durations": PHASES[i * 2 // n].durations(rng, r)})
            for i in range(n)]


class RuntimeMeter:
    """Integrates the sandboxes a node holds (sessions in INIT, READY, RUN, POSTRUN) over time."""

    def __init__(self, node: GatewayNode, step: float) -> None:
        self.node, self.step = node, step
        self.samples: list[int] = []

    async def run(self) -> None:
        while True:
            pools = (self.node.init_pool, self.node.ready_pool, self.node.run_pool, self.node.postrun_pool)
            self.samples.append(sum(p.busy for p in pools))
            await asyncio.sleep(self.step)

    def mean(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else 0.0

    def peak(self) -> int:
        return max(self.samples, default=0)


async def run_once(specs: list[SessionSpec], config: GatewayConfig, r: float) -> dict[str, Any]:
    node = GatewayNode(SleepStages(), config)
    meter = RuntimeMeter(node, step=r / 4)
    metering = asyncio.create_task(meter.run())
    t0 = time.perf_counter()
    try:
        results = await node.run(specs)
    finally:
        metering.cancel()
    seconds = time.perf_counter() - t0
    assert all(res.status is SessionStatus.COMPLETED for res in results), {res.status for res in results}
    util = node.utilization.snapshot()
    out: dict[str, Any] = {
        "pools": f"{config.init_workers}/{config.ready_buffer}/{config.run_slots}/{config.postrun_workers}",
        "seconds": seconds, "sessions_per_minute": len(specs) / seconds * 60, "slot_use": util["overall"],
        "slot_use_while_queued": util["while_queued"], "mean_runtimes": meter.mean(), "peak_runtimes": meter.peak()}
    if node.planner is not None and node.planner.last is not None:
        last = node.planner.last
        out["pools"] = "auto"
        out["resizes"] = last.changes
        out["final"] = f"{last.init_workers}/{last.ready_buffer}/{config.run_slots}/{last.postrun_workers}"
        out["limited_by"] = last.limited_by
    return out


def grid(slots: int, budget: int, step: int) -> list[tuple[int, int]]:
    """(init, postrun) splits of ``budget - slots - READY`` runtimes, every ``step`` INIT workers."""
    spare = budget - slots - READY
    return [(init, spare - init) for init in range(step, spare, step) if spare - init >= 1]


async def main_async(args: argparse.Namespace, progress: Console) -> dict[str, Any]:
    specs = make_specs(args.sessions, args.r, args.seed)
    out: dict[str, Any] = {"slots": args.slots, "sessions": args.sessions, "run_mean_seconds": args.r,
                           "max_runtimes": args.max_runtimes, "phases": [p.name for p in PHASES]}
    hand: list[dict[str, Any]] = []
    for init, post in grid(args.slots, args.max_runtimes, args.grid_step):
        config = GatewayConfig(init_workers=init, ready_buffer=READY, run_slots=args.slots, postrun_workers=post,
                               pool_sizing="fixed")
        hand.append(await run_once(specs, config, args.r))
        progress.log(f"hand-sized {hand[-1]['pools']}: slot use {hand[-1]['slot_use']:.1%}")
    auto = await run_once(specs, GatewayConfig(run_slots=args.slots, pool_sizing="auto",
                                               max_runtimes=args.max_runtimes), args.r)
    progress.log(f"auto (budget {args.max_runtimes}): slot use {auto['slot_use']:.1%}")
    best = max(hand, key=lambda row: row["slot_use"])
    out["budgeted"] = {"hand": hand, "best_hand": best, "auto": auto,
                       "auto_vs_best_slot_use": auto["slot_use"] / best["slot_use"],
                       "meets_target": auto["slot_use"] >= best["slot_use"]}
    wanted = [max(1, round(1.25 * args.slots * getattr(p, stage))) for p in PHASES for stage in ("init", "postrun")]
    generous = GatewayConfig(init_workers=max(wanted[0], wanted[2]), ready_buffer=READY, run_slots=args.slots,
                             postrun_workers=max(wanted[1], wanted[3]), pool_sizing="fixed")
    out["unbounded"] = {"hand": await run_once(specs, generous, args.r),
                        "auto": await run_once(specs, GatewayConfig(run_slots=args.slots, pool_sizing="auto"),
                                               args.r)}
    progress.log("unbounded pair done")
    return out


def render(results: dict[str, Any], console: Console) -> None:
    table = Table(title=f"pool sizing: {results['slots']} run slots, {results['sessions']} sessions "
                        f"({' then '.join(results['phases'])}), R = {results['run_mean_seconds']} s")
    for col in ("budget", "pools (init/ready/run/postrun)", "slot use", "while queued", "sessions/min",
                "mean sandboxes", "peak sandboxes", "note"):
        table.add_column(col, justify="left" if col in ("budget", "pools (init/ready/run/postrun)", "note")
                         else "right")

    def row(budget: str, r: dict[str, Any], note: str) -> None:
        table.add_row(budget, r["pools"], f"{r['slot_use']:.1%}", f"{r['slot_use_while_queued']:.1%}",
                      f"{r['sessions_per_minute']:.0f}", f"{r['mean_runtimes']:.1f}", str(r["peak_runtimes"]), note)

    b = results["budgeted"]
    budget = str(results["max_runtimes"])
    for r in sorted(b["hand"], key=lambda r: -r["slot_use"]):
        row(budget, r, "best hand-sized" if r is b["best_hand"] or r == b["best_hand"] else "")
    a = b["auto"]
    row(budget, a, f"{a['resizes']} resizes, ends {a['final']}, limited by {a['limited_by']}")
    u = results["unbounded"]
    row("none", u["hand"], "hand-sized for both phases")
    row("none", u["auto"], f"{u['auto']['resizes']} resizes, ends {u['auto']['final']}")
    console.print(table)
    console.print(f"self-sizing / best hand-sized slot use within {budget} sandboxes: "
                  f"{b['auto_vs_best_slot_use']:.3f}x ({'meets' if b['meets_target'] else 'MISSES'} the target >= 1)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--sessions", type=int, default=1200)
    p.add_argument("--r", type=float, default=0.1, help="mean harness run time in seconds")
    p.add_argument("--max-runtimes", type=int, default=64, help="sandboxes the node may hold (the budget)")
    p.add_argument("--grid-step", type=int, default=4, help="INIT workers between two hand-sized runs")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--quick", action="store_true", help="8 slots, 320 sessions, budget 32, grid step 4")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.slots, args.sessions, args.max_runtimes = 8, 320, 32
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    console = Console(width=150)
    results = asyncio.run(main_async(args, console))
    render(results, console)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_pool_sizing.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
