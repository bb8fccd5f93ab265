"""Scale in simulation: 1,000 sessions of a scripted harness with realistic stage durations, through the real rollout
server and 3 real gateway processes, against the ideal schedule of the same work in the same run.

    .venv/bin/python benchmarks/bench_scale.py [--quick] [--sessions 1000] [--gateways 3] [--run-slots 4]
        [--time-scale 0.01] [--calls 4] [--slurm-conf PATH [--server-host HOST] [--exclusive]]
        [--baseline-rev 22cdc21] [--baseline-sessions N] [--out benchmarks/results]

Everything a session touches is real except the model: ``python -m polar_gym.server`` (SQLite store), gateways as
``python -m polar_gym.gateway --engine oracle --server-url ...`` processes (``--launcher local``, on this host) or as
Slurm jobs through submitit (``--slurm-conf PATH``: launcher=slurm's gateway job, ``polar_gym.launch.jobs``), the
``local`` bubblewrap sandbox, the proxy with the real Qwen tokenizer (token-in prompts), the prefix-merging builder
and the ``test_on_output`` evaluator. Each session is a ``shell`` harness running a tiny agent loop (``AGENT`` below:
chat completions with a ``bash`` tool, the tool calls run in the sandbox); the oracle engine is the scripted policy:
it plays the session's ``metadata.oracle.commands``, which are ``sleep`` commands that make up the harness run time.

Stage durations (a SWE-style RL rollout, drawn per session, seconds before scaling; docs/scaling.md says why):
INIT = prepare ``sleep`` lognormal(median 12, sigma 0.6) on top of the real sandbox start; RUN = turns lognormal
(median 40, sigma 0.5, 5..150) x seconds per turn lognormal(median 5, sigma 0.8); EVALUATE = the test command
``sleep`` lognormal(median 20, sigma 0.7); teardown is the real sandbox stop. Every duration is multiplied by
``--time-scale`` (default 0.01: a 5-minute session plays in 3 s), so the run takes minutes. The RUN time is folded into
``--calls`` model calls (the real turn count is kept in the results for docs/scaling.md): the proxy's cost per call
does not shrink with time, so the real call rate would measure this 2-core host, not the system.

Measured, from the server's store (status histories the gateways stamped) and /proc:
- run-slot use over time: harnesses running / run slots, per gateway and overall, mean and p10 (0.1 s samples over
  the makespan, and while work was queued: some session submitted and not yet running);
- scheduling latency p50/p90/p99: submitted -> harness started, submitted -> dispatched, and a run slot freed ->
  the next session running on that gateway (only while work was queued);
- throughput, makespan, and the baseline: the ideal makespan (total RUN work / total run slots) and 100 % slot use;
- CPU per session of the server and of each gateway process (not its sandboxes), and the server's CPU per heartbeat
  in an idle window before the run; memory (RSS) per live session; gateway CPU per proxied model call (a
  calibration of sessions with 1 call against sessions with ``1 + --calib-calls`` calls, no sleeps).

Side by side in the same run (``--baseline-sessions``, default ``--sessions``; 0: skip): the same sessions through the
server of ``--baseline-rev`` (a git worktree; the gateways are this tree's), compared on sessions completed once,
server CPU per session, scheduling p99 and stored bytes per result against its unique token bytes.

Writes ``bench_scale.json`` (summary, the baseline's under ``baseline``), ``bench_scale_sessions.jsonl`` (one line
per session), ``bench_scale_slots.jsonl`` (slot use over time), ``bench_scale.md`` (the tables) and
``bench_scale_slots.svg``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import secrets
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console, Group

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.baseline import BASELINE_REV, baseline_tree  # noqa: E402
from benchmarks.bench_server import stop, wait_http  # noqa: E402
from benchmarks.scale_model import Plan, analyse, draw_plan, make_task, session_rows, stored_result_bytes  # noqa: E402
from benchmarks.scale_report import compare_table, table, write_outputs  # noqa: E402
from polar_gym.assets import tokenizer_dir  # noqa: E402
from polar_gym.fleet.settings import InferenceSettings  # noqa: E402
from polar_gym.launch.jobs import GatewayJobSettings, gateway_argv  # noqa: E402
from polar_gym.schema import TaskRequest  # noqa: E402
from polar_gym.server import CallbackReceiver, RolloutClient  # noqa: E402

console = Console(width=140)
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")

# -- process accounting (/proc) ------------------------------------------------------------------------------------

def proc_usage(pid: int | None) -> dict[str, float] | None:
    """CPU seconds of the process itself and of its reaped children, and its RSS in MB; None if it is not visible
    on this host."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        statm = Path(f"/proc/{pid}/statm").read_text().split()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return {"cpu_s": (utime + stime) / TICK, "children_cpu_s": (cutime + cstime) / TICK,
            "rss_mb": int(statm[1]) * PAGE / 2**20}


