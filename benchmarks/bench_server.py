"""Rollout server dispatch overhead: 10,000 sessions through the real server to fast fake gateways, against the same
sessions posted straight to those gateways, and restart recovery with 10,000 stored tasks, in the same run.

    .venv/bin/python benchmarks/bench_server.py [--quick] [--sessions 10000] [--samples 1] [--gateways 4]
        [--concurrency 32] [--delay 0] [--stored 10000] [--inflight 1000] [--out benchmarks/results]

Fake gateways: bare ASGI apps, one uvicorn process each on loopback, with exactly the routes the server uses
(POST /sessions 201 or 409, POST /sessions/poll, POST /sessions/{id}/cancel, GET /gateway/health; and
GET /sessions/{id}/result?wait=S 200 or 202 for the baseline); a session finishes COMPLETED ``--delay`` seconds
after it arrived. The HTTP cost is real; the sandbox cost is zero, so what is left is the server's own cost.

- ``server``: the real rollout server as a process (``python -m polar_gym.server``, SQLite store in a temp dir),
  the gateways registered through its API; ``--concurrency`` trainer workers submit the tasks (``--samples``
  sessions each) with RolloutClient and a CallbackReceiver takes each finished task. Measured: sessions per second
  from the first submit to the last callback, and scheduling latency (the store's ``dispatched - created``).
- ``baseline``: the same session specs posted straight to the same gateways round robin by ``--concurrency``
  workers, each long-polling its result: the floor cost without the server. Ratio = server / baseline throughput.
- ``recovery``: a copy of the run's db topped up to ``--stored`` finished tasks, plus ``--inflight`` sessions in
  flight on a registered live gateway (watched again) and ``--inflight / 10`` on a dead one (re-dispatched); time to
  open the Store and ``RolloutServer.start()``, the first API answer, the first re-dispatch and every in-flight
  session finished; baseline: the same with an empty db.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httpx
import orjson
import uvicorn
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from polar_gym.schema import AgentSpec, SessionResult, SessionSpec, SessionStatus, TaskRequest  # noqa: E402
from polar_gym.server import CallbackReceiver, RolloutClient, RolloutServer, Store, create_server_app  # noqa: E402
from polar_gym.server.fleet import DEAD, HEALTHY  # noqa: E402
from polar_gym.server.store import GatewayRow  # noqa: E402

TOKEN = "bench-server-admin"
GW_TOKEN = "bench-gateway-admin"
INSTRUCTION = ("Fix the failing test in tests/test_parser.py without changing its assertions; run the suite and "
               "explain the root cause in one paragraph. ") * 4
console = Console(width=140)


# -- the fake gateway ----------------------------------------------------------------------------------------------

async def read_body(receive: Callable[..., Awaitable[Any]]) -> bytes:
    """A bare ASGI app's request body, read to its end."""
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


