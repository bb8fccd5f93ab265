"""Asynchronous against synchronous GRPO (issue 37): the same learning demonstration, side by side, timed.

bench_learning's forked task (the oracle's right and one-token-wrong demos, SFT on both to ~50/50) is trained by
two GRPO arms from the same SFT checkpoint with the same seed, one after the other in this run, on the same vLLM CPU
fp32 engine through the unmodified pi harness:

- ``sync``: ``trainer.max_staleness 0``: sample a step's groups, train, evaluate, push, repeat;
- ``async``: ``trainer.max_staleness 1`` (``--staleness``): the next step's groups are sampled while the trainer
  trains, evaluates and pushes, and each step takes the first groups that complete.

The engine and the trainer are pinned to separate cores, as they are separate devices on a cluster (on one shared
core overlap cannot help): vLLM's processes and its OpenMP threads on ``--engine-cpus`` (``taskset``-like affinity
and ``POLAR_VLLM_THREADS_BIND``), the trainer's torch thread on ``--trainer-cpus`` (``trainer.cpus``, ``trainer.threads
1``), and this process's other threads (the in-process fleet: rollout server, gateway, proxy) and its children (the
sandboxes, pi) on ``--rollout-cpus`` (by default the trainer's). The affinity every process and thread actually had is
read from ``/proc/PID/task/*/status`` while the arms run and written to the summary.

A step is 4 groups of 4 sessions by default (``--groups``, ``--samples``: each group a TaskRequest of its own, as
users run several prompts a step). Each arm's time to the acceptance thresholds of bench_learning (share of the
right answer >= 0.85 and P(right) up >= 0.2 from the SFT checkpoint's) is read from when its metrics row was
written; the target is async <= 0.7 x sync.

    nice -n 10 .venv/bin/python benchmarks/bench_async.py --out /tmp/bench-async
    nice -n 10 .venv/bin/python benchmarks/bench_async.py --quick --out /tmp/bench-async-quick   # ~10 min
    .venv/bin/python benchmarks/bench_async.py --sft-checkpoint SFT_DIR --references train.jsonl ...   # skip SFT

Writes under ``--out``: demo/, sft/ (unless given), arm-NAME/ (each arm's run: trainer/train_metrics.jsonl ...),
steps.jsonl (one row per arm and step, with its wall time), async.svg (learning against wall time, staleness per
sample), learning.svg (the arms against steps), summary.md and acceptance.json. Exit 0 when every judged line holds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_learning import (  # noqa: E402
    DEFAULT_FORKS,
    P_RIGHT_GAIN_MIN,
    SHARE_RIGHT_MIN,
    start_vllm,
    stop,
    task_request,
    warm_start,
)
from polar_gym.assets import TINY_MODEL_NAME  # noqa: E402
from polar_gym.fleet import InferenceSettings, local_fleet  # noqa: E402
from polar_gym.gateway.config import GatewayPools  # noqa: E402
from polar_gym.plots import PALETTE, arm_panels, figure, svg_of  # noqa: E402
from polar_gym.schema import TaskRequest  # noqa: E402
from polar_gym.server.client import RolloutClient  # noqa: E402
from polar_gym.serving import free_port  # noqa: E402
from polar_gym.trainer import TrainerSettings, run_grpo  # noqa: E402
from polar_gym.trainer.worker import parse_cpu_list  # noqa: E402

#: the issue's target: the asynchronous run reaches the thresholds in at most this share of the synchronous time
TARGET_RATIO = 0.7
FIGURE_KEYS = ("eval/share_right", "eval/p_right", "reward_mean", "staleness/max")
TABLE_KEYS = ("step", "wall_seconds", "eval/p_right", "eval/share_right", "reward_mean", "trained", "rounds",
              "staleness/mean", "staleness/max", "stale_groups_dropped", "rollout_seconds", "train_seconds",
              "push_seconds")
ARM_COLOURS = {"sync": PALETTE["blue"], "async": PALETTE["orange"]}


def _say(msg: str) -> None:
    print(f"[bench_async {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass(frozen=True)
class ArmSpec:
    """An arm: its name and ``trainer.max_staleness``."""

    name: str
    staleness: int


@dataclass
class ArmRun:
    """What an arm did: its metrics rows (each with ``wall_seconds``: when it was written, from the arm's start),
    the wall time of the whole run, the CPUs each kind of process was allowed, and the engine's busy share."""

    spec: ArmSpec
    rows: list[dict[str, Any]]
    wall_seconds: float
    affinity: dict[str, list[str]] = field(default_factory=dict)
    engine_busy: float | None = None
    unused_groups: int | None = None
    #: the share of every CPU's time the machine spent working during the arm (/proc/stat): near 1, no idle CPU was
    #: left for the overlap to fill
    machine_busy: float | None = None


@dataclass(frozen=True)
class Check:
    text: str
    passed: bool
    judged: bool = True


# ---- pure parts: thresholds, staleness, checks, summary ----

def threshold_row(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The first row (in the order written) whose weights pass bench_learning's thresholds: share right >=
    SHARE_RIGHT_MIN and P(right) up >= P_RIGHT_GAIN_MIN from step 0's; None when no row does."""
    start = next((r for r in rows if r.get("step") == 0 and "eval/p_right" in r), None)
    if start is None:
        return None
    p0 = float(start["eval/p_right"])
    for row in rows:
        if row.get("step", 0) == 0 or "eval/share_right" not in row:
            continue
        if float(row["eval/share_right"]) >= SHARE_RIGHT_MIN and float(row["eval/p_right"]) - p0 >= P_RIGHT_GAIN_MIN:
            return dict(row)
    return None


def staleness_points(rows: Sequence[Mapping[str, Any]]) -> list[tuple[int, int]]:
    """(step, staleness) of every trained sample, from the rows' ``staleness/per_sample``."""
    return [(int(r["step"]), int(s)) for r in rows if isinstance(r.get("staleness/per_sample"), list)
            for s in r["staleness/per_sample"]]


def cpu_list(cpus: set[int]) -> str:
    """``{0, 1, 2, 5}`` as the kernel writes it: ``0-2,5``."""
    out: list[str] = []
    ordered = sorted(cpus)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def acceptance(runs: Mapping[str, ArmRun], engine_cpus: str, trainer_cpus: str, *, judge_learning: bool,
               rollout_cpus: str | None = None) -> list[Check]:
    """The issue's done-when line as checks: each arm reaches the thresholds, the async arm in at most
    TARGET_RATIO x the sync arm's wall time, the staleness of every trained sample within the arm's bound, and
    the pinning held (the engine's processes only on ``engine_cpus``, the trainer's torch thread only on
    ``trainer_cpus``, the fleet's threads and the sessions' processes only on ``rollout_cpus``, by default the
    trainer's).
    ``judge_learning`` False (``--quick``: too few steps to learn): the learning lines are shown, not judged."""
    checks: list[Check] = []
    reached: dict[str, float] = {}
    for name, run in runs.items():
        hit = threshold_row(run.rows)
        if hit is None:
            checks.append(Check(f"{name}: share right >= {SHARE_RIGHT_MIN} and P(right) up >= {P_RIGHT_GAIN_MIN} "
                                f"not reached in {len(run.rows) - 1} steps ({run.wall_seconds / 60:.1f} min)",
                                False, judge_learning))
            continue
        reached[name] = float(hit["wall_seconds"])
        checks.append(Check(f"{name}: thresholds reached at step {hit['step']} after {reached[name] / 60:.1f} min "
                            f"(share {float(hit['eval/share_right']):.3f}, P(right) "
                            f"{float(hit['eval/p_right']):.3f})", True, judge_learning))
    if "sync" in runs and "async" in runs:
        if "sync" in reached and "async" in reached:
            ratio = reached["async"] / reached["sync"]
            checks.append(Check(f"async / sync wall time to the thresholds: {reached['async'] / 60:.1f} / "
                                f"{reached['sync'] / 60:.1f} min = {ratio:.2f} <= {TARGET_RATIO}",
                                ratio <= TARGET_RATIO, judge_learning))
        else:
            checks.append(Check(f"async / sync wall time to the thresholds: not measurable (reached: "
                                f"{', '.join(sorted(reached)) or 'neither'})", False, judge_learning))
    for name, run in runs.items():
        points = staleness_points(run.rows)
        if not points:
            checks.append(Check(f"{name}: no staleness per sample logged (staleness/per_sample)", False))
            continue
        values = [s for _, s in points]
        dropped = sum(int(r.get("stale_groups_dropped") or 0) for r in run.rows)
        checks.append(Check(f"{name}: staleness per trained sample max {max(values)} <= max_staleness "
                            f"{run.spec.staleness} (mean {sum(values) / len(values):.2f} over {len(values)} samples; "
                            f"{dropped} stale group(s) dropped)", max(values) <= run.spec.staleness))
    def seen(*kinds: str) -> list[str]:
        return sorted({c for run in runs.values() for kind in kinds for c in run.affinity.get(kind, [])})

    want_rollout = rollout_cpus or trainer_cpus
    engine, trainer, rollout, threads = seen("engine"), seen("trainer"), seen("loop", "harness"), seen("threads")
    checks.append(Check(f"pinning: engine processes allowed CPUs {engine or 'not read'} (want {engine_cpus}), "
                        f"trainer thread {trainer or 'not read'} (want {trainer_cpus}), event loop and sessions "
                        f"{rollout or 'not read'} (want {want_rollout}), other threads {threads or 'none'} (want "
                        f"{want_rollout} or, started by the trainer's, {trainer_cpus})",
                        engine == [engine_cpus] and trainer == [trainer_cpus] and rollout == [want_rollout]
                        and set(threads) <= {want_rollout, trainer_cpus}))
    return checks


def step_rows(runs: Mapping[str, ArmRun]) -> list[dict[str, Any]]:
    """steps.jsonl: one row per arm and step, the arm's name first."""
    return [{"arm": name, **row} for name, run in runs.items() for row in run.rows]


def async_figure(runs: Mapping[str, ArmRun], title: str = "") -> str:
    """Share right and P(right) against wall minutes (each arm a line, the thresholds dashed), and each arm's
    staleness per trained sample against the step (one dot a sample, jittered, its bound dashed)."""
    with figure("bench_async", 6.4, 7.2, nrows=3, squeeze=False) as (fig, axes):
        share, p_right, stale = axes[0, 0], axes[1, 0], axes[2, 0]
        for name, run in runs.items():
            colour = ARM_COLOURS.get(name, PALETTE["green"])
            timed = [r for r in run.rows if "eval/share_right" in r and "wall_seconds" in r]
            minutes = [float(r["wall_seconds"]) / 60 for r in timed]
            share.plot(minutes, [float(r["eval/share_right"]) for r in timed], marker="o", markersize=3,
                       color=colour, label=f"{name} (max_staleness {run.spec.staleness})")
            p_right.plot(minutes, [float(r["eval/p_right"]) for r in timed], marker="o", markersize=3,
                         color=colour, label=name)
            points = staleness_points(run.rows)
            offset = -0.12 if run.spec.staleness == 0 else 0.12
            jitter = [((i % 7) - 3) * 0.02 for i in range(len(points))]
            stale.scatter([s + offset + j for (s, _), j in zip(points, jitter, strict=True)],
                          [v for _, v in points], s=8, color=colour, alpha=0.5, label=name)
            stale.axhline(run.spec.staleness, color=colour, linestyle="--", linewidth=1)
            hit = threshold_row(run.rows)
            if hit is not None:
                share.axvline(float(hit["wall_seconds"]) / 60, color=colour, linestyle=":", linewidth=1)
        start = next((r for runs_ in runs.values() for r in runs_.rows if r.get("step") == 0
                      and "eval/p_right" in r), None)
        share.axhline(SHARE_RIGHT_MIN, color=PALETTE["grey"], linestyle="--", linewidth=1)
        if start is not None:
            p_right.axhline(float(start["eval/p_right"]) + P_RIGHT_GAIN_MIN, color=PALETTE["grey"], linestyle="--",
                            linewidth=1)
        share.set_title(f"eval/share_right against wall time (dashed: {SHARE_RIGHT_MIN}; dotted: reached)", loc="left")
        p_right.set_title(f"eval/p_right against wall time (dashed: step 0 + {P_RIGHT_GAIN_MIN})", loc="left")
        stale.set_title("staleness per trained sample (versions behind the trainer; dashed: max_staleness)",
                        loc="left")
        share.set_xlabel("minutes since the arm started")
        p_right.set_xlabel("minutes since the arm started")
        stale.set_xlabel("step")
        stale.set_ylabel("staleness")
        stale.yaxis.get_major_locator().set_params(integer=True)
        stale.xaxis.get_major_locator().set_params(integer=True)
        for ax in (share, p_right, stale):
            if ax.get_legend_handles_labels()[0]:
                ax.legend(loc="best", fontsize=8)
        if title:
            fig.suptitle(title)
        return svg_of(fig)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return "" if value is None else str(value)


def summary_lines(header: str, runs: Mapping[str, ArmRun], checks: Sequence[Check], notes: Sequence[str]) -> list[str]:
    """summary.md: the header, the acceptance lines, per arm its wall times, pinning and a per-step table."""
    lines = [header, "", "## Acceptance", ""]
    lines += [f"- {('PASS' if c.passed else 'FAIL') if c.judged else 'shown'}: {c.text}" for c in checks]
    lines += ["", "## Arms", ""]
    for name, run in runs.items():
        last = run.rows[-1] if run.rows else {}
        busy = f"{run.engine_busy:.0%}" if run.engine_busy is not None else "not read"
        machine = f"{run.machine_busy:.0%}" if run.machine_busy is not None else "not read"
        pins = "; ".join(f"{kind} {','.join(cpus)}" for kind, cpus in sorted(run.affinity.items())) or "not read"
        lines.append(f"- {name} (max_staleness {run.spec.staleness}): {len(run.rows) - 1} steps in "
                     f"{run.wall_seconds / 60:.1f} min; last step share {_cell(last.get('eval/share_right'))}, "
                     f"P(right) {_cell(last.get('eval/p_right'))}, reward_mean {_cell(last.get('reward_mean'))}; "
                     f"engine busy {busy} of the wall time, the machine's CPUs {machine}; allowed CPUs: {pins}"
                     + (f"; {run.unused_groups} group(s) sampled ahead and not trained" if run.unused_groups else ""))
    if "sync" in runs and "async" in runs and runs["sync"].wall_seconds > 0:
        lines.append(f"- whole runs, async / sync: {runs['async'].wall_seconds / runs['sync'].wall_seconds:.2f}")
    lines += ["", *notes]
    for name, run in runs.items():
        lines += ["", f"## {name}", "", "| " + " | ".join(TABLE_KEYS) + " |", "|" + "---|" * len(TABLE_KEYS)]
        lines += ["| " + " | ".join(_cell(r.get(k)) for k in TABLE_KEYS) + " |" for r in run.rows]
    return lines


def write_outputs(out: Path, header: str, runs: Mapping[str, ArmRun], checks: Sequence[Check],
                  notes: Sequence[str] = ()) -> list[str]:
    """summary.md, acceptance.json, steps.jsonl, async.svg and learning.svg under ``out``; returns the summary's
    lines."""
    out.mkdir(parents=True, exist_ok=True)
    lines = summary_lines(header, runs, checks, notes)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (out / "acceptance.json").write_text(json.dumps(
        {"checks": [asdict(c) for c in checks],
         "arms": {n: {"max_staleness": r.spec.staleness, "wall_seconds": r.wall_seconds,
                      "threshold_seconds": (hit or {}).get("wall_seconds"), "threshold_step": (hit or {}).get("step"),
                      "affinity": r.affinity, "engine_busy": r.engine_busy,
                      "machine_busy": r.machine_busy}
                  for n, r in runs.items() for hit in [threshold_row(r.rows)]}}, indent=2) + "\n")
    with (out / "steps.jsonl").open("w") as f:
        for row in step_rows(runs):
            f.write(json.dumps(row, sort_keys=True) + "\n")
    (out / "async.svg").write_text(async_figure(runs, "GRPO through pi on vLLM fp32: synchronous vs asynchronous"))
    (out / "learning.svg").write_text(arm_panels({n: r.rows for n, r in runs.items()}, FIGURE_KEYS,
                                                 "the arms against steps"))
    return lines


# ---- the run: pinning, the arms ----

def thread_cpus(pid: int) -> dict[int, str]:
    """The Cpus_allowed_list of each thread of ``pid`` by thread id (empty when it is gone)."""
    found: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                for line in (task / "status").read_text().splitlines():
                    if line.startswith("Cpus_allowed_list:"):
                        found[int(task.name)] = line.split(":", 1)[1].strip()
    return found


def allowed_cpus(pid: int) -> set[str]:
    """The Cpus_allowed_list of every thread of ``pid`` (empty when it is gone)."""
    return set(thread_cpus(pid).values())


def _proc_table() -> list[tuple[int, int, int]]:
    """(pid, ppid, pgid) of every process."""
    table = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            table.append((int(entry.name), int(fields[1]), int(fields[2])))
    return table


def process_groups(engine_pgid: int, me: int) -> dict[str, list[int]]:
    """The engine's processes (its process group), this process, and this process's descendants (sandboxes,
    pi, ...) but the engine's."""
    table = _proc_table()
    engine = [pid for pid, _, pgid in table if pgid == engine_pgid]
    children: dict[int, list[int]] = {}
    for pid, ppid, _ in table:
        children.setdefault(ppid, []).append(pid)
    descendants, todo = [], list(children.get(me, []))
    while todo:
        pid = todo.pop()
        if pid in engine:
            continue
        descendants.append(pid)
        todo += children.get(pid, [])
    return {"engine": engine, "trainer": [me], "harness": descendants}


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (the gone ones count 0)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / tick


def machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of every CPU so far, from /proc/stat's ``cpu`` line (idle and iowait are not
    busy)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)


