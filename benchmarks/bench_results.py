"""Results at scale: thousands of concurrent sessions with real-sized results through the real rollout server, this
tree's server against a baseline revision's (main before packed results) in the same run.

    .venv/bin/python benchmarks/bench_results.py [--sessions 10000] [--baseline-sessions 1000] [--gateways 8]
        [--hold 120] [--tokens 30000] [--baseline-rev 22cdc21] [--out benchmarks/results]

10,000 sandboxes do not fit a 2-core machine, so the gateways are light processes: bare ASGI apps with the routes
the server uses (POST /sessions, POST /sessions/poll, POST /sessions/{id}/cancel, GET /gateway/health). Each
session finishes ``--hold`` seconds after it arrived, with a real-sized result: one ``prefix_merging`` trace of
``--tokens`` tokens of the host Python's standard library through the real Qwen tokenizer (sampled answers with
logprobs, tool outputs masked), its messages and metadata, the shape ``bench_scale.py --tool-output-kb 36`` gives.
A gateway answers a poll the way the server asks: packed when it sends ``accept: application/vnd.polar-gym.result``
(this tree), JSON otherwise (the baseline), as the real gateway does.

Each server runs as its own process (``python -m polar_gym.server``; the baseline from a git worktree of
``--baseline-rev``) with its SQLite store; tasks of one session each are submitted by ``--concurrency`` workers and
called back to a sink that counts deliveries (it decodes nothing: the trainer's cost is not measured here).
Measured per server: every session COMPLETED exactly once (one attempt, one callback per task), the peak of
sessions in flight at once, the server's CPU per session (``/proc``), scheduling latency (the store's
``dispatched - created``), and stored bytes per result against the result's unique token bytes (uint32 ids, float64
logprobs where not 0.0). The baseline runs fewer sessions (``--baseline-sessions``): at 1.4 MB of JSON and ~0.1 CPU-s
a result, 10,000 would take 14 GB of disk; this tree's server runs that size too, and the ratios compare those two
(latency depends on load).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.baseline import BASELINE_REV, baseline_tree  # noqa: E402
from benchmarks.bench_server import (  # noqa: E402
    GW_TOKEN,
    TOKEN,
    Ticker,
    free_port,
    latency_stats,
    read_body,
    serve,
    stop,
    wait_http,
)
from polar_gym.result_codec import MEDIA_TYPE, frame_results, head, pack, unique_token_bytes  # noqa: E402
from polar_gym.schema import EvalResult, SessionResult, SessionStatus, Trace, Trajectory  # noqa: E402
from polar_gym.server.postgres_local import PrivatePostgres  # noqa: E402

console = Console(width=140)
#: the server's liveness settings: the light gateways share this host's two cores with the server and each other,
#: and under 10,000 finishing sessions a health probe waited past the default 10 s (every gateway was declared
#: dead); ``--heartbeat 5`` is also what docs/scaling.md advises at scale
HEARTBEATS = ("--heartbeat", "5", "--dead-after", "60")
#: where the tool outputs' text comes from (as bench_scale's scale_model.OUTPUT_SOURCE)
CODE = sorted(Path(sys.base_prefix).glob("lib/python3*/[a-z]*.py")) or sorted(Path("/usr/lib").glob(
    "python3*/[a-z]*.py"))


# -- the result every session returns ----------------------------------------------------------------------------------

def template(tokens: int, seed: int = 40) -> SessionResult:
    """A real-sized result: one prefix_merging trace of about ``tokens`` tokens over 4 model calls, whose tool
    outputs are stretches of real code, tokenized by the real Qwen tokenizer."""
    from transformers import AutoTokenizer

    from polar_gym.assets import tokenizer_dir

    if not (tokenizer_dir() / ".complete").exists():
        raise SystemExit("bench_results needs the Qwen tokenizer asset: run `bash scripts/setup.sh`")
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir()))
    rng = random.Random(seed)
    text = "".join(p.read_text(errors="replace") for p in CODE[:60])
    calls, prompt_len = 4, 1500
    tool_len = max(1, (tokens - prompt_len) // (calls - 1) - 120)

    def stretch(n_tokens: int) -> tuple[str, list[int]]:
        start = rng.randrange(0, max(1, len(text) - 6 * n_tokens))
        ids = tok(text[start:start + 6 * n_tokens])["input_ids"][:n_tokens]
        return tok.decode(ids), ids

    system, prompt = stretch(prompt_len)
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    messages: list[dict[str, Any]] = []
    for call in range(calls):
        answer = [rng.randrange(151_000) for _ in range(rng.randrange(60, 160))]
        response += answer
        mask += [1] * len(answer)
        logprobs += [-rng.random() * 3 for _ in answer]
        messages.append({"role": "assistant", "content": "", "tool_calls": [{
            "id": f"call_{call}", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": "pytest -x tests/test_parser.py"})}}]})
        if call < calls - 1:
            output, ids = stretch(tool_len)
            response += ids
            mask += [0] * len(ids)
            logprobs += [0.0] * len(ids)
            messages.append({"role": "tool", "tool_call_id": f"call_{call}", "content": output})
    trace = Trace(prompt_ids=prompt, response_ids=response, loss_mask=mask, response_logprobs=logprobs,
                  prompt_messages=[{"role": "system", "content": system},
                                   {"role": "user", "content": "Fix the failing test in tests/test_parser.py."}],
                  response_messages=messages, finish_reason="stop", reward=1.0,
                  metadata={"completion_ids": [f"c{i}" for i in range(calls)], "chain": 0, "weight": 1.0})
    return SessionResult(
        session_id="template", task_id="template", status=SessionStatus.COMPLETED,
        trajectory=Trajectory(session_id="template", traces=[trace], builder="prefix_merging",
                              diagnostics={"completions": calls, "trainable_tokens": sum(mask)}),
        evaluation=EvalResult(reward=1.0, details={"tests": "passed"}), timings={"init": 12.0, "run": 280.0},
        metadata={"sample_index": 0, "artifacts": {"completions": calls,
                                                   "call_log": [{"index": i, "status": "ok"} for i in range(calls)]}})


# -- the light gateway -------------------------------------------------------------------------------------------------

def gateway_app(result: SessionResult, hold: float) -> Callable[..., Awaitable[None]]:
    """Sessions finish COMPLETED ``hold`` s after POST /sessions with ``result`` (its ids set); a poll answers
    packed results when asked for them, JSON otherwise."""
    done: dict[str, asyncio.Event] = {}
    tasks: dict[str, str] = {}
    finished = [asyncio.Event()]

    def one(session_id: str) -> SessionResult:
        return result.model_copy(update={"session_id": session_id, "task_id": tasks[session_id]})

    def finish(session_id: str) -> None:
        done[session_id].set()
        finished[0].set()
        finished[0] = asyncio.Event()

    async def poll(ids: list[str], wait: float, packed: bool) -> tuple[bytes, bytes]:
        deadline = time.monotonic() + min(wait, 600.0)
        while True:
            ready = [i for i in ids if i in done and done[i].is_set()]
            remaining = deadline - time.monotonic()
            if ready or remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(finished[0].wait(), remaining)
        for i in ready:  # each result is answered once: the server stores it at once
            del done[i]
        statuses = {i: "RUNNING" for i in ids if i in done}
        unknown = [i for i in ids if i not in done and i not in ready]
        # encoded in a worker thread, as the real gateway does: its loop keeps answering health probes
        if packed:
            blobs = await asyncio.to_thread(lambda: [pack(one(i)) for i in ready])
            return frame_results(blobs, {"statuses": statuses, "unknown": unknown}), MEDIA_TYPE.encode()
        results = await asyncio.to_thread(lambda: b",".join(one(i).model_dump_json().encode() for i in ready))
        body = b'{"results":[' + results + b'],"statuses":' + orjson.dumps(statuses) + b',"unknown":' + \
            orjson.dumps(unknown) + b"}"
        return body, b"application/json"

    async def app(scope: dict[str, Any], receive: Callable[..., Awaitable[Any]],
                  send: Callable[..., Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        method, path = scope["method"], scope["path"]
        code, out, kind = 404, b'{"error": {"type": "not_found", "message": "no route"}}', b"application/json"
        if method == "POST" and path == "/sessions":
            spec = orjson.loads(body)
            sid = spec["session_id"]
            done[sid], tasks[sid] = asyncio.Event(), spec["task_id"]
            # sessions vary: each holds 0.5-1.5x --hold (by its id, the same in both runs), so finishes spread out
            spread = 0.5 + int.from_bytes(hashlib.sha256(sid.encode()).digest()[:4]) / 2**32
            asyncio.get_running_loop().call_later(hold * spread, finish, sid)
            code, out = 201, orjson.dumps({"session_id": sid, "task_id": spec["task_id"], "status": "INITIALIZING"})
        elif method == "POST" and path == "/sessions/poll":
            request = orjson.loads(body)
            accept = dict(scope["headers"]).get(b"accept", b"").decode()
            out, kind = await poll(request["session_ids"], float(request.get("wait", 0.0)), MEDIA_TYPE in accept)
            code = 200
        elif method == "POST" and path.endswith("/cancel"):
            code, out = 200, orjson.dumps({"cancelled": False})
        elif method == "GET" and path == "/gateway/health":
            code, out = 200, orjson.dumps({"status": "ok", "live_sessions": len(done)})
        await send({"type": "http.response.start", "status": code, "headers": [(b"content-type", kind)]})
        await send({"type": "http.response.body", "body": out})

    return app


def serve_gateway(port: int, template_file: Path, hold: float) -> None:
    result = SessionResult.model_validate_json(template_file.read_bytes())

    async def main() -> None:
        async with serve(gateway_app(result, hold), port):
            await asyncio.Event().wait()

    asyncio.run(main())


# -- one server run ----------------------------------------------------------------------------------------------------

def callback_sink(seen: dict[str, int]) -> Callable[..., Awaitable[None]]:
    """Counts each task's callback deliveries by idempotency key and answers 200; reads the body, decodes nothing."""

    async def app(scope: dict[str, Any], receive: Callable[..., Awaitable[Any]],
                  send: Callable[..., Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return
        await read_body(receive)
        key = dict(scope["headers"]).get(b"idempotency-key", b"").decode()
        seen[key] = seen.get(key, 0) + 1
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})

    return app


