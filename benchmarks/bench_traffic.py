"""The traffic users send, through polar_gym's proxy, LiteLLM and direct, side by side in one run.

    .venv/bin/python benchmarks/bench_traffic.py [--quick] [--no-litellm] [--out benchmarks/results]

Traffic (benchmarks/traffic.py): agent sessions of the four recorded harnesses in equal parts (Claude Code on
Anthropic Messages, Codex on Responses, Gemini CLI on Google, Qwen Code on Chat), each growing by a tool call and its
result every turn as that harness grows it, streamed as the harnesses stream. Sessions arrive at random (Poisson,
``--rate`` a second) and run 5 to 60 turns with a tool's time (0.2-1.5 s) between calls; one in ten pauses for 5-20 s
once (a user away), one in five compacts half way. The upstream (benchmarks/fast_upstream.py, core 1 with the load
generator) streams like vLLM, a token every 10 ms (a 56-token answer in ~0.6 s), its prompt IDs a token per 4 request
bytes. The same seeded traffic goes to each target in turn, for ``--seconds`` each:

- ``polar``: ``python -m polar_gym.proxy --engine vllm`` (chat mode, capture on, to disk, default idle timeout), core 0;
- ``litellm``: LiteLLM 1.108.7's proxy (its own venv under ~/.cache/polar_gym, built on first use), one worker,
  core 0, the same upstream as a hosted vLLM;
- ``direct``: the Chat body polar_gym's proxy sends upstream for each call, posted to the upstream itself;
- ``polar@REV`` (``--rev REV``): the proxy of an earlier commit, from a worktree, beside this tree's.

Printed per target: calls and errors; time to the first byte and to the end (p50, p99); the target process's CPU per
call, for a session's first call and for the later ones; its RSS at the end and per session; and **sessions per core**:
the sessions it keeps going on one core at this traffic's pace (the sessions in flight on average / its CPU share).
Then a saturation phase (``--saturate`` sessions at once, no tool time): the calls a second each target sustains.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_proxy import cpu_ns, free_port, pin_self, pinned, rss_mb, scratch_dir, wait_ready  # noqa: E402
from benchmarks.traffic import HARNESSES, HarnessSession, auth_headers, direct_body  # noqa: E402

LITELLM = "1.108.7"
TOKEN_DELAY = 0.01
NAN = float("nan")
LITELLM_KEY = "sk-" + "5eb1c7" * 8


# -- the targets ------------------------------------------------------------------------------------------------
def litellm_python() -> Path:
    """LiteLLM's proxy in a venv of its own (its dependencies are not ours), built once per version."""
    venv = Path.home() / ".cache" / "polar_gym" / f"bench-litellm-{LITELLM}"
    if not (venv / ".complete").exists():
        print(f"building {venv} (litellm[proxy]=={LITELLM}, once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"litellm[proxy]=={LITELLM}"], check=True)
        (venv / ".complete").touch()
    return venv / "bin" / "litellm"


@dataclass
class Target:
    name: str
    url: str
    process: subprocess.Popen | None  # whose CPU is measured (None: direct, nothing in between)
    key: str | None = None  # the one key every call sends (LiteLLM's master key), else each session's own

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()


def start_upstream() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(pinned([sys.executable, str(ROOT / "benchmarks" / "fast_upstream.py"), "--port", str(port),
                                    "--prompt-tokens", "0", "--token-delay", str(TOKEN_DELAY)], 1),
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/")
    return proc, url


def start_polar(upstream: str, tree: Path = ROOT, name: str = "polar") -> Target:
    """polar_gym's proxy from ``tree`` (this one, or an earlier commit's worktree: ``--rev``)."""
    port = free_port()
    proc = subprocess.Popen(pinned([sys.executable, "-m", "polar_gym.proxy", "--engine", "vllm", "--upstream", upstream,
                                    "--prompt-mode", "chat", "--port", str(port), "--capture-dir",
                                    scratch_dir("polar-traffic-capture-"), "--admin-token", "bench",
                                    "--log-level", "warning"], 0),
                            env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/health")
    return Target(name, url, proc)


def worktree(rev: str) -> Path:
    """A detached worktree of ``rev`` (removed when the run ends), to run its proxy beside this tree's."""
    folder = Path(scratch_dir(f"polar-traffic-{rev[:12]}-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(folder), rev], check=True)
    atexit.register(subprocess.run, ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(folder)],
                    check=False)
    return folder


def start_litellm(upstream: str) -> Target:
    litellm = litellm_python()
    folder = Path(scratch_dir("polar-traffic-litellm-"))
    config = folder / "config.yaml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "model_list": [{"model_name": name, "litellm_params": {"model": "hosted_vllm/policy",
                                                               "api_base": upstream + "/v1", "api_key": "none"}}
                       for name in ("policy", "policy-side")],
        "litellm_settings": {"drop_params": True, "telemetry": False},
        "general_settings": {"master_key": LITELLM_KEY}}))  # it refuses to start without one
    port = free_port()
    env = {**os.environ, "LITELLM_LOG": "ERROR", "DISABLE_SCHEMA_UPDATE": "true", "LITELLM_TELEMETRY": "False",
           "NO_DOCS": "True"}
    proc = subprocess.Popen(pinned([str(litellm), "--config", str(config), "--port", str(port), "--num_workers", "1"],
                                   0), env=env, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/health/liveliness", timeout=180)
    return Target("litellm", url, proc, LITELLM_KEY)


# -- the load ----------------------------------------------------------------------------------------------------
#: the least time a call takes at the paced phase's token delay (56 streamed tokens): bounds the calls to prepare
MIN_CALL_SECONDS = 0.5


@dataclass
class Plan:
    """One session's calls to one target, prepared before the phase (the load generator only sends and reads:
    building a direct Chat body costs up to 7 ms, which would land on the upstream's core mid-phase)."""

    harness: str
    key: str
    start: float  # seconds after the phase starts
    calls: list[tuple[str, bytes]]  # (path, body)
    waits: list[float]  # seconds after each call (a tool's run, a user away)


def plan(target: str, seed: int, start: float, horizon: float, paced: bool) -> Plan:
    """Session ``seed``'s calls as ``target`` receives them: only those that can start within ``horizon`` s."""
    rng = random.Random(seed)
    harness = sorted(HARNESSES)[seed % len(HARNESSES)]
    session = HarnessSession(harness, seed)
    turns, pause_at = rng.randint(5, 60), rng.randint(1, 60) if rng.random() < 0.1 else -1
    compact_at = turns // 2 if rng.random() < 0.2 else -1
    calls, waits = [], []
    for turn in range(min(turns, int(horizon / MIN_CALL_SECONDS) + 1)):
        if turn == compact_at:
            session.compact()
        body, path = session.next_body(), session.path
        if target == "direct":
            body, path = direct_body(harness, path, body), "/v1/chat/completions"
        calls.append((path, body))
        waits.append(rng.uniform(0.2, 1.5) + (rng.uniform(5, 20) if turn == pause_at else 0) if paced else 0.0)
    return Plan(harness, f"traffic-{seed}", start, calls, waits)


@dataclass
class Tally:
    ttfb: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    in_flight_seconds: float = 0.0  # summed over sessions: how long each was going

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


async def call(http: aiohttp.ClientSession, target: Target, session: Plan, n: int, tally: Tally) -> bool:
    """Call ``n`` of ``session``, read to its end; whether it was answered 200."""
    path, body = session.calls[n]
    headers = auth_headers(HARNESSES[session.harness].front_end, target.key or session.key)
    t0 = time.perf_counter()
    first_byte = None
    try:
        async with http.post(target.url + path, data=body, headers=headers) as resp:
            async for _ in resp.content.iter_any():
                if first_byte is None:
                    first_byte = time.perf_counter() - t0
            if resp.status != 200:
                tally.error(f"{session.harness} HTTP {resp.status}")
                return False
    except (TimeoutError, aiohttp.ClientError) as exc:
        tally.error(f"{session.harness} {type(exc).__name__}")
        return False
    tally.total.append(time.perf_counter() - t0)
    tally.ttfb.append(first_byte if first_byte is not None else tally.total[-1])
    return True


async def run_plans(target: Target, plans: list[Plan], tally: Tally, until: float) -> None:
    """Sessions one after another (a slot of the saturation phase, or one paced session)."""
    for session in plans:
        started = time.monotonic()
        for n in range(len(session.calls)):
            if time.monotonic() >= until:
                break
            await call(_HTTP[0], target, session, n, tally)
            if session.waits[n]:
                await asyncio.sleep(session.waits[n])
        tally.in_flight_seconds += time.monotonic() - started


_HTTP: list[aiohttp.ClientSession] = []


async def phase(target: Target, slots: list[list[Plan]], seconds: float) -> tuple[Tally, float, float]:
    """Each slot's sessions (from their planned starts) until ``seconds`` are up: (tally, wall, the target's CPU
    seconds)."""
    pid = target.process.pid if target.process is not None else None
    tally = Tally()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as http:
        _HTTP[:] = [http]
        cpu0, t0 = (cpu_ns(pid) if pid else 0), time.monotonic()
        until = t0 + seconds

        async def slot(plans: list[Plan]) -> None:
            await asyncio.sleep(plans[0].start)
            await run_plans(target, plans, tally, until)

        await asyncio.gather(*(slot(plans) for plans in slots))
        wall = time.monotonic() - t0
        cpu = (cpu_ns(pid) - cpu0) / 1e9 if pid else 0.0
    return tally, wall, cpu


async def per_call_cpu(target: Target, sessions: int = 3, turns: int = 8) -> dict[str, Any]:
    """One call at a time (the upstream answering at once), the target's CPU read around each: a session's first
    call and its later ones, per harness."""
    pid = target.process.pid if target.process is not None else None
    tally = Tally()
    first: dict[str, list[float]] = {}
    later: dict[str, list[float]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for k, harness in enumerate(sorted(HARNESSES)):
            for n in range(sessions):
                seed = 900_000 + len(HARNESSES) * n + k
                session = plan(target.name, seed, 0.0, turns * MIN_CALL_SECONDS, False)
                for turn in range(min(turns, len(session.calls))):
                    cpu0 = cpu_ns(pid) if pid else 0
                    if await call(http, target, session, turn, tally) and pid:
                        (first if turn == 0 else later).setdefault(harness, []).append((cpu_ns(pid) - cpu0) / 1e6)
    mean = statistics.fmean
    return {"first_call_cpu_ms": {h: mean(v) for h, v in first.items()},
            "later_call_cpu_ms": {h: mean(v) for h, v in later.items()},
            "first_call_cpu_ms_all": mean([x for v in first.values() for x in v]) if first else float("nan"),
            "later_call_cpu_ms_all": mean([x for v in later.values() for x in v]) if later else float("nan"),
            "errors": tally.errors}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return 1000 * values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summarize(target: Target, tally: Tally, wall: float, cpu: float, sessions: int, rss0: float) -> dict[str, Any]:
    pid = target.process.pid if target.process is not None else None
    calls = len(tally.total)
    share = cpu / wall if wall else 0.0
    in_flight = tally.in_flight_seconds / wall if wall else 0.0
    rss = rss_mb(pid) if pid else float("nan")
    return {
        "target": target.name, "sessions": sessions, "calls": calls, "errors": tally.errors,
        "calls_per_s": calls / wall, "wall_s": wall,
        "ttfb_p50_ms": _pct(tally.ttfb, 0.5), "ttfb_p99_ms": _pct(tally.ttfb, 0.99),
        "total_p50_ms": _pct(tally.total, 0.5), "total_p99_ms": _pct(tally.total, 0.99),
        "cpu_ms_per_call": 1000 * cpu / calls if calls and pid else float("nan"),
        "cpu_share": share, "sessions_in_flight": in_flight,
        "sessions_per_core": in_flight / share if share else float("nan"),
        "rss_mb": rss, "rss_kb_per_session": 1024 * (rss - rss0) / sessions if pid and sessions else float("nan"),
    }


def set_token_delay(upstream: str, seconds: float) -> None:
    import httpx

    httpx.post(f"{upstream}/bench/token-delay?seconds={seconds}", timeout=10).raise_for_status()


def run_target(target: Target, upstream: str, args: argparse.Namespace) -> dict[str, Any]:
    """The phases asked for on one target: per-call CPU, saturation (the upstream answering at once), paced."""
    out: dict[str, Any] = {"target": target.name}
    set_token_delay(upstream, 0.0)
    if "per_call" in args.phases:
        show_per_call(target, out.setdefault("per_call", asyncio.run(per_call_cpu(target))))
    if "saturated" in args.phases:
        out["saturated"] = saturated(target, args)
    if "paced" in args.phases:
        set_token_delay(upstream, TOKEN_DELAY)
        out["paced"] = paced(target, args)
    return out


def show_per_call(target: Target, pc: dict[str, Any]) -> None:
    each = "  ".join(f"{h} {pc['first_call_cpu_ms'].get(h, NAN):.1f}/{pc['later_call_cpu_ms'].get(h, NAN):.1f}"
                     for h in sorted(HARNESSES))
    print(f"  {target.name:<8} CPU a call, one at a time: first call of a session {pc['first_call_cpu_ms_all']:6.2f} "
          f"ms, later calls {pc['later_call_cpu_ms_all']:6.2f} ms  ({each}){_errors(pc)}", flush=True)


def saturated(target: Target, args: argparse.Namespace) -> dict[str, Any]:
    """``args.saturate`` sessions at once, each call sent as the last one is answered, the upstream answering at
    once: the calls a second the target sustains."""
    horizon = args.seconds / 2
    per_slot = int(horizon / 0.01) + 1  # calls a slot can make: at most one per 10 ms at full speed
    slots, seed = [], 2_000_000
    for _ in range(args.saturate):
        plans, planned = [], 0
        while planned < min(per_slot, 120):
            plans.append(plan(target.name, seed, 0.0, horizon, False))
            planned += len(plans[-1].calls)
            seed += 1
        slots.append(plans)
    tally, wall, cpu = asyncio.run(phase(target, slots, horizon))
    row = summarize(target, tally, wall, cpu, sum(len(s) for s in slots), 0.0)
    print(f"  {target.name:<8} saturated ({args.saturate} sessions at once, no wait): {row['calls_per_s']:7.1f} "
          f"calls/s, CPU {row['cpu_ms_per_call']:6.2f} ms a call, end p50 {row['total_p50_ms']:6.1f} ms p99 "
          f"{row['total_p99_ms']:7.1f} ms{_errors(row)}", flush=True)
    return row


def paced(target: Target, args: argparse.Namespace) -> dict[str, Any]:
    """Sessions arriving at random, each with a tool's time between its calls, the upstream streaming a token
    every TOKEN_DELAY: latency, the target's CPU, sessions per core, memory."""
    pid = target.process.pid if target.process is not None else None
    rng = random.Random(1)
    starts, t = [], 0.0
    while t < args.seconds:
        starts.append(t)
        t += rng.expovariate(args.rate)
    sessions = [[plan(target.name, 1_000_000 + i, start, args.seconds - start, True)] for i, start in enumerate(starts)]
    rss0 = rss_mb(pid) if pid else 0.0
    tally, wall, cpu = asyncio.run(phase(target, sessions, args.seconds))
    row = summarize(target, tally, wall, cpu, len(sessions), rss0)
    print(f"  {target.name:<8} paced ({len(sessions)} sessions arriving {args.rate:g}/s): {row['calls']} calls, "
          f"first byte p50/p99 {row['ttfb_p50_ms']:.1f}/{row['ttfb_p99_ms']:.1f} ms, end {row['total_p50_ms']:.1f}/"
          f"{row['total_p99_ms']:.1f} ms, CPU {row['cpu_ms_per_call']:.2f} ms a call, "
          f"{row['sessions_in_flight']:.0f} sessions in flight on {100 * row['cpu_share']:.1f} % of a core: "
          f"{row['sessions_per_core']:.0f} sessions per core; RSS {row['rss_mb']:.0f} MB "
          f"(+{row['rss_kb_per_session']:.0f} KB a session){_errors(row)}", flush=True)
    return row


# -- the run ----------------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20 s a target, 16 sessions in the saturation phase")
    parser.add_argument("--seconds", type=float, default=60.0, help="the paced phase (the saturation phase: half)")
    parser.add_argument("--rate", type=float, default=2.0, help="sessions arriving a second")
    parser.add_argument("--saturate", type=int, default=32, help="sessions at once in the saturation phase")
    parser.add_argument("--no-litellm", action="store_true", help="leave LiteLLM out (no venv to build)")
    parser.add_argument("--targets", nargs="*", default=None, help="of polar litellm direct polar@REV, in this order")
    parser.add_argument("--phases", nargs="*", default=["per_call", "saturated", "paced"],
                        help="of per_call saturated paced")
    parser.add_argument("--rev", action="append", default=[],
                        help="also run the proxy of this commit (a worktree) as target polar@REV, in the same run")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.saturate = 20.0, 16
    names = args.targets or ["direct", "polar", *([] if args.no_litellm else ["litellm"])]
    names += [f"polar@{rev}" for rev in args.rev]
    trees = {name: worktree(name.partition("@")[2]) for name in dict.fromkeys(names) if name.startswith("polar@")}
    pin_self(1)
    upstream, upstream_url = start_upstream()
    results = []
    try:
        for name in names:
            target = (start_polar(upstream_url) if name == "polar" else start_litellm(upstream_url)
                      if name == "litellm" else start_polar(upstream_url, trees[name], name) if name in trees
                      else Target("direct", upstream_url, None))
            print(f"{name}:", flush=True)
            try:
                results.append(run_target(target, upstream_url, args))
            finally:
                target.stop()
    finally:
        upstream.terminate()
    ratios({r["target"]: r for r in results})
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "bench_traffic.json"
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "targets": results}, indent=1))
    print(f"results: {out}")
    return 0