def delta(after: dict[str, float] | None, before: dict[str, float] | None, key: str = "cpu_s") -> float | None:
    return None if after is None or before is None else after[key] - before[key]


# -- the fleet -----------------------------------------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def spawn(module_argv: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT) -> subprocess.Popen[bytes]:
    """``python -m MODULE ...`` from ``cwd`` (the project checkout it runs) with its output in ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", *module_argv], cwd=cwd, env=env, stdout=out, stderr=out)


def pid_of_job(job_id: str) -> int | None:
    """The pid of a Slurm job's ``python -m submitit.core._submit`` on this host (the gateway runs inside it, under
    srun, whose own command line names submitit too), else None."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if "python" in Path(argv[0].decode()).name and b"submitit.core._submit" in argv \
                    and f"SLURM_JOB_ID={job_id}\0".encode() in (entry / "environ").read_bytes():
                return int(entry.name)
    return None


@dataclass
class Fleet:
    """The rollout server process and the gateways (processes here, or Slurm jobs); ``pids`` by gateway URL."""

    url: str
    token: str
    server: subprocess.Popen[bytes]
    db: Path
    gateway_procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)  # by port
    jobs: list[Any] = field(default_factory=list)
    #: the gateway processes to read in /proc: by gateway id (local) or by Slurm job (their ids are not matched)
    pids: dict[str, int | None] = field(default_factory=dict)

    def close(self) -> None:
        for job in self.jobs:
            with contextlib.suppress(Exception):
                job.cancel(check=False)
        for proc in self.gateway_procs.values():
            if proc.poll() is None:
                stop(proc)
        if self.server.poll() is None:
            stop(self.server)


async def start_fleet(args: argparse.Namespace, work: Path, server_root: Path = ROOT) -> Fleet:
    """The server (of the checkout ``server_root``: a baseline's worktree) as its own process, then
    ``args.gateways`` gateways of this tree registered with it."""
    token = secrets.token_urlsafe(24)
    slurm = args.slurm_conf is not None
    host = "0.0.0.0" if slurm else "127.0.0.1"
    port = free_port(host)
    env = {**os.environ, "POLAR_ADMIN_TOKEN": token, "PYTHONPATH": str(ROOT)}
    server = spawn(["polar_gym.server", "--host", host, "--port", str(port), "--db", str(work / "server.sqlite"),
                    "--heartbeat", str(args.heartbeat), "--log-level", "warning"],
                   {**env, "PYTHONPATH": str(server_root)}, work / "server.log", cwd=server_root)
    advertised = args.server_host or (socket.getfqdn() if slurm else "127.0.0.1")
    fleet = Fleet(f"http://{advertised}:{port}", token, server, work / "server.sqlite")
    try:
        await wait_http(f"http://127.0.0.1:{port}/health", 60.0, proc=server)
        pools = GatewayJobSettings(run_slots=args.run_slots, init_workers=args.init_workers,
                                   ready_buffer=args.ready_buffer, postrun_workers=args.postrun_workers,
                                   pool_sizing=args.pool_sizing, cpus_per_task=args.gateway_cpus,
                                   mem_gb=args.gateway_mem_gb, timeout_min=120)
        inference = InferenceSettings(engine="oracle", tokenizer=str(tokenizer_dir()))
        argvs = [gateway_argv(inference, pools, [], server_url=fleet.url, workdir=work / "gateways" / f"gateway-{i}",
                              heartbeat=args.heartbeat) + ["--log-level", "warning"] for i in range(args.gateways)]
        if slurm:
            start_gateway_jobs(fleet, argvs, args, work)
        else:
            for i, argv in enumerate(argvs):
                gport = free_port()
                fleet.gateway_procs[gport] = spawn(
                    ["polar_gym.gateway", *argv, "--port", str(gport), "--advertise-host", "127.0.0.1"],
                    {**env, "POLAR_SERVER_TOKEN": token, "POLAR_ADMIN_TOKEN": secrets.token_urlsafe(24)},
                    work / f"gateway-{i}.log")
        await wait_for_gateways(fleet, args)
    except BaseException:
        fleet.close()
        raise
    return fleet