def machine_busy(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """The busy share of the CPUs' time between two :func:`machine_ticks` readings."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else None


def _stamp(metrics: Path, started: float, stamps: list[float]) -> None:
    """Stamp each line of train_metrics.jsonl not stamped yet with the seconds since ``started``."""
    with contextlib.suppress(OSError):
        lines = [x for x in metrics.read_text().splitlines() if x.strip()]
        while len(stamps) < len(lines):
            stamps.append(time.monotonic() - started)


def _read_pins(affinity: dict[str, set[str]], engine_pgid: int) -> None:
    """The engine's and the sessions' processes, and this process's threads: the trainer's (named by
    :class:`~polar_gym.trainer.worker.TrainerWorker`), the main one (the event loop: the fleet) and the others (the
    fleet's helpers, or threads the trainer's started: a checkpoint writer's, which inherit the trainer's CPUs)."""
    groups = process_groups(engine_pgid, os.getpid())
    for kind in ("engine", "harness"):
        for pid in groups[kind]:
            affinity.setdefault(kind, set()).update(allowed_cpus(pid))
    trainer_threads = {t.native_id for t in threading.enumerate() if t.name.startswith("polar-trainer")}
    for tid, cpus in thread_cpus(os.getpid()).items():
        kind = "trainer" if tid in trainer_threads else "loop" if tid == os.getpid() else "threads"
        affinity.setdefault(kind, set()).add(cpus)


async def _watch(metrics: Path, started: float, stamps: list[float], affinity: dict[str, set[str]],
                 engine_pgid: int, every: float = 0.25) -> None:
    """Stamp each new metrics row with its time, and read the allowed CPUs of the engine's, this process's and its
    children's processes every few seconds, until cancelled (a quarter second is well below a step)."""
    last_pins = 0.0
    while True:
        _stamp(metrics, started, stamps)
        if time.monotonic() - last_pins > 3.0:
            last_pins = time.monotonic()
            _read_pins(affinity, engine_pgid)
        await asyncio.sleep(every)


def group_requests(args: argparse.Namespace) -> list[TaskRequest]:
    """``--groups`` TaskRequests of the task, ``--samples`` sessions each, ids TASK-gN (each a GRPO group)."""
    base = task_request(args.task, args.samples, args.session_timeout)
    return [base.model_copy(update={"task_id": f"{base.task_id}-g{i}"}) for i in range(args.groups)]


async def run_arm(args: argparse.Namespace, spec: ArmSpec, sft: Path, references: Path, engine_url: str,
                  engine_pgid: int, out: Path) -> ArmRun:
    """One GRPO arm from the SFT checkpoint (reloaded into the engine as version 0) on a fleet of its own."""
    inference = InferenceSettings(engine="vllm", upstreams=[engine_url], upstream_model=TINY_MODEL_NAME,
                                  max_tokens_cap=args.max_tokens, prompt_mode="token_in")
    settings = TrainerSettings(algorithm="grpo", model=str(sft), steps=args.steps, learning_rate=args.lr,
                               optimizer=args.optimizer, seed=args.seed, threads=args.threads, kl_coef=args.kl_coef,
                               reference_answers=[str(references)], greedy_samples=args.greedy,
                               max_staleness=spec.staleness, stale_groups=args.stale_groups,
                               cpus=args.trainer_cpus)
    metrics = out / "trainer" / "train_metrics.jsonl"
    stamps: list[float] = []
    affinity: dict[str, set[str]] = {}
    unused: list[int] = []

    def echo(message: str) -> None:
        _say(f"{spec.name}: {message}")
        if message.startswith("grpo: ") and "sampled ahead were not trained" in message:
            with contextlib.suppress(ValueError):
                unused.append(int(message.split()[1]))

    async with (local_fleet(out, inference, pools=GatewayPools(run_slots=args.slots)) as (url, token),
                RolloutClient(url, token) as client):
        await client.update_weights(str(sft), 0)
        engine_pids = process_groups(engine_pgid, os.getpid())["engine"]
        engine_cpu, machine_before = cpu_seconds(engine_pids), machine_ticks()
        started = time.monotonic()
        watcher = asyncio.create_task(_watch(metrics, started, stamps, affinity, engine_pgid))
        try:
            await run_grpo(settings, group_requests(args), client, out / "trainer", weights=client, echo=echo,
                           timeout=3600)
        finally:
            _stamp(metrics, started, stamps)
            wall = time.monotonic() - started
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            busy = (cpu_seconds(process_groups(engine_pgid, os.getpid())["engine"]) - engine_cpu) / wall
            machine = machine_busy(machine_before, machine_ticks())
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    for i, row in enumerate(rows):
        row["wall_seconds"] = stamps[i] if i < len(stamps) else wall
    return ArmRun(spec, rows, wall, {k: sorted(v) for k, v in affinity.items()}, busy, unused[0] if unused else None,
                  machine)


def _pin(cpus: str) -> None:
    """Every thread of this process on ``cpus`` (sched_setaffinity sets one thread: the pools torch and the
    tokenizers started at import keep theirs otherwise); threads started later inherit it."""
    wanted = parse_cpu_list(cpus)
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task.name), wanted)