def _errors(row: dict[str, Any]) -> str:
    return f"  errors {row['errors']}" if row["errors"] else ""


def ratios(by: dict[str, dict[str, Any]]) -> None:
    print()
    if "polar" in by and "direct" in by:
        polar, direct = by["polar"], by["direct"]
        print(f"polar vs direct: end p50 +{polar['paced']['total_p50_ms'] - direct['paced']['total_p50_ms']:.1f} ms, "
              f"p99 +{polar['paced']['total_p99_ms'] - direct['paced']['total_p99_ms']:.1f} ms (paced); "
              f"{polar['saturated']['calls_per_s'] / direct['saturated']['calls_per_s']:.2f}x the calls/s (saturated)")
    if "polar" in by and "litellm" in by:
        polar, lite = by["polar"], by["litellm"]

        def times(phase: str, key: str) -> float:
            return float(lite[phase][key]) / float(polar[phase][key]) if polar[phase][key] else NAN

        print(f"polar vs litellm: {1 / times('saturated', 'calls_per_s'):.1f}x the calls/s (saturated); "
              f"{times('per_call', 'later_call_cpu_ms_all'):.1f}x less CPU a later call, "
              f"{times('per_call', 'first_call_cpu_ms_all'):.1f}x less a first call; "
              f"{1 / times('paced', 'sessions_per_core'):.1f}x the sessions per core (paced)")
    if "polar" in by:
        print(f"capacity at this pace: {by['polar']['paced']['sessions_per_core']:.0f} sessions per proxy core")


if __name__ == "__main__":
    raise SystemExit(main())