def start_gateway_jobs(fleet: Fleet, argvs: list[list[str]], args: argparse.Namespace, work: Path) -> None:
    """launcher=slurm's gateway job (polar_gym.launch.jobs.run_gateway_job) once per gateway, through submitit."""
    import submitit

    from polar_gym.launch.jobs import run_gateway_job

    os.environ["SLURM_CONF"] = str(args.slurm_conf)
    folder = work / "slurm"
    folder.mkdir(mode=0o700, exist_ok=True)
    executor = submitit.AutoExecutor(folder=folder / "%j", cluster="slurm")
    extra: dict[str, Any] = {"slurm_partition": args.partition} if args.partition else {}
    if args.exclusive:  # one gateway per node: the 3-node local cluster's nodes each get one
        extra["slurm_additional_parameters"] = {"exclusive": True}
    executor.update_parameters(name="polar-scale-gateway", nodes=1, tasks_per_node=1, cpus_per_task=args.gateway_cpus,
                               mem_gb=args.gateway_mem_gb, timeout_min=120, **extra)
    for argv in argvs:
        job = executor.submit(run_gateway_job, argv, None, fleet.token)
        fleet.jobs.append(job)
        console.print(f"submitted gateway job {job.job_id}")


async def wait_for_gateways(fleet: Fleet, args: argparse.Namespace) -> None:
    """Until every gateway is registered and healthy; then find each one's process for /proc."""
    deadline = time.monotonic() + args.register_timeout
    async with RolloutClient(f"http://127.0.0.1:{fleet.url.rsplit(':', 1)[1]}", fleet.token) as client:
        while True:
            healthy = [g for g in await client.gateways() if g["state"] == "healthy"]
            if len(healthy) >= args.gateways:
                break
            for proc in fleet.gateway_procs.values():
                if proc.poll() is not None:
                    raise RuntimeError(f"a gateway exited with {proc.returncode} (logs in {fleet.db.parent})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(healthy)}/{args.gateways} gateways registered")
            await asyncio.sleep(0.5)
    for gw in healthy:
        proc = fleet.gateway_procs.get(int(gw["url"].rsplit(":", 1)[1]))
        if proc is not None:
            fleet.pids[gw["gateway_id"]] = proc.pid
    for job in fleet.jobs:  # a job's process is visible only when its node is this host (a local cluster)
        fleet.pids[f"job-{job.job_id}"] = pid_of_job(job.job_id)
    console.print(f"{len(healthy)} gateways registered: {', '.join(g['url'] for g in healthy)}")


# -- the run -------------------------------------------------------------------------------------------------------

class Sampler:
    """/proc of the server and the gateways, and the fleet's live sessions, every ``every`` seconds."""

    def __init__(self, fleet: Fleet, client: RolloutClient, every: float = 1.0) -> None:
        self.fleet, self.client, self.every = fleet, client, every
        self.rows: list[dict[str, Any]] = []
        self.stages: dict[str, int] = {}

    def usage(self) -> dict[str, Any]:
        return {"server": proc_usage(self.fleet.server.pid),
                "gateways": {g: proc_usage(pid) for g, pid in self.fleet.pids.items()}}

    async def run(self) -> None:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                live: dict[str, int] = {}
                for gw in await self.client.gateways():
                    for stage, n in ((gw.get("health") or {}).get("stages") or {}).items():
                        live[stage] = live.get(stage, 0) + n
                self.stages = live
            self.rows.append({"at": time.time(), "live": sum(self.stages.values()), **self.usage()})
            await asyncio.sleep(self.every)


def memory_use(rows: list[dict[str, Any]], sessions: int) -> dict[str, float | None]:
    """RSS (MB) of the server and of the largest gateway: before the run, at its peak and at its end; the growth per
    finished session. The samples go to bench_scale_samples.jsonl (RSS against live sessions over time)."""
    def rss(row: dict[str, Any], who: str) -> float:
        if who == "server":
            return float(row["server"]["rss_mb"]) if row["server"] else 0.0
        return max((u["rss_mb"] for u in row["gateways"].values() if u), default=0.0)

    out: dict[str, float | None] = {}
    for who in ("server", "gateway"):
        values = [rss(r, who) for r in rows]
        out |= {f"{who}_rss_mb_start": values[0] if values else None, f"{who}_rss_mb_max": max(values, default=None),
                f"{who}_rss_mb_end": values[-1] if values else None,
                f"{who}_mb_per_finished_session": (values[-1] - values[0]) / sessions if values else None}
    return out


