"""``+trainer=sft`` / ``+trainer=grpo``: the reference trainer run from a composed config.

SFT needs no fleet: it trains on ``trainer.data`` (datagen's exports). GRPO runs the job's tasks (``num_samples``
sessions per task: one group) on a local fleet each step, as ``launcher=local`` would, and pushes each step's
checkpoint to the fleet's engines through the rollout server's weight-update call. The engine is whatever
``inference`` names; for a closed loop on CPU serve the starting model with vLLM CPU in fp32
(``python -m polar_gym.trainer serve MODEL_DIR``) and set ``inference=vllm inference.upstreams=[URL]``.
Files go to ``out_dir/trainer/``: ``train_metrics.jsonl``, ``train_metrics.svg``, ``checkpoints/``; and
``out_dir/report.html`` (:mod:`polar_gym.report`): the training curves and, for GRPO, every step's sessions (also in
``out_dir/results.jsonl``, one line per session with its ``step``), written even when the loop stops on an error.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from rich.console import Console

from polar_gym.fleet import ensure_upstreams, local_fleet
from polar_gym.launch.config import LaunchJob
from polar_gym.launch.driver import outcome_of, sigterm_cancels_run
from polar_gym.launch.local import LocalLauncher
from polar_gym.launch.outputs import REPORT, SessionOutcome, result_row, write_report
from polar_gym.merge.fidelity import run_fidelity
from polar_gym.private_files import open_private, private_dir, write_secret
from polar_gym.report.files import TRAIN_KEYS, read_jsonl
from polar_gym.schema import SessionResult, TaskRequest
from polar_gym.server.client import RolloutClient
from polar_gym.settings import ConfigError
from polar_gym.telemetry import MetricSinks
from polar_gym.trainer.loops import RolloutSource, WeightSync, run_grpo, run_sft

__all__ = ["SessionRecorder", "train", "write_training_report"]


class SessionRecorder:
    """A RolloutSource that passes every call through and keeps each session it returns, with its step (one
    ``results`` call per step), so the run's report covers every step's sessions."""

    def __init__(self, source: RolloutSource) -> None:
        self.source = source
        self.requests: dict[str, TaskRequest] = {}
        self.sessions: list[tuple[int, SessionOutcome]] = []
        self.step = 0

    async def submit(self, task: TaskRequest) -> dict[str, Any]:
        self.requests[task.task_id] = task
        return await self.source.submit(task)

    async def results(self, task_ids: Iterable[str], **kwargs: Any) -> AsyncIterator[SessionResult]:
        self.step += 1
        started = time.monotonic()
        async for result in self.source.results(task_ids, **kwargs):
            self.sessions.append((self.step, outcome_of(self.requests[result.task_id], result,
                                                        time.monotonic() - started)))
            yield result


def write_training_report(out_dir: Path, algorithm: str, sessions: list[tuple[int, SessionOutcome]],
                          wall: float) -> Path:
    """report.html for a training run: train_metrics.jsonl's curves and the sessions of every step (written to
    results.jsonl too, so ``python -m polar_gym.report`` rebuilds the page)."""
    rows = [{**result_row(o), "step": step} for step, o in sessions]
    if sessions:
        with open_private(out_dir / "results.jsonl") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    outcomes = [o for _, o in sessions]
    return write_report(out_dir, outcomes, rows, run_fidelity(o.result.trajectory for o in outcomes),
                        wall=wall, title=algorithm.upper() + " training run",
                        train_rows=read_jsonl(out_dir / "trainer" / "train_metrics.jsonl"), train_keys=TRAIN_KEYS)


def train(job: LaunchJob) -> int:
    """Run the job's trainer; the exit code (a ConfigError for a setup it cannot run)."""
    assert job.trainer is not None
    console = Console(stderr=True)
    out = job.out_dir / "trainer"
    private_dir(out)
    write_secret(job.out_dir / "config.yaml", job.resolved_config)
    if job.trainer.algorithm == "sft":
        if not job.trainer.data:
            raise ConfigError("sft needs data: trainer.data=[path/to/sft/train.jsonl, ...]", key="trainer.data")
        started = time.monotonic()
        try:
            with _sinks(job) as sinks:
                final = run_sft(job.trainer, out, echo=console.print, sinks=sinks)
        finally:
            write_training_report(job.out_dir, "sft", [], time.monotonic() - started)
        console.print(f"sft: checkpoint {final}; metrics {out / 'train_metrics.jsonl'}; report "
                      f"{job.out_dir / REPORT}")
        return 0
    if not isinstance(job.launcher, LocalLauncher):
        raise ConfigError("grpo runs on a local fleet: launcher=local", key="launcher")
    return asyncio.run(_grpo(job, job.launcher, console))


def _sinks(job: LaunchJob) -> MetricSinks:
    """``logging.wandb`` / ``logging.tensorboard`` for the training metrics (``train/KEY`` at each step)."""
    assert job.trainer is not None
    return MetricSinks.open(job.logging, job.out_dir, job_type=job.trainer.algorithm,
                            config={"trainer": job.trainer.model_dump(mode="json"), "launch_id": job.launch_id})


async def _grpo(job: LaunchJob, launcher: LocalLauncher, console: Console) -> int:
    assert job.trainer is not None
    settings, inference = job.trainer, job.inference
    if settings.push_weights and not issubclass(RolloutClient, WeightSync):
        raise ConfigError("this rollout server client has no update_weights (the fleet's weight-update call); "
                          "trainer.push_weights=false trains without updating the engines", key="trainer.push_weights")
    with sigterm_cancels_run():
        if not inference.await_upstreams:
            await ensure_upstreams(inference, inference.upstreams, console)
        async with (local_fleet(job.out_dir, inference, host=launcher.settings.host,
                                gateway_port=launcher.settings.port, server_port=launcher.settings.server_port,
                                heartbeat=launcher.settings.heartbeat_seconds, pools=launcher.pools,
                                telemetry=job.telemetry, state_dir=job.state_dir) as (url, token),
                    RolloutClient(url, token) as client):
            weights = client if isinstance(client, WeightSync) else None
            recorder, started = SessionRecorder(client), time.monotonic()
            try:
                with _sinks(job) as sinks:
                    final = await run_grpo(settings, job.requests, recorder, job.out_dir / "trainer",
                                           weights=weights, echo=console.print,
                                           timeout=max(r.timeout_seconds for r in job.requests) * 2, sinks=sinks)
            finally:
                write_training_report(job.out_dir, "grpo", recorder.sessions, time.monotonic() - started)
    console.print(f"grpo: last checkpoint {final}; metrics {job.out_dir / 'trainer' / 'train_metrics.jsonl'}; "
                  f"report {job.out_dir / REPORT}")
    return 0
