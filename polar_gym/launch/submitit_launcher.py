"""``launcher=slurm``: the run's fleet as Slurm jobs through submitit.

Order: the rollout server (in this process, or a job with ``server=job``), then the inference jobs (optional; their
URLs join ``inference.upstreams``), then the gateway jobs, which register with the server and heartbeat. Once the
wanted number of gateways is healthy the tasks go through the server's API exactly as with ``launcher=local``.
Every job this launcher submitted is cancelled when it ends, also on Ctrl-C or SIGTERM, and it waits until Slurm
reports them finished; ``jobs.json`` in the output folder lists them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import secrets
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console
from rich.markup import escape

from polar_gym.fleet import (
    describe_inference,
    ensure_upstreams,
    rollout_backends,
    rollout_servers,
    server_order,
    write_server_info,
)
from polar_gym.launch.config import LaunchJob
from polar_gym.launch.driver import RunDriver, run_job, sigterm_cancels_run
from polar_gym.launch.jobs import (
    GatewayJobSettings,
    InferenceJobSettings,
    advertised_host,
    gateway_argv,
    gateway_workdir,
    node_port,
    run_gateway_job,
    run_inference_job,
    run_server_job,
)
from polar_gym.launch.lost_jobs import JobLost, JobWatch, LostJob, lost_outcomes, query_states
from polar_gym.launch.outputs import SessionOutcome, finish
from polar_gym.launch.placement import (
    JobKind,
    PlacementSettings,
    job_kind,
    launcher_host,
    placement_parameters,
    running_nodes,
)
from polar_gym.private_files import private_dir, write_secret
from polar_gym.proxy.settings import check_upstreams_given
from polar_gym.server.client import RolloutClient
from polar_gym.settings import ConfigError

__all__ = ["SlurmLauncher", "SlurmLauncherSettings", "private_umask"]

_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
          "DEADLINE", "INTERRUPTED", "FINISHED", "NO"}  # the last two: submitit's local executor


class SlurmLauncherSettings(BaseModel):
    """The ``launcher=slurm`` keys."""

    model_config = ConfigDict(extra="forbid")

    cluster: str = Field(default="slurm", description="submitit's cluster: slurm, or local / debug to try the "
                         "wiring without Slurm")
    partition: str | None = Field(default=None, description="#SBATCH --partition")
    account: str | None = Field(default=None, description="#SBATCH --account")
    qos: str | None = Field(default=None, description="#SBATCH --qos")
    additional_parameters: dict[str, Any] = Field(default_factory=dict, description="any other #SBATCH option, "
                                                  "e.g. {constraint: h100, exclusive: true}")
    server: Literal["local", "job"] = Field(default="local", description="local: the rollout server runs in this "
                                            "process; job: in its own Slurm job (writes OUT_DIR/server-job.json)")
    server_host: str | None = Field(default=None, description="how gateways and trainers reach the server "
                                    "(default: this host's FQDN, or its address toward the Slurm controller if "
                                    "the FQDN is loopback here; with server=job, the job's node name); "
                                    "{host} stands for that name, e.g. {host}-ib")
    server_port: int = Field(default=0, ge=0, description="the rollout server's port (0: a free port)")
    server_workers: int = Field(default=1, ge=1, le=64, description="rollout server workers on the server's node: "
                                "1 keeps the store in SQLite; more share a private PostgreSQL in state_dir/postgres "
                                "(Debian's postgresql-15), each watching the gateways that register with it "
                                "(for fleets where one server event loop is the limit; see docs/scaling.md)")
    advertise_host: str | None = Field(default=None, description="how the server reaches gateways / gateways "
                                       "reach inference jobs (default: each node's host name; {host} stands for "
                                       "it, e.g. {host}-ib; a fixed name is only right on one node)")
    gateways: int = Field(default=1, ge=1, description="gateway jobs to start (at least one)")
    gateway: GatewayJobSettings = Field(default_factory=GatewayJobSettings)
    inference_jobs: InferenceJobSettings = Field(default_factory=InferenceJobSettings)
    placement: PlacementSettings = Field(default_factory=PlacementSettings)
    register_timeout_seconds: float = Field(default=600.0, gt=0, description="how long the gateways (and a server "
                                            "job) may take to come up")
    heartbeat_seconds: float = Field(default=2.0, gt=0, description="seconds between the gateways' heartbeats")
    replace_lost_gateways: bool = Field(default=False, description="submit a new gateway job when one is lost "
                                        "mid-run (node failure, killed, time limit), so capacity comes back; its "
                                        "sessions are re-dispatched either way")
    max_gateway_replacements: int = Field(default=4, ge=0, description="at most this many replacement gateway "
                                          "jobs per run")
    job_check_seconds: float = Field(default=10.0, gt=0, description="seconds between two checks of the run's "
                                     "jobs (sacct, squeue) for lost ones")
    progress: bool = Field(default=True, description="the rich live display")


class SlurmLauncher:
    """Submit the fleet, run the job's tasks through it, cancel the fleet. Returns the exit code (1 if any session
    ended ERROR or CANCELLED)."""

    settings_model: ClassVar[type[SlurmLauncherSettings]] = SlurmLauncherSettings

    def __init__(self, settings: SlurmLauncherSettings | None = None) -> None:
        settings = settings or SlurmLauncherSettings()
        self.settings = settings
        self.gateway, self.inference_jobs = settings.gateway, settings.inference_jobs
        self.gateways, self.server_mode = settings.gateways, settings.server
        self.server_host, self.server_port = settings.server_host, settings.server_port
        self.advertise_host = settings.advertise_host
        self.cluster = settings.cluster
        self.slurm: dict[str, Any] = {k: v for k, v in (("slurm_partition", settings.partition),
                                                         ("slurm_account", settings.account),
                                                         ("slurm_qos", settings.qos)) if v}
        if settings.additional_parameters:
            self.slurm["slurm_additional_parameters"] = dict(settings.additional_parameters)
        self.placement = settings.placement
        self.register_timeout, self.heartbeat = settings.register_timeout_seconds, settings.heartbeat_seconds
        self.progress = settings.progress
        self.console = Console(stderr=True)
        self.jobs: list[Any] = []
        self.names: dict[str, str] = {}
        #: the lost-job watch of the running run (None before the gateways are up)
        self.watch: JobWatch | None = None
        #: submits one more gateway job under a name; set once the gateways are started
        self._submit_gateway: Callable[[str], str] | None = None
        self.nodes: dict[str, str] = {}  # job id -> the node it runs on, once squeue lists it running
        #: every server worker's URL (the first is the one the driver talks to) and the store they use
        self.server_urls: list[str] = []
        self.store_target: Path | str | None = None

    def launch(self, job: LaunchJob) -> int:
        private_dir(job.out_dir)
        write_secret(job.out_dir / "config.yaml", job.resolved_config)  # it may hold a key (runtime.env, ...)
        outcomes, wall = asyncio.run(self._main(job))
        lost = [j.as_dict() for j in self.watch.lost.values()] if self.watch is not None else []
        return finish(self.console, job, outcomes, wall, lost_jobs=lost)

    async def _main(self, job: LaunchJob) -> tuple[list[SessionOutcome], float]:
        try:
            with sigterm_cancels_run():
                return await self._run(job)
        finally:
            await asyncio.shield(asyncio.to_thread(self._cancel_all, job.out_dir))

    async def _run(self, job: LaunchJob) -> tuple[list[SessionOutcome], float]:
        token = secrets.token_urlsafe(24)
        settings = job.inference
        self.console.print(describe_inference(settings), markup=False, highlight=False, soft_wrap=True)
        if not settings.await_upstreams:  # a wrong URL stops the launch before any job is submitted
            await ensure_upstreams(settings, settings.upstreams, self.console)
        async with self._server(job, token) as server_url:
            started = await self._start_inference(job)
            if not settings.await_upstreams:
                await ensure_upstreams(settings, started, self.console)
            upstreams = list(settings.upstreams) + started
            self._start_gateways(job, server_url, upstreams, token)
            async with RolloutClient(server_url, token) as client:
                await self._wait_for_gateways(client)
                await asyncio.to_thread(self._note_nodes, job.out_dir)
                if settings.await_upstreams:  # the policy may start after the fleet: wait for it (bounded)
                    await ensure_upstreams(settings, upstreams, self.console,
                                           backends=functools.partial(rollout_backends, client))
                return await self._run_watched(job, client)

    # -- the pieces ----------------------------------------------------------------------------------------------

    def _executor(self, job: LaunchJob, name: str, **resources: Any) -> Any:
        import submitit

        folder = job.out_dir / "slurm"  # pickles of the jobs' arguments (tokens among them) and the jobs' logs
        folder.mkdir(mode=0o700, exist_ok=True)
        folder.chmod(0o700)
        executor = submitit.AutoExecutor(folder=folder / "%j", cluster=self.cluster)
        placed = self._placed(job_kind(name))
        executor.update_parameters(name=name, nodes=1, tasks_per_node=1, **resources,
                                   **{**self.slurm, **({"slurm_additional_parameters": placed} if placed else {})})
        return executor

    def _placed(self, kind: JobKind | None) -> dict[str, Any]:
        """This kind's #SBATCH options: additional_parameters, launcher.placement, spread's exclude."""
        taken = {node: job_kind(self.names[job_id]) for job_id, node in self.nodes.items()}
        return placement_parameters(self.placement, kind, self.settings.additional_parameters, taken)

    def _note_nodes(self, out_dir: Path) -> None:
        """Record the node of each running job (jobs.json, and for spread) once squeue lists it running."""
        unknown = [j.job_id for j in self.jobs if j.job_id not in self.nodes]
        if self.cluster == "slurm":
            self.nodes.update(running_nodes(unknown))
        else:  # submitit's local executor: every job runs on this machine
            self.nodes.update(dict.fromkeys(unknown, socket.gethostname()))
        self._write_jobs(out_dir)

    def _submit(self, executor: Any, name: str, fn: Any, *args: Any, out_dir: Path) -> Any:
        with private_umask():  # the pickles submitit writes, and (through sbatch's SLURM_UMASK) the jobs' files
            submitted = executor.submit(fn, *args)
        self.jobs.append(submitted)
        self.names[submitted.job_id] = name
        self._write_jobs(out_dir)
        self.console.print(f"submitted {name} job {submitted.job_id}")
        return submitted

    def _write_jobs(self, out_dir: Path) -> None:
        """jobs.json: every job this launcher submitted, with its node (once it ran), ``state`` (live, or ``lost:
        STATE``) and, for a lost gateway, the job that replaced it."""
        states = self.watch.states() if self.watch is not None else {}
        lost = self.watch.lost if self.watch is not None else {}
        rows = [{"job_id": j.job_id, "name": self.names[j.job_id], "node": self.nodes.get(j.job_id),
                 "state": states.get(j.job_id, "live"),
                 **({"replaced_by": lost[j.job_id].replaced_by} if j.job_id in lost else {})} for j in self.jobs]
        write_secret(out_dir / "jobs.json", json.dumps(rows, indent=1) + "\n")

    @contextlib.asynccontextmanager
    async def _server(self, job: LaunchJob, token: str) -> AsyncIterator[str]:
        workers = self.settings.server_workers
        if self.server_mode == "local":
            default = await asyncio.to_thread(launcher_host) if self.cluster == "slurm" else socket.getfqdn()
            host = advertised_host(self.server_host, default)
            ports = [self.server_port or node_port()] + [node_port() for _ in range(workers - 1)]
            async with rollout_servers(job.store, "0.0.0.0", ports, token, self.heartbeat) as store:
                self.server_urls, self.store_target = [f"http://{host}:{port}" for port in ports], store
                write_server_info(job.out_dir, self.server_urls[0], token)
                more = f", {workers - 1} more worker(s) on PostgreSQL" if workers > 1 else ""
                self.console.print(f"rollout server {self.server_urls[0]}{more} (token in "
                                   f"{job.out_dir / 'server.json'})")
                yield self.server_urls[0]
            return
        info = job.out_dir / "server-job.json"
        info.unlink(missing_ok=True)
        executor = self._executor(job, "polar-server", cpus_per_task=max(4, 2 * workers), mem_gb=8,
                                  timeout_min=self.gateway.timeout_min)
        submitted = self._submit(executor, "polar-server", run_server_job, str(job.store),
                                 token, str(info), self.server_host, self.heartbeat, workers, out_dir=job.out_dir)
        answer = await self._wait_for_file(info, submitted, self.register_timeout)
        self.server_urls = list(answer.get("urls") or [answer["url"]])
        # the store's own: SQLite where the launcher's host sees it; PostgreSQL lives in the server job
        self.store_target = job.store if workers == 1 else None
        await asyncio.to_thread(self._note_nodes, job.out_dir)
        write_server_info(job.out_dir, self.server_urls[0], token)
        self.console.print(f"rollout server job {submitted.job_id} at {self.server_urls[0]}")
        yield self.server_urls[0]

    async def _start_inference(self, job: LaunchJob) -> list[str]:
        settings = self.inference_jobs
        if settings.count == 0:
            return []
        executor = self._executor(job, "polar-inference", cpus_per_task=settings.cpus_per_task,
                                  mem_gb=settings.mem_gb, timeout_min=settings.timeout_min,
                                  **({"gpus_per_node": settings.gpus_per_node} if settings.gpus_per_node else {}))
        waits = []
        for i in range(settings.count):
            info = job.out_dir / f"inference-{i}.json"
            info.unlink(missing_ok=True)
            submitted = self._submit(executor, f"polar-inference-{i}", run_inference_job, settings.model_dump(),
                                     str(info), self.advertise_host, out_dir=job.out_dir)
            waits.append(self._wait_for_file(info, submitted, settings.ready_timeout_seconds + 600))
        urls = [info["url"] for info in await asyncio.gather(*waits)]
        await asyncio.to_thread(self._note_nodes, job.out_dir)
        self.console.print(f"inference servers ready: {', '.join(urls)}")
        return urls

    def _start_gateways(self, job: LaunchJob, server_url: str, upstreams: list[str], token: str) -> None:
        try:
            check_upstreams_given(job.inference.model_copy(update={"upstreams": upstreams}))
        except ConfigError as exc:
            raise exc.under("inference") from None
        pools = self.gateway
        executor = self._executor(job, "polar-gateway", cpus_per_task=pools.cpus_per_task, mem_gb=pools.mem_gb,
                                  timeout_min=pools.timeout_min)

        def submit(index: str) -> str:
            workdir, scratch = gateway_workdir(pools, job.out_dir, index)
            urls = server_order(self.server_urls or [server_url], int(index.split(".")[0]))
            argv = gateway_argv(job.inference, pools, upstreams, server_url=urls, workdir=workdir,
                                heartbeat=self.heartbeat, telemetry=job.telemetry)
            return str(self._submit(executor, f"polar-gateway-{index}", run_gateway_job, argv, self.advertise_host,
                                    token, scratch, out_dir=job.out_dir).job_id)

        for i in range(self.gateways):
            submit(str(i))
        self._submit_gateway = submit

    # -- the lost-job watch (polar_gym.launch.lost_jobs) ---------------------------------------------------------

    async def _run_watched(self, job: LaunchJob, client: RolloutClient) -> tuple[list[SessionOutcome], float]:
        """The job's tasks while :class:`JobWatch` checks the jobs; a loss the run cannot survive stops the
        driver (its tasks are cancelled on the server) and ends the sessions not finished as ``job_lost``."""
        replace = self._replace_gateway if self.settings.replace_lost_gateways else None
        self.watch = watch = JobWatch(self.jobs, self.names, console=self.console, cluster=self.cluster,
                                      interval=self.settings.job_check_seconds, replace=replace,
                                      max_replacements=self.settings.max_gateway_replacements,
                                      changed=functools.partial(self._write_jobs, job.out_dir),
                                      gateways=client.gateways)
        started = time.monotonic()
        run = asyncio.ensure_future(run_job(RunDriver(client, self.console, progress=self.progress), job))
        watching = asyncio.ensure_future(watch.run())
        try:
            await asyncio.wait({run, watching}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            run.cancel()
            watching.cancel()
            await asyncio.gather(run, watching, return_exceptions=True)
            raise
        exc: BaseException | None = None
        if run.done():
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
            if run.cancelled() or run.exception() is None:
                return run.result()
            try:  # the driver failed (its server stopped answering): a lost job may be why
                await watch.explain(timeout=3 * self.settings.job_check_seconds + 30)
            except JobLost as lost:
                exc = lost
            if exc is None:
                return run.result()
        else:
            exc = watching.exception()
        if not isinstance(exc, JobLost):
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            raise exc if exc is not None else RuntimeError("the job watch ended")
        self.console.print(f"[bold red]the run cannot go on: {escape(str(exc))}[/]", highlight=False)
        outcomes = await lost_outcomes(self.store_target, job.requests, exc.lost,
                                       time.monotonic() - started)
        run.cancel()  # the driver cancels the tasks still open on the server (when it still answers)
        await asyncio.gather(run, return_exceptions=True)
        return outcomes, time.monotonic() - started

    def _replace_gateway(self, lost: LostJob) -> str | None:
        """Submit a gateway job in place of a lost one (same settings, a fresh working dir)."""
        if self._submit_gateway is None:
            return None
        first = lost.name.removeprefix("polar-gateway-").split(".")[0]  # gateway-1 -> gateway-1.1 -> gateway-1.2
        earlier = sum(1 for name in self.names.values() if name.startswith(f"polar-gateway-{first}."))
        return self._submit_gateway(f"{first}.{earlier + 1}")

    async def _wait_for_gateways(self, client: RolloutClient) -> None:
        deadline = time.monotonic() + self.register_timeout
        gateway_jobs = self.jobs[-self.gateways:]
        while True:
            healthy = [g for g in await client.gateways() if g["state"] == "healthy"]
            if len(healthy) >= self.gateways:
                self.console.print(f"{len(healthy)} gateway(s) registered")
                return
            for submitted in gateway_jobs:
                problem = await asyncio.to_thread(_ended, submitted)
                if problem:
                    raise RuntimeError(f"gateway job {submitted.job_id} {problem}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(healthy)}/{self.gateways} gateways registered after "
                                   f"{self.register_timeout:.0f} s")
            await asyncio.sleep(1.0)

    async def _wait_for_file(self, path: Path, submitted: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(path.exists):
            problem = await asyncio.to_thread(_ended, submitted)
            if problem:
                raise RuntimeError(f"job {submitted.job_id} {problem}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {submitted.job_id} did not write {path.name} within {timeout:.0f} s")
            await asyncio.sleep(1.0)
        return dict(json.loads(await asyncio.to_thread(path.read_text)))

    def _still_live(self, jobs: list[Any]) -> list[Any]:
        """The jobs not yet gone. On Slurm, asked afresh: a job is gone once squeue no longer lists it (CANCELLED shows
        in sacct at once, COMPLETING still runs), or by sacct's state when squeue cannot answer. submitit's own state
        comes from a cache that refreshes every half of the time since the last submission: minutes, late in a run."""
        if self.cluster != "slurm":
            return [j for j in jobs if _state(j) not in _ENDED]
        answers = query_states([j.job_id for j in jobs])
        return [j for j in jobs if _listed(*answers[j.job_id])]

    def _cancel_all(self, out_dir: Path, timeout: float = 120.0) -> None:
        """scancel every job this launcher submitted and wait until Slurm no longer lists them as live."""
        for submitted in self.jobs:
            with contextlib.suppress(Exception):
                cancel_job(submitted, self.cluster)
        deadline = time.monotonic() + timeout
        live = list(self.jobs)
        while live and time.monotonic() < deadline:
            live = self._still_live(live)
            if live:
                time.sleep(1.0)
        if live:
            self.console.print(f"[yellow]jobs still listed after cancel: {[j.job_id for j in live]}[/]")
        elif self.jobs:
            self.console.print(f"cancelled {len(self.jobs)} job(s): {' '.join(j.job_id for j in self.jobs)}")


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Files created in the block are readable by their owner only (umask 077; process-wide, so kept short)."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def cancel_job(submitted: Any, cluster: str) -> None:
    """End a job as scancel does: SIGTERM. On ``cluster=local`` that goes to submitit's controller process (its job id
    is the controller's pid, our child, unreaped while its state reads RUNNING, so the pid cannot be another
    process's yet), which passes it to its task. submitit's own local cancel sends SIGINT instead, and a launcher
    started in the background (bash ignores SIGINT in background jobs) passes the ignore on to every controller:
    such a job never ended, and the launch waited out the cancel timeout and left it running."""
    if cluster != "local":
        submitted.cancel(check=False)
    elif _state(submitted) == "RUNNING":
        os.kill(int(submitted.job_id), signal.SIGTERM)


def _listed(state: str | None, queued: bool | None) -> bool:
    """Whether a cancelled Slurm job may still run, from :func:`query_states`' answer for it."""
    if queued is not None:
        return queued
    return state is None or state.split()[0].upper() not in _ENDED


def _state(submitted: Any) -> str:
    """The job's Slurm state ('UNKNOWN' without accounting), first word only ('CANCELLED by 0' -> CANCELLED)."""
    try:
        return str(submitted.state).split()[0].upper()
    except Exception:
        return "UNKNOWN"


def _ended(submitted: Any) -> str | None:
    """Why a service job is gone (it should run until cancelled), with the tail of its log; None while it lives."""
    state = _state(submitted)
    if state not in _ENDED:
        return None
    tail = ""
    with contextlib.suppress(Exception):
        tail = (submitted.stderr() or "")[-3000:]
    return f"ended ({state}) before it was ready:\n{tail}"