async def submit_and_wait(client: RolloutClient, tasks: list[TaskRequest], receiver: CallbackReceiver,
                          done: set[str], sampler: Sampler, what: str, timeout: float, baseline: bool = False) -> float:
    """Submit every task (8 at once, as a trainer's workers would), wait for every callback (``done``: the task ids
    the receiver's ``on_task`` has seen); shows progress. A
    ``baseline`` server predates ``callback_format`` (its models refuse unknown fields): its tasks go without it
    and it calls back with JSON."""
    tasks = [receiver.attach(t, t.callback_url) for t in tasks]  # signed with the receiver's secret, expected
    queue = list(reversed(tasks))
    t0 = time.monotonic()

    async def worker() -> None:
        while queue:
            task = queue.pop()
            if baseline:
                (await client.http.post("/tasks", content=task.model_dump_json(exclude={"callback_format"}),
                                        headers={"content-type": "application/json"})).raise_for_status()
            else:
                await client.submit(task)

    workers = asyncio.gather(*(worker() for _ in range(8)))
    wanted = {t.task_id for t in tasks}
    last = 0.0
    while not wanted <= done:
        if workers.done():
            workers.result()
        now = time.monotonic()
        if now - t0 > timeout:
            raise TimeoutError(f"{what}: {len(wanted & done)}/{len(tasks)} after {timeout} s")
        if now - last >= 2.0:
            last = now
            stages = " · ".join(f"{k} {v}" for k, v in sampler.stages.items())
            console.print(f"  [{what} {now - t0:6.1f} s] submitted {len(tasks) - len(queue)}/{len(tasks)}, "
                          f"done {len(wanted & done)}/{len(tasks)} · {stages}", markup=False)
        receiver.arrived.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(receiver.arrived.wait(), 0.5)
    await workers
    return time.monotonic() - t0


async def calibrate_calls(client: RolloutClient, receiver: CallbackReceiver, done: set[str], sampler: Sampler,
                          args: argparse.Namespace, callback: str) -> dict[str, Any]:
    """Gateway CPU per proxied model call: N sessions with 1 call, then N with 1 + K calls (tool commands ``true``,
    nothing sleeps); the difference over N*K calls."""
    n, k = args.calib_sessions, args.calib_calls
    zero = Plan(init=0.0, turns=1, run=0.0, evaluate=0.0)
    rng = random.Random(args.seed + 1)
    cpu: dict[int, float] = {}
    for calls in (1, 1 + k):
        tasks = [make_task(i, zero, 1.0, calls, rng, callback, prefix=f"calib{calls}",
                           commands=["true"] * (calls - 1)) for i in range(n)]
        before = sampler.usage()["gateways"]
        await submit_and_wait(client, tasks, receiver, done, sampler, f"calibration {calls} call(s)", args.timeout)
        after = sampler.usage()["gateways"]
        spent = [delta(after[g], before[g]) for g in before]
        cpu[calls] = sum(s for s in spent if s is not None)
    per_call = (cpu[1 + k] - cpu[1]) / (n * k)
    return {"sessions": n, "extra_calls": k, "gateway_cpu_s": {str(c): v for c, v in cpu.items()},
            "gateway_cpu_ms_per_call": per_call * 1e3,
            "gateway_cpu_ms_per_session_one_call": cpu[1] / n * 1e3}