def spawn_server(checkout: Path, port: int, db: str, worker: str | None = None) -> subprocess.Popen[bytes]:
    """The rollout server of ``checkout`` as its own process (PYTHONPATH puts that tree first); a ``worker`` of
    several takes the shared PostgreSQL store's URL from POLAR_DB."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    where = ["--db", db] if worker is None else ["--worker", worker]
    if worker is not None:
        env["POLAR_DB"] = db
    return subprocess.Popen([sys.executable, "-m", "polar_gym.server", "--port", str(port), *where,
                             "--admin-token", TOKEN, "--log-level", "warning", *HEARTBEATS], cwd=checkout, env=env)


def spawn_gateways(n: int, template_file: Path, hold: float) -> tuple[list[str], list[subprocess.Popen[bytes]]]:
    ports = [free_port() for _ in range(n)]
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve-gateway", str(p),
                               "--template", str(template_file), "--hold", str(hold)], cwd=ROOT) for p in ports]
    return [f"http://127.0.0.1:{p}" for p in ports], procs


def db_bytes(db: Path) -> int:
    """The store's file and its -wal / -shm."""
    return sum(p.stat().st_size for p in db.parent.glob(f"{db.name}*"))


def cpu_seconds(pid: int, children: bool = False) -> float:
    """A process's CPU time; with ``children``, also that of its children it has waited for."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    used = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if children else 0)
    return used / os.sysconf("SC_CLK_TCK")


def postgres_cpu(server: PrivatePostgres) -> float:
    """The PostgreSQL server's CPU time: its postmaster, its live processes and the backends that have exited."""
    postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
    total = cpu_seconds(postmaster, children=True)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                total += cpu_seconds(int(stat.parent.name))
    return total


