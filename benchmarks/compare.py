"""Benchmarks of this tree against an earlier commit, measured in the same run on the same machine.

    .venv/bin/python benchmarks/compare.py --base REV [--quick] [--rounds N] [proxy merge runtime server]

REV is checked out into a temporary git worktree (removed afterwards). Each named benchmark runs once from the base
tree and once from this tree per round, the order alternating from one run to the next so neither tree always goes
first on a warming (or cooling) machine; each run is a fresh interpreter whose ``polar_gym`` (and every subprocess's)
comes from its own tree (cwd and PYTHONPATH). The key numbers of each run's JSON (``--out``) are printed as a table
with the ratio current / base and written to ``benchmarks/results/compare-<time>-<rev>.{json,md}``. With several
rounds each side's median is compared. A ratio inside the noise band (``--noise``, default 10 %) is shown as ``~``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BENCHES", "Bench", "Metric", "compare_rows", "main"]

ROOT = Path(__file__).resolve().parents[1]
Result = dict[str, Any]


@dataclass(frozen=True)
class Metric:
    """One key number of a benchmark's JSON: how to read it and which way is better."""

    name: str
    read: Callable[[Result], float | None]
    higher_is_better: bool = False


@dataclass(frozen=True)
class Bench:
    script: str  # under benchmarks/
    quick: tuple[str, ...]
    full: tuple[str, ...]
    output: str  # the JSON file it writes into --out
    metrics: tuple[Metric, ...]


def _at(*keys: str | int) -> Callable[[Result], float | None]:
    def read(res: Result) -> float | None:
        node: Any = res
        for key in keys:
            try:
                node = node[key]
            except (KeyError, IndexError, TypeError):
                return None
        return float(node) if isinstance(node, int | float) else None
    return read


def _proxy_cells(concurrency: int, key: str, pick: Callable[[list[float]], float]) -> Callable[[Result], float | None]:
    def read(res: Result) -> float | None:
        values = [r[key] for r in res.get("overhead", []) if r["concurrency"] == concurrency
                  and r["front_end"] != "direct" and key in r]
        return pick(values) if values else None
    return read


BENCHES: dict[str, Bench] = {
    "proxy": Bench("bench_proxy.py", ("--quick",), (), "bench_proxy.json", (
        Metric("c=1 added p50 ms, worst front end", _proxy_cells(1, "p50_added_ms", max)),
        Metric("c=1 added p50 ms, mean", _proxy_cells(1, "p50_added_ms", statistics.mean)),
        Metric("c=64 req/s, mean front end", _proxy_cells(64, "rps", statistics.mean), higher_is_better=True),
        Metric("c=64 req/s ratio to direct, worst", _proxy_cells(64, "rps_ratio", min), higher_is_better=True),
        Metric("storage bytes / minimum", _at("storage", "total_ratio")),
    )),
    "merge": Bench("bench_merge.py", ("--quick",), (), "bench_merge.json", (
        Metric("prefix_merging 200 turns s", _at("summary", "prefix_merging", "seconds_200")),
        Metric("prefix_merging 50 turns s", _at("summary", "prefix_merging", "seconds_50")),
        Metric("per_request 200 turns s", _at("summary", "per_request", "seconds_200")),
        Metric("prefix_merging B / unique token", _at("summary", "prefix_merging", "bytes_per_unique_token")),
        Metric("speedup vs reference-like baseline", _at("summary", "targets", "speedup_vs_baseline_200"),
               higher_is_better=True),
        Metric("completions lost at 2 % retries", _at("loss", 1, "prefix_merging_lost")),
    )),
    "runtime": Bench("bench_runtime.py", ("--sessions", "20", "--no-docker"), (), "bench_runtime.json", (
        Metric("local session p50 ms", _at("local", "p50_ms")),
        Metric("local session p99 ms", _at("local", "p99_ms")),
        Metric("local added p50 ms (vs subprocess)", _at("local", "added_ms_p50")),
        Metric("16 local sessions at once, wall ms", _at("local", "concurrent_16_wall_ms")),
        Metric("docker session p50 ms", _at("docker", "p50_ms")),
        Metric("plain subprocess p50 ms (machine)", _at("plain_subprocess", "p50_ms")),
    )),
    "server": Bench("bench_server.py", ("--quick",), (), "bench_server.json", (
        Metric("server sessions/s", _at("server", "sessions_per_second"), higher_is_better=True),
        Metric("server / direct throughput", _at("throughput_ratio"), higher_is_better=True),
        Metric("scheduling p50 ms", _at("server", "scheduling_latency", "p50_ms")),
        Metric("scheduling p99 ms", _at("server", "scheduling_latency", "p99_ms")),
        Metric("session p50 ms", _at("server", "session_latency", "p50_ms")),
        Metric("restart start() s, stored db", _at("recovery", "stored", "start_s")),
        Metric("restart API answers s, stored db", _at("recovery", "stored", "api_s")),
    )),
}


@contextmanager
def base_worktree(rev: str) -> Iterator[tuple[Path, str]]:
    """``rev`` checked out (detached) in a temporary worktree of this repository; yields (path, short hash)."""
    short = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True,
                           text=True).stdout.strip()
    parent = Path(tempfile.mkdtemp(prefix="polar-bench-base-"))
    path = parent / short
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(path), rev], check=True)
    try:
        yield path, short
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)
        shutil.rmtree(parent, ignore_errors=True)