async def store_phase(n: int, work: Path) -> dict[str, Any]:
    """The server's own cost per session with nothing else in the process: the real RolloutServer and Store here,
    ``n`` one-session tasks to one fake gateway process (bench_server's: sessions end at once); SQL statements per
    session counted on the store's connection, and this process's CPU per session."""
    import collections

    from benchmarks.bench_server import GW_TOKEN, spawn_gateway
    from polar_gym.schema import GatewayRegistration, SessionStatus
    from polar_gym.server import RolloutServer, Store
    from polar_gym.server.sql import SqliteDatabase

    port = free_port()
    gateway = spawn_gateway(port, 0.0)
    store = Store(work / "store-phase.sqlite")
    statements: collections.Counter[str] = collections.Counter()
    in_tx = [False]

    def trace(sql: str) -> None:
        """Count statements, and commits: each COMMIT, and each write outside BEGIN..COMMIT (autocommit)."""
        verb = sql.split(None, 1)[0].upper()
        statements[verb] += 1
        if verb == "BEGIN":
            in_tx[0] = True
        elif verb in ("COMMIT", "ROLLBACK"):
            in_tx[0] = False
            statements["(commits)"] += verb == "COMMIT"
        elif verb in WRITES and not in_tx[0]:
            statements["(commits)"] += 1

    core = RolloutServer(store)
    try:
        assert isinstance(store.db, SqliteDatabase), "the store phase counts SQLite's statements"
        store.db.trace(trace)
        await wait_http(f"http://127.0.0.1:{port}/gateway/health", 60.0, proc=gateway)
        await core.start()
        await core.register(GatewayRegistration(url=f"http://127.0.0.1:{port}", capacity=64, admin_token=GW_TOKEN))
        rng = random.Random(0)
        tasks = [make_task(i, Plan(0, 1, 0, 0), 1.0, 1, rng, None, prefix="store") for i in range(n)]
        statements.clear()
        cpu0, t0 = time.process_time(), time.monotonic()
        for task in tasks:
            await core.submit(task)
        while True:
            sessions, _ = await store.counts()
            if sum(v for k, v in sessions.items() if SessionStatus(k).terminal) >= n:
                break
            await asyncio.sleep(0.05)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
    finally:
        await core.stop()
        store.close()
        stop(gateway)
    writes = sum(v for k, v in statements.items() if k in WRITES)
    return {"sessions": n, "statements_per_session": {k: v / n for k, v in sorted(statements.items())},
            "writes_per_session": writes / n, "commits_per_session": statements["(commits)"] / n,
            "server_cpu_ms_per_session": cpu / n * 1e3, "sessions_per_second": n / wall}


def result_cost(db: Path) -> dict[str, float]:
    """The stored results' size against their unique token bytes, and the CPU one process spends per result on
    the server's event loop, side by side: packed (today: the poll frame split and the head read; the store writes
    the bytes in a worker thread) and as JSON (before: the poll answer parsed into a SessionResult and written back
    as JSON), measured on the largest stored result."""
    from polar_gym.result_codec import PackedResult, frame_results, head, read_frame, unique_token_bytes, unpack
    from polar_gym.schema import SessionPollReply

    with contextlib.closing(sqlite3.connect(db)) as con:
        rows = con.execute("SELECT packed FROM sessions WHERE task_id LIKE 'scale-%' AND packed IS NOT NULL "
                           "ORDER BY length(packed)").fetchall()
    if not rows:
        return {}
    sizes = [len(r[0]) for r in rows]
    unique = [unique_token_bytes(head(r[0])) for r in rows]
    largest = rows[-1][0]
    as_json = unpack(largest).model_dump_json()
    json_poll = ('{"results":[' + as_json + '],"statuses":{},"unknown":[]}').encode()
    packed_poll = frame_results([largest], {"statuses": {}, "unknown": []})

    def packed_loop() -> None:
        for blob in read_frame(packed_poll)[1]:
            PackedResult.of(blob)

    def json_loop() -> None:
        SessionPollReply.model_validate_json(json_poll).results[0].model_dump_json()

    times = {}
    for name, fn in (("loop_ms_packed", packed_loop), ("loop_ms_json", json_loop)):
        t0 = time.process_time()
        for _ in range(5):
            fn()
        times[name] = (time.process_time() - t0) / 5 * 1e3
    h = head(largest)
    return {"result_kb_mean": sum(sizes) / len(sizes) / 1024, "largest_kb": len(largest) / 1024,
            "largest_json_kb": len(as_json) / 1024, "largest_token_ids": h.token_ids,
            "bytes_per_unique_token_byte": sum(sizes) / max(1, sum(unique)), **times}