def gateway_app(delay: float) -> Callable[..., Awaitable[None]]:
    """A bare ASGI gateway: sessions finish COMPLETED ``delay`` s after POST /sessions. A result asked for an id it
    never got is answered COMPLETED too: it stands for a session the gateway ran while the server was down."""
    done: dict[str, asyncio.Event] = {}
    tasks: dict[str, str] = {}
    status: dict[str, str] = {}
    json_h = [(b"content-type", b"application/json")]

    def result(session_id: str) -> bytes:
        return orjson.dumps({"session_id": session_id, "task_id": tasks.get(session_id, session_id.rsplit("-", 2)[0]),
                             "status": status.get(session_id, "COMPLETED"), "reason": None,
                             "evaluation": {"reward": 1.0, "passed": True}, "timings": {"run": delay}})

    finished = [asyncio.Event()]  # replaced on every finish: what a batch poll waits on

    def finish(session_id: str) -> None:
        status.setdefault(session_id, "COMPLETED")
        done[session_id].set()
        finished[0].set()
        finished[0] = asyncio.Event()

    async def poll(ids: list[str], wait: float) -> bytes:
        deadline = time.monotonic() + min(wait, 600.0)
        while True:
            ready = [i for i in ids if i not in done or done[i].is_set()]
            remaining = deadline - time.monotonic()
            if ready or remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(finished[0].wait(), remaining)
        results = b",".join(result(i) for i in ready)
        statuses = {i: "RUNNING" for i in ids if i not in ready}
        return b'{"results":[' + results + b'],"statuses":' + orjson.dumps(statuses) + b',"unknown":[]}'

    async def app(scope: dict[str, Any], receive: Callable[..., Awaitable[Any]],
                  send: Callable[..., Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        method, path = scope["method"], scope["path"]
        code, out = 404, b'{"error": {"type": "not_found"}}'
        parts = path.strip("/").split("/")
        if method == "POST" and path == "/sessions":
            spec = orjson.loads(body)
            sid = spec["session_id"]
            if sid in done:
                code, out = 409, b'{"error": {"type": "duplicate_session"}}'
            else:
                done[sid], tasks[sid] = asyncio.Event(), spec["task_id"]
                if delay > 0:
                    asyncio.get_running_loop().call_later(delay, finish, sid)
                else:
                    finish(sid)
                code, out = 201, orjson.dumps({"session_id": sid, "status": "INITIALIZING"})
        elif method == "POST" and path == "/sessions/poll":
            request = orjson.loads(body)
            code, out = 200, await poll(request["session_ids"], float(request.get("wait", 0.0)))
        elif method == "GET" and len(parts) == 3 and parts[0] == "sessions" and parts[2] == "result":
            sid = parts[1]
            event = done.get(sid)
            if event is not None and not event.is_set():
                wait = float(parse_qs(scope["query_string"].decode()).get("wait", ["0"])[0])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), min(wait, 600.0))
            if event is None or event.is_set():
                code, out = 200, result(sid)
            else:
                code, out = 202, orjson.dumps({"session_id": sid, "status": "RUNNING"})
        elif method == "POST" and len(parts) == 3 and parts[0] == "sessions" and parts[2] == "cancel":
            sid = parts[1]
            if sid in done:
                status.setdefault(sid, "CANCELLED")
                done[sid].set()
                code, out = 200, orjson.dumps({"cancelled": True, "session_id": sid})
        elif method == "GET" and path == "/gateway/health":
            code, out = 200, orjson.dumps({"status": "ok", "sessions": len(done)})
        await send({"type": "http.response.start", "status": code, "headers": json_h})
        await send({"type": "http.response.body", "body": out})

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_gateway(port: int, delay: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve-gateway", str(port),
                             "--delay", str(delay)], cwd=ROOT)


def spawn_server(port: int, db: Path) -> subprocess.Popen[bytes]:
    """The rollout server as it is deployed: its own process, with its own event loop."""
    return subprocess.Popen([sys.executable, "-m", "polar_gym.server", "--port", str(port), "--db", str(db),
                             "--admin-token", TOKEN, "--log-level", "warning"], cwd=ROOT)


async def wait_http(url: str, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Until ``url`` answers below 500; fails at ``timeout`` or when ``proc`` (the process behind it) exits."""
    async with httpx.AsyncClient() as http:
        end = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(url)).status_code < 500:
                    return
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the process behind {url} exited with {proc.returncode}")
            if time.monotonic() > end:
                raise RuntimeError(f"{url} did not come up in {timeout} s")
            await asyncio.sleep(0.05)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class QuietServer(uvicorn.Server):
    """uvicorn on this event loop, leaving the process's signal handlers alone."""

    def install_signal_handlers(self) -> None:
        return None


@contextlib.asynccontextmanager
async def serve(app: Any, port: int, lifespan: str = "off") -> AsyncIterator[QuietServer]:
    server = QuietServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan,
                                        access_log=False, timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.002)
    try:
        yield server
    finally:
        server.should_exit = True
        await task


# -- workload ------------------------------------------------------------------------------------------------------

