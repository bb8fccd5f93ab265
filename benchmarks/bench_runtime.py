"""Sandbox session cost per backend, against a plain subprocess measured in the same run.

    .venv/bin/python benchmarks/bench_runtime.py [--sessions 50] [--docker-sessions 10] [--no-docker]
                                                 [--out benchmarks/results]

One session = start + one exec (``true``) + stop. Measured: latency over sequential sessions (p50 / p99), and the wall
time of 16 sessions at once. Baseline: ``asyncio.create_subprocess_exec("true")`` + wait. Printed: each backend's
ratio to the baseline and the milliseconds it adds per session (target: local adds under 50 ms). Docker runs when
its CLI and the busybox test image work here (podman with ``--runtime runc`` on this machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from polar_gym.runtime.base import Runtime  # noqa: E402
from polar_gym.runtime.local import LocalRuntime  # noqa: E402
from polar_gym.schema import RuntimeSpec  # noqa: E402

CONCURRENT = 16
TARGET_ADDED_MS = 50.0
Session = Callable[[Path], Awaitable[None]]


async def plain_session(_: Path) -> None:
    proc = await asyncio.create_subprocess_exec("true")
    await proc.wait()


def runtime_session(make: Callable[[Path], Runtime]) -> Session:
    async def session(path: Path) -> None:
        async with make(path) as rt:
            result = await rt.exec(["true"])
            if not result.ok:
                raise RuntimeError(f"exec failed: {result}")
    return session


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(session: Session, n: int, workdir: Path) -> dict[str, Any]:
    await session(_fresh(workdir))  # warm-up (relay build, image cache, imports)
    times = []
    for _ in range(n):
        path = _fresh(workdir)
        t0 = time.perf_counter()
        await session(path)
        times.append((time.perf_counter() - t0) * 1000)
    paths = [_fresh(workdir) for _ in range(CONCURRENT)]
    t0 = time.perf_counter()
    await asyncio.gather(*(session(p) for p in paths))
    wall = (time.perf_counter() - t0) * 1000
    return {"sessions": n, "p50_ms": _pct(times, 0.5), "p99_ms": _pct(times, 0.99),
            "mean_ms": statistics.fmean(times), f"concurrent_{CONCURRENT}_wall_ms": wall}


_counter = iter(range(10**9))


def _fresh(workdir: Path) -> Path:
    path = workdir / f"s{next(_counter)}"
    path.mkdir()
    return path


def docker_factory() -> tuple[Callable[[Path], Runtime] | None, str]:
    """A podman-backed docker runtime factory, or None and why not."""
    try:
        from polar_gym.runtime.docker import DockerRuntime
        from polar_gym.runtime.testimage import TEST_IMAGE, ensure_test_image
    except ImportError as exc:
        return None, f"docker backend not importable: {exc}"
    cli = os.environ.get("POLAR_DOCKER_CLI") or ("podman --runtime runc" if shutil.which("podman") else "docker")
    if shutil.which(cli.split()[0]) is None:
        return None, f"{cli.split()[0]} not installed"
    run_args = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024", "--pull", "never"]
    try:
        ensure_test_image(cli.split())
    except Exception as exc:  # any failure means "skip docker", with the reason
        return None, f"no test image: {exc}"
    spec = RuntimeSpec(backend="docker", image=TEST_IMAGE, network="none")
    options = {"cli": cli.split(), "run_args": run_args}  # the operator's, never a request's (issue 11)
    return (lambda path: DockerRuntime(spec, path, options=options)), "ok"


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"concurrent": CONCURRENT, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as tmp:
        work = Path(tmp)
        results["plain_subprocess"] = await measure(plain_session, args.sessions, work)
        local_spec = RuntimeSpec(backend="local", network="none")
        results["local"] = await measure(runtime_session(lambda p: LocalRuntime(local_spec, p)), args.sessions, work)
        gw_note = ("network none, default limits (as root: launcher, uid drop, pids+memory cgroups; disk watchdog); "
                   "gateway mode adds a Unix server per session")
        results["local"]["note"] = gw_note
        if not args.no_docker:
            factory, why = docker_factory()
            if factory is not None:
                results["docker"] = await measure(runtime_session(factory), args.docker_sessions, work)
            else:
                results["docker"] = {"skipped": why}
    base = results["plain_subprocess"]
    for name in ("local", "docker"):
        r = results.get(name)
        if not r or "skipped" in r:
            continue
        r["ratio_p50"] = r["p50_ms"] / base["p50_ms"]
        r["added_ms_p50"] = r["p50_ms"] - base["p50_ms"]
        r["added_ms_p99"] = r["p99_ms"] - base["p99_ms"]
        key = f"concurrent_{CONCURRENT}_wall_ms"
        r["ratio_concurrent"] = r[key] / base[key]
        r["added_ms_per_session_concurrent"] = (r[key] - base[key]) / CONCURRENT
    results["local"]["meets_target"] = results["local"]["added_ms_p50"] < TARGET_ADDED_MS
    return results


def report(results: dict[str, Any]) -> None:
    key = f"concurrent_{CONCURRENT}_wall_ms"
    print(f"{'backend':<18}{'p50 ms':>9}{'p99 ms':>9}{'x plain':>9}{'+ms p50':>9}{'+ms p99':>9}"
          f"{f'{CONCURRENT} at once':>13}{'x plain':>9}")
    for name in ("plain_subprocess", "local", "docker"):
        r = results.get(name)
        if r is None:
            continue
        if "skipped" in r:
            print(f"{name:<18}skipped: {r['skipped']}")
            continue
        print(f"{name:<18}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}{r.get('ratio_p50', 1.0):>9.1f}"
              f"{r.get('added_ms_p50', 0.0):>9.2f}{r.get('added_ms_p99', 0.0):>9.2f}{r[key]:>11.1f}ms"
              f"{r.get('ratio_concurrent', 1.0):>9.1f}")
    local = results["local"]
    verdict = "meets" if local["meets_target"] else "MISSES"
    print(f"local adds {local['added_ms_p50']:.1f} ms per session at p50 ({verdict} the < {TARGET_ADDED_MS:.0f} ms "
          f"target); {local['added_ms_per_session_concurrent']:.1f} ms per session with {CONCURRENT} at once")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--docker-sessions", type=int, default=10)
    parser.add_argument("--no-docker", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    report(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_runtime.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out / 'bench_runtime.json'}")


if __name__ == "__main__":
    main()