def peak_in_flight(rows: list[tuple[float | None, float | None]]) -> int:
    events = sorted([(d, 1) for d, f in rows if d is not None] + [(f, -1) for d, f in rows if f is not None])
    peak = live = 0
    for _, step in events:
        live += step
        peak = max(peak, live)
    return peak


async def run_server(name: str, n: int, args: argparse.Namespace, gateways: list[str], work: Path,
                     checkout: Path, unique_bytes: int, task_fields: dict[str, Any],
                     workers: int = 1) -> dict[str, Any]:
    """``n`` one-session tasks (with ``task_fields``) through the server of ``checkout``: one process on SQLite, or
    ``workers`` processes sharing a private PostgreSQL (gateway i registers with worker i mod workers, task i goes to
    worker i mod workers); what the module docstring lists. The CPU counted is every server process's, and with
    workers PostgreSQL's too."""
    db, sink_port = work / f"{name}.sqlite", free_port()
    postgres = PrivatePostgres(work / f"{name}-postgres") if workers > 1 else None
    target = await asyncio.to_thread(postgres.start) if postgres is not None else str(db)
    ports = [free_port() for _ in range(workers)]
    procs = [spawn_server(checkout, port, target, f"w{k + 1}" if postgres else None) for k, port in enumerate(ports)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    seen: dict[str, int] = {}
    capacity = math.ceil(n / len(gateways)) + 8
    clients = [httpx.AsyncClient(base_url=url, headers={"x-admin-token": TOKEN}, timeout=120) for url in urls]
    try:
        for url, proc in zip(urls, procs, strict=True):
            await wait_http(f"{url}/health", proc=proc)
        async with serve(callback_sink(seen), sink_port):
            for i, gw in enumerate(gateways):
                (await clients[i % workers].post("/gateways/register", json={
                    "url": gw, "capacity": capacity, "admin_token": GW_TOKEN})).raise_for_status()
            store_cpu0 = postgres_cpu(postgres) if postgres is not None else 0.0
            started = [cpu_seconds(p.pid) for p in procs]
            cpu0, t0 = sum(started), time.perf_counter()
            pending = [{"task_id": f"{name}-{i:06d}", "instruction": "Fix the failing test.", "num_samples": 1,
                        "timeout_seconds": 3600, "agent": {"harness": "codex"},
                        "callback_url": f"http://127.0.0.1:{sink_port}/callback", **task_fields} for i in range(n)]
            submitted = 0

            async def worker() -> None:
                nonlocal submitted
                while pending:
                    task = pending.pop()
                    (await clients[len(pending) % workers].post("/tasks", json=task)).raise_for_status()
                    submitted += 1

            submitting = asyncio.gather(*(worker() for _ in range(args.concurrency)))
            tick = Ticker(name)
            last, moved = 0, time.perf_counter()
            while len(seen) < n:
                if submitting.done():
                    submitting.result()
                if len(seen) != last:
                    last, moved = len(seen), time.perf_counter()
                if time.perf_counter() - moved > 2 * args.hold + 120:  # a fleet that stopped taking sessions
                    fleet = (await clients[0].get("/gateways")).text
                    raise RuntimeError(f"{name}: no callback for {2 * args.hold + 120:.0f} s at {len(seen)}/{n}; "
                                       f"gateways: {fleet[:2000]}")
                if time.perf_counter() - t0 > args.timeout:
                    raise TimeoutError(f"{name}: {len(seen)}/{n} callbacks after {args.timeout} s")
                tick(f"submitted {submitted}/{n}, called back {len(seen)}/{n}")
                await asyncio.sleep(0.5)
            seconds = time.perf_counter() - t0
            per_worker = [cpu_seconds(p.pid) for p in procs]
            cpu = sum(per_worker) - cpu0
            await submitting
            tick(f"all {n} tasks called back", force=True)
    finally:
        for client in clients:
            await client.aclose()
        for proc in procs:
            stop(proc)
    store_cpu = 0.0
    if postgres is not None:
        try:  # after the workers: their backends have exited and are counted
            store_cpu = postgres_cpu(postgres) - store_cpu0
            rows, stored_bytes = await asyncio.to_thread(_postgres_rows, target)
        finally:
            await asyncio.to_thread(postgres.stop)
    else:
        with contextlib.closing(sqlite3.connect(db)) as con:
            columns = {r[1] for r in con.execute("PRAGMA table_info(sessions)")}
            size = "length(packed)" if "packed" in columns else "length(result)"
            rows = con.execute(f"SELECT status, attempts, created, dispatched, finished, {size} "
                               "FROM sessions").fetchall()
        stored_bytes = db_bytes(db)
    statuses: dict[str, int] = {}
    for status, *_ in rows:
        statuses[status] = statuses.get(status, 0) + 1
    stored = [r[5] or 0 for r in rows]
    return {
        "sessions": n, "workers": workers, "statuses": statuses, "attempts_over_one": sum(1 for r in rows if r[1] != 1),
        "callbacks": len(seen), "callback_repeats": sum(v - 1 for v in seen.values()),
        "exactly_once": statuses == {"COMPLETED": n} and all(r[1] == 1 for r in rows) and len(seen) == n,
        "peak_in_flight": peak_in_flight([(r[3], r[4]) for r in rows]), "seconds": seconds,
        "sessions_per_s": n / seconds, "server_cpu_s": cpu + store_cpu, "store_cpu_s": store_cpu,
        "server_cpu_ms_per_session": (cpu + store_cpu) / n * 1e3,
        # what one event loop carries: the limit several workers lift
        "busiest_worker_cpu_ms_per_session": max(b - a for a, b in zip(started, per_worker, strict=True)) / n * 1e3,
        "store_cpu_ms_per_session": store_cpu / n * 1e3,
        "scheduling": latency_stats([r[3] - r[2] for r in rows if r[3] is not None]),
        "stored_bytes_per_result": sum(stored) / max(1, len(stored)),
        "stored_per_unique_token_byte": sum(stored) / max(1, len(stored)) / unique_bytes,
        "db_bytes_per_session": stored_bytes / n,
    }


def _postgres_rows(url: str) -> tuple[list[tuple[Any, ...]], int]:
    import psycopg

    with psycopg.connect(url) as con:
        rows = con.execute("SELECT status, attempts, created, dispatched, finished, length(packed) "
                           "FROM sessions").fetchall()
        size = con.execute("SELECT pg_database_size(current_database())").fetchone()
    return [tuple(r) for r in rows], int(size[0]) if size else 0


# -- the run -----------------------------------------------------------------------------------------------------------

async def main_async(args: argparse.Namespace, work: Path, template_file: Path, baseline: Path | None,
                     unique: int) -> dict[str, Any]:
    gateways, procs = spawn_gateways(args.gateways, template_file, args.hold)
    out: dict[str, Any] = {}
    try:
        for gw, proc in zip(gateways, procs, strict=True):
            await wait_http(f"{gw}/gateway/health", proc=proc)
        # each asks for the callback its own CallbackReceiver asks for: packed here, JSON before
        out["current"] = await run_server("current", args.sessions, args, gateways, work, ROOT, unique,
                                          {"callback_format": "packed"})
        if args.workers > 1:  # the same sessions through several server workers on PostgreSQL
            out["workers"] = await run_server("workers", args.sessions, args, gateways, work, ROOT, unique,
                                              {"callback_format": "packed"}, workers=args.workers)
        if baseline is not None:
            if args.baseline_sessions != args.sessions:  # latency depends on load: compare at the same size too
                out["current_small"] = await run_server("current_small", args.baseline_sessions, args, gateways,
                                                        work, ROOT, unique, {"callback_format": "packed"})
            out["baseline"] = await run_server("baseline", args.baseline_sessions, args, gateways, work, baseline,
                                               unique, {})
    finally:
        for proc in procs:
            stop(proc)
    return out


def report(res: dict[str, Any]) -> Table:
    table = Table(title=f"results at scale: this tree vs {res['config']['baseline_rev']} "
                        f"({res['result']['token_ids']}-token results)")
    table.add_column("metric")
    runs = [k for k in ("current", "workers", "current_small", "baseline") if k in res]
    for k in runs:
        table.add_column(f"{k} ({res[k]['sessions']})", justify="right")
    peer = "current_small" if "current_small" in res else "current"
    compare = "baseline" in res
    if compare:
        table.add_column(f"baseline / {peer}", justify="right")
    scaled = "workers" in res
    if scaled:
        table.add_column("workers / current", justify="right")
    rows = [("exactly once", "exactly_once", "{}"),
            ("server workers", "workers", "{}"),
            ("sessions / s", "sessions_per_s", "{:.1f}"),
            ("peak sessions in flight", "peak_in_flight", "{:.0f}"),
            ("server CPU ms / session (all processes)", "server_cpu_ms_per_session", "{:.1f}"),
            ("  of it the busiest worker's event loop", "busiest_worker_cpu_ms_per_session", "{:.1f}"),
            ("  of it PostgreSQL", "store_cpu_ms_per_session", "{:.1f}"),
            ("scheduling p50 ms", ("scheduling", "p50_ms"), "{:.1f}"),
            ("scheduling p99 ms", ("scheduling", "p99_ms"), "{:.1f}"),
            ("stored KB / result", "stored_bytes_per_result", "{:.1f}"),
            ("stored / unique token bytes", "stored_per_unique_token_byte", "{:.2f}"),
            ("db KB / session", "db_bytes_per_session", "{:.1f}")]
    for label, key, fmt in rows:
        values = [res[k][key[0]][key[1]] if isinstance(key, tuple) else res[k][key] for k in runs]
        if "KB" in label:
            values = [v / 1024 for v in values]
        cells = [fmt.format(v) for v in values]
        if compare:
            mine, theirs = values[runs.index(peer)], values[runs.index("baseline")]
            cells.append(f"{theirs / mine:.1f}x" if isinstance(mine, float) and mine else "")
        if scaled:
            one, many = values[runs.index("current")], values[runs.index("workers")]
            cells.append(f"{many / one:.2f}x" if isinstance(one, float) and one else "")
        table.add_row(label, *cells)
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=10_000)
    p.add_argument("--baseline-sessions", type=int, default=1000, help="0: no baseline run")
    p.add_argument("--baseline-rev", default=BASELINE_REV)
    p.add_argument("--gateways", type=int, default=8)
    p.add_argument("--hold", type=float, default=120.0, help="seconds each session stays in flight")
    p.add_argument("--tokens", type=int, default=30_000, help="tokens of each session's result")
    p.add_argument("--concurrency", type=int, default=32, help="trainer workers submitting tasks")
    p.add_argument("--workers", type=int, default=1,
                   help="also run the sessions through this many server workers on a private PostgreSQL (1: skip)")
    p.add_argument("--timeout", type=float, default=7200.0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--serve-gateway", type=int, help=argparse.SUPPRESS)
    p.add_argument("--template", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.serve_gateway:
        serve_gateway(args.serve_gateway, args.template, args.hold)
        return {}
    work = Path(tempfile.mkdtemp(prefix="bench-results-", dir=os.environ.get("POLAR_BENCH_TMP")))
    try:
        result = template(args.tokens)
        packed = pack(result)
        unique = unique_token_bytes(head(packed))
        template_file = work / "template.json"
        template_file.write_text(result.model_dump_json())
        json_bytes = template_file.stat().st_size
        console.print(f"result: {head(packed).token_ids} unique token ids, {len(packed) / 1024:.0f} KB packed, "
                      f"{json_bytes / 1024:.0f} KB as JSON, {unique / 1024:.0f} KB unique token bytes")
        with (baseline_tree(args.baseline_rev, work / "baseline") if args.baseline_sessions
              else contextlib.nullcontext()) as baseline:
            res = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   "result": {"token_ids": head(packed).token_ids, "packed_bytes": len(packed),
                              "json_bytes": json_bytes, "unique_token_bytes": unique},
                   **asyncio.run(main_async(args, work, template_file, baseline, unique))}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rendered = report(res)
    console.print(rendered)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_results.json").write_text(json.dumps(res, indent=2))
    with (args.out / "bench_results.md").open("w") as f:
        Console(file=f, width=140, color_system=None).print(rendered)
    console.print(f"written: {args.out}/bench_results.json, bench_results.md")
    return res


if __name__ == "__main__":
    main()
