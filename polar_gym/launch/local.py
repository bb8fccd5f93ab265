"""``launcher=local``: the proxy and a gateway node in this process, served on loopback (sandboxed harnesses reach
the proxy through it), the tasks submitted to the node directly, a rich live display while they run."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import secrets
import socket
import time
from pathlib import Path

import uvicorn
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from polar_gym.assets import tokenizer_dir
from polar_gym.gateway import GatewayConfig, GatewayNode, build_gateway
from polar_gym.launch.config import ConfigError, InferenceSettings, LaunchJob
from polar_gym.launch.outputs import SessionOutcome, summary_rows, write_outputs
from polar_gym.proxy.__main__ import build_engine
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.base import Engine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.runtime.base import GatewayEndpoint
from polar_gym.schema import SessionSpec, SessionStatus

__all__ = ["LocalLauncher", "make_engine"]

_STAGES = ["queued", "init", "ready", "run", "postrun"]
_FAILED = {SessionStatus.ERROR, SessionStatus.CANCELLED}


def make_engine(settings: InferenceSettings) -> Engine:
    """The proxy engine for the ``inference`` group (the same construction as ``python -m polar_gym.proxy``)."""
    tokenizer = Path(settings.tokenizer) if settings.tokenizer else None
    if tokenizer is None and settings.engine in ("oracle", "sglang_generate"):
        tokenizer = tokenizer_dir()
        if not (tokenizer / ".complete").exists():
            raise ConfigError(f"inference.tokenizer: the default tokenizer {tokenizer} is not built; run "
                              "`bash scripts/setup.sh` or set inference.tokenizer=DIR")
    args = argparse.Namespace(engine=settings.engine, upstream=settings.upstreams, tokenizer=tokenizer,
                              oracle_script=None, drift_every=settings.drift_every,
                              policy_version=settings.policy_version, upstream_timeout=settings.upstream_timeout,
                              upstream_model=settings.upstream_model)
    return build_engine(args)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # Ctrl-C stays with asyncio.run, which cancels the run
        return None


class LocalLauncher:
    """Run every session of a job on one in-process gateway node; returns the exit code (1 if any session
    ended ERROR or CANCELLED)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, init_workers: int = 4, ready_buffer: int = 4,
                 run_slots: int = 4, postrun_workers: int = 4, prewarm_workers: int = 2,
                 postrun_grace_seconds: float = 300.0, progress: bool = True) -> None:
        self.host = host
        self.port = port
        self.pools = {"init_workers": init_workers, "ready_buffer": ready_buffer, "run_slots": run_slots,
                      "postrun_workers": postrun_workers, "prewarm_workers": prewarm_workers,
                      "postrun_grace_seconds": postrun_grace_seconds}
        try:  # refuse bad pool sizes now, before anything starts
            GatewayConfig(**self.pools)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ConfigError(f"launcher: {exc}") from None
        self.progress = progress
        self.console = Console(stderr=True)

    def launch(self, job: LaunchJob) -> int:
        job.out_dir.mkdir(parents=True, exist_ok=True)
        (job.out_dir / "config.yaml").write_text(job.resolved_config)
        outcomes, wall = asyncio.run(self._run(job))
        totals = write_outputs(job.out_dir, outcomes, wall)
        self._print_summary(outcomes, totals, job.out_dir)
        return 1 if any(o.result.status in _FAILED for o in outcomes) else 0

    async def _run(self, job: LaunchJob) -> tuple[list[SessionOutcome], float]:
        engine = make_engine(job.inference)
        service = ProxyService(engine, CaptureJournal(job.out_dir / "capture"), SessionRegistry(allow_adhoc=False),
                               max_tokens_cap=job.inference.max_tokens_cap)
        port = self.port or _free_port(self.host)
        config = GatewayConfig(workdir=job.out_dir / "gateway", endpoint=GatewayEndpoint(self.host, port),
                               **self.pools)  # type: ignore[arg-type]
        node, app = build_gateway(service, config, secrets.token_urlsafe(24))
        server = _Server(uvicorn.Config(app, host=self.host, port=port, log_level="warning", lifespan="off"))
        serving = asyncio.create_task(server.serve())
        try:
            while not server.started:
                if serving.done():
                    serving.result()
                    raise RuntimeError(f"the gateway could not listen on {self.host}:{port}")
                await asyncio.sleep(0.01)
            return await self._sessions(job, node, service)
        finally:
            await node.stop("launch finished")
            server.should_exit = True
            await serving
            service.journal.close()
            await engine.aclose()

    async def _sessions(self, job: LaunchJob, node: GatewayNode,
                        service: ProxyService) -> tuple[list[SessionOutcome], float]:
        specs = [SessionSpec.from_task(r, i) for r in job.requests for i in range(r.num_samples)]
        started = time.monotonic()
        submitted = {}
        for spec in specs:
            node.submit(spec)
            submitted[spec.session_id] = time.monotonic()
        outcomes: dict[str, SessionOutcome] = {}

        async def finish(spec: SessionSpec) -> None:
            result = await node.wait(spec.session_id)
            records = await service.journal.records(spec.session_id)
            outcomes[spec.session_id] = SessionOutcome(spec, result, len(records),
                                                       time.monotonic() - submitted[spec.session_id])

        bar = Progress(TextColumn("[bold]sessions"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       console=self.console)
        bar_task = bar.add_task("sessions", total=len(specs))
        waiters = [asyncio.create_task(finish(spec)) for spec in specs]
        live = Live(self._view(bar, node, outcomes, started), console=self.console, refresh_per_second=4)
        with live if self.progress else contextlib.nullcontext():
            pending = set(waiters)
            while pending:
                done, pending = await asyncio.wait(pending, timeout=0.25)
                for task in done:
                    task.result()
                bar.update(bar_task, completed=len(outcomes))
                live.update(self._view(bar, node, outcomes, started))
        return [outcomes[s.session_id] for s in specs], time.monotonic() - started

    @staticmethod
    def _view(bar: Progress, node: GatewayNode, outcomes: dict[str, SessionOutcome], started: float) -> Group:
        stages = collections.Counter(s.stage for s in node.sessions() if s.stage != "done")
        statuses = collections.Counter(o.result.status.value for o in outcomes.values())
        rewards = [o.reward for o in outcomes.values() if o.reward is not None]
        elapsed = max(time.monotonic() - started, 1e-9)
        done = ", ".join(f"{k.lower()} {v}" for k, v in sorted(statuses.items())) or "none yet"
        mean = f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"
        stage_line = "stages: " + " · ".join(f"{name} [bold]{stages.get(name, 0)}[/]" for name in _STAGES)
        result_line = (f"finished: {done} · mean reward [bold]{mean}[/] · "
                       f"{len(outcomes) / elapsed * 60:.1f} sessions/min")
        return Group(bar, stage_line, result_line)

    def _print_summary(self, outcomes: list[SessionOutcome], totals: dict[str, object], out_dir: Path) -> None:
        table = Table(title="polar_gym launch")
        for column in ["task", "sample", "harness", "status", "reward", "traces", "completions", "seconds"]:
            table.add_column(column)
        for row in summary_rows(outcomes):
            table.add_row(*row)
        self.console.print(table)
        mean = totals["mean_reward"]
        self.console.print(f"{totals['completed']}/{totals['sessions']} completed, mean reward "
                           f"{'-' if mean is None else f'{mean:.3f}'}, {totals['traces']} traces, "
                           f"{totals['completions']} completions in {totals['wall_seconds']:.1f}s; files in {out_dir}")
