"""Hostile input against a real gateway and a real rollout server, each in its own process (issue 11, fault 6).

    python benchmarks/bench_hostile.py [--src DIR] [--bodies 4] [--mb 50] [--samples 4096]

1. Four 50 MB POST /sessions/poll without a token to a gateway: its RSS before and after (and its peak), and what
   each request got back.
2. A task of ``--samples`` sessions submitted to a rollout server while /health is called every 10 ms: the
   slowest /health answer during the submit against the slowest one before it (the ratio is what matters).

``--src`` runs the services from another checkout (e.g. ``git archive main | tar -x -C /tmp/main``) to compare.
Takes ~20 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

TOKEN = "bench-admin-token"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process, in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


@contextlib.asynccontextmanager
async def process(args: list[str], src: str | None, url: str, probe: str):
    env = dict(os.environ)
    if src:  # ``python -m`` puts the working directory first on sys.path, before an editable install
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", *args, env=env, cwd=src,
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            for _ in range(600):
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(probe)).status_code == 200:
                        break
                if proc.returncode is not None:
                    raise RuntimeError(f"{args[0]} exited with {proc.returncode}")
                await asyncio.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def big_post(port: int, path: str, size: int) -> str:
    """POST ``size`` bytes without a token, from one reused 1 MB buffer; what the server answered."""
    chunk = b" " * (1 << 20)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     f"content-length: {size}\r\n\r\n".encode())
        sent = 0
        with contextlib.suppress(ConnectionError):
            while sent < size:
                writer.write(chunk[: size - sent])
                sent += min(len(chunk), size - sent)
                await writer.drain()
        with contextlib.suppress(ConnectionError):
            head = await asyncio.wait_for(reader.readline(), 120)
            return head.decode(errors="replace").strip() or "connection closed"
        return "connection reset"
    finally:
        writer.close()


async def gateway_bodies(src: str | None, bodies: int, mb: int) -> None:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        args = ["polar_gym.gateway", "--engine", "openai", "--upstream", "http://127.0.0.1:9/v1",
                "--port", str(port), "--admin-token", TOKEN,
                "--workdir", tmp, "--log-level", "warning"]
        async with process(args, src, f"http://127.0.0.1:{port}", "/gateway/health") as proc:
            before = rss_mb(proc.pid)
            started = time.perf_counter()
            answers = await asyncio.gather(*(big_post(port, "/sessions/poll", mb << 20) for _ in range(bodies)))
            took = time.perf_counter() - started
            await asyncio.sleep(0.5)
            after = rss_mb(proc.pid)
    print(f"gateway: {bodies} x {mb} MB POST /sessions/poll without a token, answered in {took:.1f} s: {answers[0]}")
    print(f"  RSS before {before[0]:.0f} MB, after {after[0]:.0f} MB, peak {after[1]:.0f} MB "
          f"(growth {after[1] - before[0]:+.0f} MB)")


async def server_health(src: str | None, samples: int) -> None:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        args = ["polar_gym.server", "--port", str(port), "--admin-token", TOKEN, "--db", f"{tmp}/s.sqlite",
                "--log-level", "warning"]
        url = f"http://127.0.0.1:{port}"
        async with process(args, src, url, "/health"), httpx.AsyncClient(base_url=url, timeout=600) as client:

            async def slowest(until: asyncio.Future[object] | None, count: int = 100) -> tuple[float, int]:
                worst, n = 0.0, 0
                while (until is None and n < count) or (until is not None and not until.done()):
                    t0 = time.perf_counter()
                    await client.get("/health")
                    worst, n = max(worst, time.perf_counter() - t0), n + 1
                    await asyncio.sleep(0.01)
                return worst, n

            idle, _ = await slowest(None)
            task = {"task_id": "big", "instruction": "x", "num_samples": samples, "agent": {"harness": "pi"}}
            t0 = time.perf_counter()
            submit = asyncio.ensure_future(client.post("/tasks", json=task, headers={"x-admin-token": TOKEN}))
            busy, n = await slowest(submit)
            resp = submit.result()
            took = time.perf_counter() - t0
    print(f"server: num_samples={samples} answered {resp.status_code} in {took:.2f} s; /health slowest "
          f"{busy * 1000:.0f} ms over {n} calls during the submit vs {idle * 1000:.0f} ms idle "
          f"(ratio {busy / max(idle, 1e-6):.0f}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", help="run the services from this source tree (PYTHONPATH)")
    p.add_argument("--bodies", type=int, default=4)
    p.add_argument("--mb", type=int, default=50)
    p.add_argument("--samples", type=int, default=4096)
    args = p.parse_args()
    asyncio.run(gateway_bodies(args.src, args.bodies, args.mb))
    asyncio.run(server_health(args.src, args.samples))


if __name__ == "__main__":
    main()