QUICK = {"steps": 3, "groups": 2, "samples": 4, "sft_steps": 40, "sft_anneal_steps": 0}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-async"))
    parser.add_argument("--quick", action="store_true", help="validate the pipeline in ~10 minutes: "
                        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
                        + " (unless given); the learning lines are shown, not judged")
    parser.add_argument("--task", default="demo-calc-add", choices=sorted(DEFAULT_FORKS))
    parser.add_argument("--demos", type=int, default=1, help="oracle sessions per variant")
    parser.add_argument("--sft-steps", type=int, default=None, help="default 120 (bench_learning's)")
    parser.add_argument("--sft-lr", type=float, default=5e-3)
    parser.add_argument("--sft-anneal-steps", type=int, default=None, help="default 60 (bench_learning's)")
    parser.add_argument("--sft-checkpoint", type=Path, help="skip the demos and SFT: this checkpoint (with "
                        "--references)")
    parser.add_argument("--references", type=Path, help="the reference answers (the demos' sft/train.jsonl)")
    parser.add_argument("--arms", nargs="+", choices=["sync", "async"], default=["sync", "async"],
                        help="which arms, in this order")
    parser.add_argument("--staleness", type=int, default=1, help="the async arm's trainer.max_staleness")
    parser.add_argument("--stale-groups", choices=["drop", "correct"], default="drop", help="trainer.stale_groups")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps per arm (default 12)")
    parser.add_argument("--groups", type=int, default=None, help="groups (TaskRequests) per step (default 4)")
    parser.add_argument("--samples", type=int, default=None, help="sessions per group (default 4)")
    parser.add_argument("--greedy", type=int, default=0, help="greedy held-out sessions per group and step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--kl-coef", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=0.95, help="the engine's nucleus sampling (temperature 1)")
    parser.add_argument("--slots", type=int, default=4, help="concurrent sessions")
    parser.add_argument("--max-tokens", type=int, default=256, help="the proxy's max_tokens cap per call")
    parser.add_argument("--session-timeout", type=float, default=240.0)
    parser.add_argument("--threads", type=int, default=1, help="trainer.threads (and SFT's)")
    parser.add_argument("--engine-cpus", default="0", help="the CPU(s) of vLLM's processes and OpenMP threads")
    parser.add_argument("--trainer-cpus", default="1", help="the CPU(s) of the trainer's torch thread "
                        "(trainer.cpus)")
    parser.add_argument("--rollout-cpus", default=None, help="the CPU(s) of this process's other threads (the "
                        "in-process fleet: rollout server, gateway, proxy) and of the sessions (sandboxes, pi); "
                        "default: --trainer-cpus")
    args = parser.parse_args(argv)
    defaults = {"steps": 12, "groups": 4, "samples": 4, "sft_steps": 120, "sft_anneal_steps": 60}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else value)
    if args.sft_checkpoint is not None and args.references is None:
        parser.error("--sft-checkpoint needs --references")
    args.rollout_cpus = args.rollout_cpus or args.trainer_cpus
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sft_checkpoint is None:  # before the pinning, on every CPU: the arms alone are compared
        whole = argparse.Namespace(**{**vars(args), "threads": os.cpu_count() or 1})
        checkpoint, references = warm_start(whole, DEFAULT_FORKS[args.task])
        _say(f"SFT done ({time.monotonic() - started:.0f} s)")
    else:
        checkpoint, references = args.sft_checkpoint, args.references
    port = free_port("127.0.0.1")
    os.environ["POLAR_VLLM_THREADS_BIND"] = args.engine_cpus  # vllm_server_env reads it: OpenMP's bind
    _pin(args.engine_cpus)  # vLLM's processes inherit this affinity at the fork
    try:
        proc = start_vllm(checkpoint, port, args.out / "vllm-server.log", args.top_p)
    finally:
        _pin(args.rollout_cpus)
    runs: dict[str, ArmRun] = {}
    specs = {"sync": ArmSpec("sync", 0), "async": ArmSpec("async", args.staleness)}
    try:
        for name in args.arms:
            runs[name] = asyncio.run(run_arm(args, specs[name], checkpoint, references, f"http://127.0.0.1:{port}",
                                             proc.pid, args.out / f"arm-{name}"))
            _say(f"{name}: {len(runs[name].rows) - 1} steps in {runs[name].wall_seconds / 60:.1f} min")
            # each arm's outputs as soon as it ends: a run stopped in its second arm keeps the first's timings
            write_outputs(args.out, "(partial: the arms so far)", runs,
                          acceptance(runs, args.engine_cpus, args.trainer_cpus, judge_learning=not args.quick,
                                     rollout_cpus=args.rollout_cpus))
    finally:
        stop(proc)
    checks = acceptance(runs, args.engine_cpus, args.trainer_cpus, judge_learning=not args.quick,
                        rollout_cpus=args.rollout_cpus)
    header = (f"`{' '.join([Path(sys.executable).name, *sys.argv])}`: task {args.task}; GRPO {args.steps} steps x "
              f"{args.groups} groups x {args.samples} sessions on {args.slots} slots, {args.optimizer} lr {args.lr}, "
              f"seed {args.seed}, sampled at temperature 1 top_p {args.top_p}; async max_staleness {args.staleness} "
              f"(stale groups: {args.stale_groups}); engine on CPU {args.engine_cpus}, trainer on CPU "
              f"{args.trainer_cpus} (threads {args.threads}), fleet and sessions on CPU {args.rollout_cpus}; wall "
              f"{(time.monotonic() - started) / 60:.1f} min")
    rollout = parse_cpu_list(args.rollout_cpus)
    shares = [name for name, cpus in (("the engine", args.engine_cpus), ("the trainer", args.trainer_cpus))
              if rollout & parse_cpu_list(cpus)]
    notes = [f"The sandboxes, pi and the in-process fleet (rollout server, gateway, proxy) share CPU "
             f"{args.rollout_cpus} with {' and '.join(shares) or 'neither the engine nor the trainer'}; the machine "
             f"had {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end."]
    lines = write_outputs(args.out, header, runs, checks, notes)
    print("\n".join(lines), flush=True)
    return 0 if all(c.passed for c in checks if c.judged) else 1


if __name__ == "__main__":
    raise SystemExit(main())