def run_bench(tree: Path, bench: Bench, quick: bool, out: Path, log: Path) -> Result | None:
    """One run of ``bench`` from ``tree`` in a fresh interpreter; its JSON, or None (the log says why)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(tree) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    argv = [sys.executable, str(tree / "benchmarks" / bench.script), *(bench.quick if quick else bench.full),
            "--out", str(out)]
    which = subprocess.run([sys.executable, "-c", "import polar_gym; print(polar_gym.__file__)"], cwd=tree, env=env,
                           capture_output=True, text=True)
    if Path(which.stdout.strip()).resolve() != (tree / "polar_gym" / "__init__.py").resolve():
        raise RuntimeError(f"polar_gym from {tree} is not the one imported: {which.stdout}{which.stderr}")
    with log.open("w") as fh:
        proc = subprocess.run(argv, cwd=tree, env=env, stdout=fh, stderr=subprocess.STDOUT)
    result = out / bench.output
    if proc.returncode != 0 or not result.exists():
        return None
    data: Result = json.loads(result.read_text())
    return data


def compare_rows(bench: str, spec: Bench, base: list[Result], current: list[Result],
                 noise: float) -> list[dict[str, Any]]:
    """One row per metric: each side's median over its runs, the ratio current / base and a verdict."""
    rows = []
    for metric in spec.metrics:
        b = [v for v in map(metric.read, base) if v is not None]
        c = [v for v in map(metric.read, current) if v is not None]
        if not b and not c:
            continue
        bm = statistics.median(b) if b else None
        cm = statistics.median(c) if c else None
        ratio = cm / bm if bm and cm is not None else None
        verdict = "?"
        if ratio is not None:
            better = ratio > 1 if metric.higher_is_better else ratio < 1
            verdict = "~" if abs(ratio - 1) <= noise else ("better" if better else "worse")
        elif bm == cm == 0:
            ratio, verdict = 1.0, "~"
        rows.append({"bench": bench, "metric": metric.name, "base": bm, "current": cm, "ratio": ratio,
                     "higher_is_better": metric.higher_is_better, "verdict": verdict, "runs": [len(b), len(c)]})
    return rows


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"


def render(rows: list[dict[str, Any]], title: str) -> str:
    lines = [f"### {title}", "", "| bench | metric | base | current | current/base | |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        lines.append(f"| {r['bench']} | {r['metric']}{' (higher is better)' if r['higher_is_better'] else ''} | "
                     f"{_fmt(r['base'])} | {_fmt(r['current'])} | {ratio} | {r['verdict']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", default=list(BENCHES), help=f"of {', '.join(BENCHES)} (default: all)")
    parser.add_argument("--base", required=True, help="the commit to compare against (any git revision)")
    parser.add_argument("--quick", action="store_true", help="each benchmark's quick mode")
    parser.add_argument("--rounds", type=int, default=1, help="runs per tree and benchmark (medians compared)")
    parser.add_argument("--noise", type=float, default=0.10, help="ratios within 1 +- this are shown as ~")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHES]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHES)}")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    with base_worktree(args.base) as (base_tree, short), tempfile.TemporaryDirectory(prefix="polar-compare-") as tmp:
        trees = {"base": base_tree, "current": ROOT}
        turn = 0
        for name in args.names:
            spec = BENCHES[name]
            results: dict[str, list[Result]] = {"base": [], "current": []}
            for rnd in range(args.rounds):
                order = ("base", "current") if turn % 2 == 0 else ("current", "base")
                turn += 1
                for side in order:
                    print(f"[compare] {name} round {rnd + 1}/{args.rounds}: {side} ({trees[side]})", flush=True)
                    run_dir = Path(tmp) / f"{name}-{side}-{rnd}"
                    log = Path(tmp) / f"{name}-{side}-{rnd}.log"
                    res = run_bench(trees[side], spec, args.quick, run_dir, log)
                    if res is None:
                        tail = log.read_text(errors="replace")[-1500:]
                        failures.append(f"{name} {side} round {rnd + 1} failed:\n{tail}")
                        print(f"[compare] {name} {side} failed; log tail:\n{tail}", file=sys.stderr, flush=True)
                    else:
                        results[side].append(res)
            rows += compare_rows(name, spec, results["base"], results["current"], args.noise)
    title = (f"current {head}{' (+ uncommitted changes)' if dirty else ''} vs base {short} ({args.base}), "
             f"{'quick' if args.quick else 'full'} mode, {args.rounds} round(s), {os.cpu_count()} CPUs, {stamp}")
    table = render(rows, title)
    print("\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"compare-{stamp}-{short}"
    path.with_suffix(".md").write_text(table + "".join(f"\n```\n{f}\n```\n" for f in failures))
    path.with_suffix(".json").write_text(json.dumps({"title": title, "base": args.base, "base_commit": short,
                                                     "current_commit": head, "dirty": dirty, "quick": args.quick,
                                                     "rounds": args.rounds, "rows": rows, "failures": failures},
                                                    indent=1) + "\n")
    print(f"wrote {path}.md and .json")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