async def main_async(args: argparse.Namespace, work: Path, server_root: Path = ROOT) -> dict[str, Any]:
    rng = random.Random(args.seed)
    plans = [draw_plan(rng) for _ in range(args.sessions)]
    fleet = await start_fleet(args, work, server_root)
    # the benchmark only counts callbacks: every body goes to on_task, which notes its task, and may be evicted (a
    # baseline's JSON callbacks are 1.4 MB each: a thousand kept would pass the receiver's 1 GiB bound)
    done: set[str] = set()
    receiver = CallbackReceiver(lambda body: done.add(body["task_id"]), max_pending=1_000_000)
    local_url = f"http://127.0.0.1:{fleet.url.rsplit(':', 1)[1]}"
    try:
        async with receiver.serve() as callback, RolloutClient(local_url, fleet.token) as client:
            sampler = Sampler(fleet, client)
            sampling = asyncio.create_task(sampler.run())
            try:
                console.print(f"[bold]idle[/]: {args.idle_seconds:.0f} s of heartbeats only")
                idle0, t_idle = sampler.usage(), time.monotonic()
                await asyncio.sleep(args.idle_seconds)
                idle1, idle_s = sampler.usage(), time.monotonic() - t_idle
                tasks = [make_task(i, p, args.time_scale, args.calls, rng, callback,
                                   tool_output_bytes=int(args.tool_output_kb * 1024)) for i, p in enumerate(plans)]
                console.print(f"[bold]run[/]: {len(tasks)} sessions, {args.gateways} gateways x {args.run_slots} run "
                              f"slots, time scale {args.time_scale}")
                before = sampler.usage()
                wall = await submit_and_wait(client, tasks, receiver, done, sampler, "run", args.timeout,
                                             baseline=server_root != ROOT)
                after = sampler.usage()
                run_samples = list(sampler.rows)
                calls = None
                if args.calib_sessions:
                    console.print("[bold]calibration[/]: gateway CPU per model call")
                    calls = await calibrate_calls(client, receiver, done, sampler, args, callback)
            finally:
                sampling.cancel()
                await asyncio.gather(sampling, return_exceptions=True)
    finally:
        fleet.close()
    store = None
    if args.store_sessions:
        console.print(f"[bold]store[/]: the server's own cost, {args.store_sessions} zero-time sessions in process")
        store = await store_phase(args.store_sessions, work)
    results = result_cost(fleet.db) if server_root == ROOT else {}
    rows, capacity = session_rows(fleet.db)
    rows = [r for r in rows if r["task_id"].startswith("scale-")]
    slots = {g: args.run_slots for g in capacity}  # what a gateway registers is its dispatch capacity, not its slots
    summary, series = analyse(rows, slots, args.time_scale, args.slot_step)
    summary["registered_capacity"] = capacity
    summary["pool_sizing"] = args.pool_sizing
    heartbeats = args.gateways * idle_s / args.heartbeat  # each gateway beats, and the server probes it, per interval
    per_beat = (delta(idle1["server"], idle0["server"]) or 0.0) / heartbeats
    server_run = delta(after["server"], before["server"]) or 0.0
    gw_cpu = {g: delta(after["gateways"][g], before["gateways"][g]) for g in before["gateways"]}
    seen = [v for v in gw_cpu.values() if v is not None]
    summary.update({
        "launcher": "slurm" if args.slurm_conf else "local", "wall_s": wall, "cpus": os.cpu_count(),
        "cpu": {
            "server_ms_per_session": server_run / len(rows) * 1e3,
            "server_ms_per_session_net_of_heartbeats": max(0.0, server_run - per_beat * args.gateways * wall
                                                           / args.heartbeat) / len(rows) * 1e3,
            "server_idle_ms_per_heartbeat": per_beat * 1e3,
            "gateway_ms_per_session": sum(seen) / len(rows) * 1e3 if seen else None,
            "gateway_ms_per_session_by_process": {g: v / max(1, sum(1 for r in rows if r["gateway"] == g)) * 1e3
                                                  for g, v in gw_cpu.items() if v is not None and g in slots},
            "sandbox_children_ms_per_session": (sum(
                delta(after["gateways"][g], before["gateways"][g], "children_cpu_s") or 0.0
                for g in before["gateways"]) / len(rows) * 1e3) if seen else None,
        },
        "memory": memory_use(run_samples, len(rows)), "calibration": calls, "store": store,
        "results": results, "storage": stored_result_bytes(fleet.db),
        "completed_once": sum(r["status"] == "COMPLETED" and r["attempts"] == 1 for r in rows),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    })
    return {"summary": summary, "series": series, "sessions": rows, "samples": run_samples}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=1000)
    p.add_argument("--gateways", type=int, default=3)
    p.add_argument("--run-slots", type=int, default=4, help="run slots per gateway")
    p.add_argument("--init-workers", type=int, default=4)
    p.add_argument("--ready-buffer", type=int, default=2)
    p.add_argument("--postrun-workers", type=int, default=4)
    p.add_argument("--pool-sizing", choices=("fixed", "auto"), default="auto",
                   help="the gateways' pool sizing (auto: the sizes above are the start)")
    p.add_argument("--time-scale", type=float, default=0.01, help="real seconds -> benchmark seconds")
    p.add_argument("--calls", type=int, default=4, help="model calls per session (the RUN time is split across)")
    p.add_argument("--tool-output-kb", type=float, default=0.0,
                   help="text each tool command prints (36 with 4 calls: a ~30k-token trajectory, a real session's)")
    p.add_argument("--heartbeat", type=float, default=2.0, help="gateway heartbeat and server probe interval, s")
    p.add_argument("--idle-seconds", type=float, default=10.0, help="heartbeats only, before the run (server cost)")
    p.add_argument("--calib-sessions", type=int, default=20, help="sessions per calibration batch (0: skip)")
    p.add_argument("--calib-calls", type=int, default=16, help="extra model calls per calibration session")
    p.add_argument("--store-sessions", type=int, default=500, help="sessions of the store phase (0: skip)")
    p.add_argument("--slot-step", type=float, default=0.1, help="slot-use sampling step, s")
    p.add_argument("--seed", type=int, default=16)
    p.add_argument("--baseline-rev", default=BASELINE_REV, help="the revision whose server runs the same sessions")
    p.add_argument("--baseline-sessions", type=int, default=None,
                   help="sessions of the baseline's run (default: --sessions; 0: no baseline)")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up on a phase after this many seconds")
    p.add_argument("--slurm-conf", type=Path, default=None,
                   help="run the gateways as Slurm jobs on this cluster (launcher=slurm's gateway job)")
    p.add_argument("--launcher", choices=("local", "slurm"), default=None,
                   help="local (default): gateway processes on this host; slurm needs --slurm-conf")
    p.add_argument("--server-host", default=None, help="how Slurm nodes reach this host (default: its FQDN)")
    p.add_argument("--partition", default=None, help="Slurm partition of the gateway jobs")
    p.add_argument("--exclusive", action="store_true", help="each gateway job on a node of its own (--exclusive)")
    p.add_argument("--gateway-cpus", type=int, default=1, help="CPUs per gateway job")
    p.add_argument("--gateway-mem-gb", type=float, default=2.0, help="memory per gateway job, GB")
    p.add_argument("--register-timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="200 sessions, no idle window, 10 calibration sessions")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, db, gateway dirs)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.idle_seconds, args.calib_sessions = 200, 4.0, 10
    if args.baseline_sessions is None:
        args.baseline_sessions = args.sessions
    if (args.launcher == "slurm") != (args.slurm_conf is not None) and args.launcher is not None:
        p.error("--launcher slurm goes with --slurm-conf PATH")
    if args.calls < 1 or args.sessions < 1 or args.gateways < 1:
        p.error("--calls, --sessions and --gateways must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if shutil.which("bwrap") is None:
        raise SystemExit("bench_scale needs bubblewrap (the local sandbox): see README's set-up")
    work = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=os.environ.get("POLAR_BENCH_TMP")))
    try:
        res = asyncio.run(main_async(args, work))
        if args.baseline_sessions:  # the same sessions (same seed) through the baseline's server, gateways as here
            console.print(f"[bold]baseline[/]: {args.baseline_sessions} sessions through the server of "
                          f"{args.baseline_rev}")
            same = argparse.Namespace(**{**vars(args), "sessions": args.baseline_sessions, "calib_sessions": 0,
                                         "store_sessions": 0})
            (work / "baseline").mkdir()
            with baseline_tree(args.baseline_rev, work / "baseline-tree") as tree:
                res["baseline"] = asyncio.run(main_async(same, work / "baseline", tree))["summary"]
    finally:
        if args.keep:
            console.print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    rendered = table(res["summary"])
    console.print(rendered)
    if "baseline" in res:
        compared = compare_table(res["summary"], res["baseline"], args.baseline_rev)
        console.print(compared)
        rendered = Group(rendered, compared)
    write_outputs(res, args.out, rendered)
    console.print(f"written: {args.out}/bench_scale.json, bench_scale_sessions.jsonl, bench_scale_slots.jsonl, "
                  f"bench_scale.md, bench_scale_slots.svg")
    return res


if __name__ == "__main__":
    main()