def make_tasks(n_sessions: int, samples: int, callback_url: str | None, prefix: str) -> list[TaskRequest]:
    n_tasks = max(1, n_sessions // samples)
    return [TaskRequest(task_id=f"{prefix}-{i:06d}", instruction=INSTRUCTION, num_samples=samples,
                        timeout_seconds=600, agent=AgentSpec(harness="codex", config={"reasoning": "high"}),
                        callback_url=callback_url, metadata={"group_id": f"g{i}", "policy_version": 3})
            for i in range(n_tasks)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def latency_stats(values: list[float]) -> dict[str, float]:
    return {"p50_ms": percentile(values, 0.5) * 1e3, "p99_ms": percentile(values, 0.99) * 1e3,
            "max_ms": max(values, default=float("nan")) * 1e3,
            "mean_ms": statistics.fmean(values) * 1e3 if values else float("nan")}


class Ticker:
    """Prints one progress line every ``every`` seconds of a long phase."""

    def __init__(self, what: str, every: float = 2.0) -> None:
        self.what, self.every, self.t0, self.next = what, every, time.monotonic(), time.monotonic() + every

    def __call__(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if force or now >= self.next:
            self.next = now + self.every
            console.print(f"  [{self.what} {now - self.t0:6.1f} s] {text}")


# -- phase 1: through the server -----------------------------------------------------------------------------------

async def run_server(args: argparse.Namespace, gateways: list[str], tmp: Path) -> dict[str, Any]:
    db = tmp / "server.sqlite"
    port = free_port()
    proc = spawn_server(port, db)
    url = f"http://127.0.0.1:{port}"
    receiver = CallbackReceiver(max_pending=1_000_000)  # the benchmark reads every body from `received`
    cb_port = free_port()
    callback_url = f"http://127.0.0.1:{cb_port}/callback"
    tasks = [receiver.attach(t, callback_url) for t in make_tasks(args.sessions, args.samples, callback_url, "srv")]
    n_sessions = sum(t.num_samples for t in tasks)
    try:
        await wait_http(f"{url}/health")
        async with serve(receiver.app, cb_port), RolloutClient(url, TOKEN) as client:
            for gw in gateways:
                resp = await client.http.post("/gateways/register", json={"url": gw, "capacity": args.capacity,
                                                                           "admin_token": GW_TOKEN})
                resp.raise_for_status()
            queue: asyncio.Queue[TaskRequest] = asyncio.Queue()
            for t in tasks:
                queue.put_nowait(t)
            submitted = 0

            async def worker() -> None:
                nonlocal submitted
                while not queue.empty():
                    await client.submit(queue.get_nowait())
                    submitted += 1

            tick = Ticker("server")
            t0 = time.perf_counter()
            workers = asyncio.gather(*(worker() for _ in range(args.concurrency)))
            submit_s: float | None = None
            while len(receiver.received) < len(tasks):
                if workers.done():
                    workers.result()
                    if submit_s is None:
                        submit_s = time.perf_counter() - t0
                if time.perf_counter() - t0 > args.timeout:
                    raise TimeoutError(f"server phase: {len(receiver.received)}/{len(tasks)} tasks after "
                                       f"{args.timeout} s")
                tick(f"submitted {submitted}/{len(tasks)} tasks, callbacks {len(receiver.received)}/{len(tasks)}")
                receiver.arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(receiver.arrived.wait(), 0.5)
            seconds = time.perf_counter() - t0
            await workers
            submit_s = submit_s if submit_s is not None else seconds
            tick(f"all {len(tasks)} tasks called back", force=True)
            metrics = (await client.http.get("/metrics")).text
    finally:
        stop(proc)
    con = sqlite3.connect(db)
    rows = con.execute("SELECT status, created, dispatched, finished, attempts FROM sessions").fetchall()
    con.close()
    sched = [d - c for _, c, d, _, _ in rows if d is not None]
    e2e = [f - c for _, c, _, f, _ in rows if f is not None]
    statuses: dict[str, int] = {}
    for status, *_ in rows:
        statuses[status] = statuses.get(status, 0) + 1
    return {"tasks": len(tasks), "sessions": n_sessions, "seconds": seconds, "submit_seconds": submit_s,
            "sessions_per_second": n_sessions / seconds, "statuses": statuses,
            "callbacks": len(receiver.received), "callback_deliveries": receiver.deliveries,
            "redispatches": sum(max(0, a - 1) for *_, a in rows),
            "scheduling_latency": latency_stats(sched), "session_latency": latency_stats(e2e),
            "dispatch_errors": [line for line in metrics.splitlines() if line.startswith("polar_server_errors")],
            "db": str(db)}


# -- phase 2: straight to the gateways -----------------------------------------------------------------------------

async def run_baseline(args: argparse.Namespace, gateways: list[str]) -> dict[str, Any]:
    tasks = make_tasks(args.sessions, args.samples, None, "base")
    specs = [SessionSpec.from_task(t, i) for t in tasks for i in range(t.num_samples)]
    queue: asyncio.Queue[tuple[int, SessionSpec]] = asyncio.Queue()
    for i, spec in enumerate(specs):
        queue.put_nowait((i, spec))
    statuses: dict[str, int] = {}
    latencies: list[float] = []
    headers = {"x-admin-token": GW_TOKEN, "content-type": "application/json"}
    tick = Ticker("baseline")

    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0)) as http:
        async def worker() -> None:
            while not queue.empty():
                i, spec = queue.get_nowait()
                gw = gateways[i % len(gateways)]
                start = time.perf_counter()
                resp = await http.post(f"{gw}/sessions", content=spec.model_dump_json(), headers=headers)
                assert resp.status_code == 201, resp.text
                while True:
                    resp = await http.get(f"{gw}/sessions/{spec.session_id}/result", params={"wait": 10.0},
                                          headers=headers)
                    if resp.status_code == 200:
                        break
                result = SessionResult.model_validate_json(resp.content)
                statuses[result.status.value] = statuses.get(result.status.value, 0) + 1
                latencies.append(time.perf_counter() - start)
                tick(f"{len(latencies)}/{len(specs)} sessions done")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        seconds = time.perf_counter() - t0
    tick(f"all {len(specs)} sessions done", force=True)
    return {"sessions": len(specs), "seconds": seconds, "sessions_per_second": len(specs) / seconds,
            "statuses": statuses, "session_latency": latency_stats(latencies)}


# -- phase 3: restart recovery -------------------------------------------------------------------------------------

async def prepare_recovery_db(path: Path, source: Path | None, stored: int, inflight: int, live_gw: str,
                              dead_gw: str) -> dict[str, int]:
    """Copy ``source`` (the run's db), top it up to ``stored`` finished tasks, and add sessions in flight on a live
    registered gateway and on a dead one, through the Store API."""
    if source is not None:
        shutil.copy(source, path)
    store = Store(path)
    try:
        have = len(await store.task_ids(limit=10 ** 9))
        filler = make_tasks(max(0, stored - have), 1, None, "old")
        for t in filler if stored > have else []:
            spec = SessionSpec.from_task(t, 0)
            await store.add_task(t, [spec])
            await store.assign(spec.session_id, "gw-retired")
            await store.finish(SessionResult(session_id=spec.session_id, task_id=t.task_id,
                                             status=SessionStatus.COMPLETED))
        known = {g.url: g.gateway_id for g in await store.gateways()}  # the run registered the live one
        live = known.get(live_gw, f"gw-live-{uuid.uuid4().hex[:6]}")
        dead = known.get(dead_gw, f"gw-dead-{uuid.uuid4().hex[:6]}")
        for gid, url, state in ((live, live_gw, HEALTHY), (dead, dead_gw, DEAD)):
            if url:
                await store.save_gateway(GatewayRow(gid, url, 100_000, GW_TOKEN, state))
        counts = {"live": inflight if live_gw else 0, "dead": inflight // 10 if dead_gw else 0}
        for gid, n, prefix in ((live, counts["live"], "live"), (dead, counts["dead"], "dead")):
            for t in make_tasks(n, 1, None, f"{prefix}-{uuid.uuid4().hex[:4]}"):
                spec = SessionSpec.from_task(t, 0)
                await store.add_task(t, [spec])
                await store.assign(spec.session_id, gid)
        total = len(await store.task_ids(limit=10 ** 9))
    finally:
        store.close()
    return {"stored_tasks": total, "inflight_live": counts["live"], "inflight_dead": counts["dead"]}


async def measure_recovery(path: Path) -> dict[str, Any]:
    """Store open + start() (the server's lifespan), then serve it and time the first answers and re-dispatches."""
    t0 = time.perf_counter()
    store = Store(path)
    opened = time.perf_counter() - t0
    core = RolloutServer(store)
    await core.start()
    started = time.perf_counter() - t0
    out: dict[str, Any] = {"open_store_s": opened, "start_s": started, "first_redispatch_s": None}

    async def first_redispatch() -> None:
        while not core.counters.dispatched:  # noqa: ASYNC110 - a counter; the server has no event for it
            await asyncio.sleep(0.002)
        out["first_redispatch_s"] = time.perf_counter() - t0

    watcher = asyncio.create_task(first_redispatch())
    try:
        port = free_port()
        async with serve(create_server_app(core, TOKEN, manage_lifecycle=False), port), \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers={"x-admin-token": TOKEN}) as http:
            (await http.get("/health")).raise_for_status()
            out["api_s"] = time.perf_counter() - t0
            first = await store.task_ids(limit=1)
            if first:
                (await http.get(f"/tasks/{first[0]}")).raise_for_status()
            out["task_view_s"] = time.perf_counter() - t0
            while True:
                sessions, _ = await store.counts()
                open_ = sum(n for s, n in sessions.items() if not SessionStatus(s).terminal)
                if open_ == 0:
                    break
                if time.perf_counter() - t0 > 300:
                    raise TimeoutError(f"recovery: {open_} sessions still open after 300 s")
                await asyncio.sleep(0.005)
            out["all_inflight_finished_s"] = time.perf_counter() - t0
            out["redispatched"] = core.counters.redispatched
            out["statuses"] = sessions
    finally:
        watcher.cancel()
        await core.stop()
        store.close()
    return out


async def run_recovery(args: argparse.Namespace, gateways: list[str], source: Path | None,
                       tmp: Path) -> dict[str, Any]:
    dead_url = f"http://127.0.0.1:{free_port()}"
    tick = Ticker("recovery")
    full = tmp / "recover-full.sqlite"
    tick("building the stored db", force=True)
    layout = await prepare_recovery_db(full, source, args.stored, args.inflight, gateways[0], dead_url)
    tick(f"stored {layout}; restarting", force=True)
    loaded = await measure_recovery(full)
    empty = tmp / "recover-empty.sqlite"
    Store(empty).close()
    baseline = await measure_recovery(empty)
    tick("done", force=True)
    return {"layout": layout, "stored": loaded, "empty": baseline,
            "start_ratio": loaded["start_s"] / baseline["start_s"],
            "api_ratio": loaded["api_s"] / baseline["api_s"]}


# -- driver --------------------------------------------------------------------------------------------------------

async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-server-"))
    ports = [free_port() for _ in range(args.gateways)]
    procs = [spawn_gateway(p, args.delay) for p in ports]
    gateways = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for gw in gateways:
            await wait_http(f"{gw}/gateway/health")
        console.print(f"[bold]server[/]: {args.sessions} sessions ({args.samples} per task) through the rollout "
                      f"server to {args.gateways} fake gateways")
        server = await run_server(args, gateways, tmp)
        console.print("[bold]baseline[/]: the same sessions straight to the gateways")
        baseline = await run_baseline(args, gateways)
        recovery = None
        if args.stored > 0:
            console.print(f"[bold]recovery[/]: restart with {args.stored} stored tasks")
            recovery = await run_recovery(args, gateways, Path(server["db"]), tmp)
    finally:
        for proc in procs:
            stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    server.pop("db")
    return {"config": {k: v for k, v in vars(args).items() if k not in ("out", "serve_gateway")},
            "cpus": os.cpu_count(), "server": server, "baseline": baseline,
            "throughput_ratio": server["sessions_per_second"] / baseline["sessions_per_second"],
            "recovery": recovery}


def render(res: dict[str, Any]) -> None:
    s, b = res["server"], res["baseline"]
    table = Table(title=f"dispatch: {s['sessions']} sessions, {res['config']['gateways']} fake gateways, "
                        f"{res['config']['concurrency']} client workers, {res['cpus']} CPUs")
    for col in ("path", "seconds", "sessions/s", "ratio", "sched p50 ms", "sched p99 ms", "session p50 ms",
                "session p99 ms", "statuses"):
        table.add_column(col, justify="left" if col in ("path", "statuses") else "right")
    table.add_row("server", f"{s['seconds']:.2f}", f"{s['sessions_per_second']:.0f}",
                  f"{res['throughput_ratio']:.2f}x", f"{s['scheduling_latency']['p50_ms']:.1f}",
                  f"{s['scheduling_latency']['p99_ms']:.1f}", f"{s['session_latency']['p50_ms']:.1f}",
                  f"{s['session_latency']['p99_ms']:.1f}", str(s["statuses"]))
    table.add_row("baseline (direct)", f"{b['seconds']:.2f}", f"{b['sessions_per_second']:.0f}", "1.00x", "-", "-",
                  f"{b['session_latency']['p50_ms']:.1f}", f"{b['session_latency']['p99_ms']:.1f}",
                  str(b["statuses"]))
    console.print(table)
    rec = res["recovery"]
    if rec is None:
        return
    lay = rec["layout"]
    table = Table(title=f"restart recovery: {lay['stored_tasks']} stored tasks, {lay['inflight_live']} in flight on "
                        f"a live gateway, {lay['inflight_dead']} on a dead one")
    for col in ("db", "open store ms", "start() ms", "API answers ms", "task view ms", "first re-dispatch ms",
                "all in-flight done ms"):
        table.add_column(col, justify="left" if col == "db" else "right")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}"

    for name in ("stored", "empty"):
        r = rec[name]
        table.add_row(name, ms(r["open_store_s"]), ms(r["start_s"]), ms(r["api_s"]), ms(r["task_view_s"]),
                      ms(r["first_redispatch_s"]), ms(r["all_inflight_finished_s"]))
    console.print(table)
    console.print(f"start() stored/empty: {rec['start_ratio']:.1f}x; API answering stored/empty: "
                  f"{rec['api_ratio']:.1f}x")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--samples", type=int, default=1, help="sessions per task (num_samples)")
    parser.add_argument("--gateways", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=100_000, help="registered capacity of each gateway")
    parser.add_argument("--concurrency", type=int, default=32, help="client workers (server and baseline)")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds a fake session runs")
    parser.add_argument("--stored", type=int, default=10_000, help="finished tasks in the restart db (0: skip)")
    parser.add_argument("--inflight", type=int, default=1000, help="sessions in flight at the restart")
    parser.add_argument("--timeout", type=float, default=1800.0, help="give up on the server phase after this")
    parser.add_argument("--quick", action="store_true", help="1,000 sessions, 1,000 stored tasks, 100 in flight")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--serve-gateway", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.sessions, args.stored, args.inflight = 1000, 1000, 100
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.serve_gateway is not None:  # a fake gateway process
        uvicorn.run(gateway_app(args.delay), host="127.0.0.1", port=args.serve_gateway, log_level="warning",
                    access_log=False, lifespan="off")
        return {}
    results = asyncio.run(main_async(args))
    render(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_server.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
