"""``+trainer=sft`` / ``+trainer=grpo``: the reference trainer run from a composed config.

SFT needs no fleet: it trains on ``trainer.data`` (datagen's exports). GRPO runs the job's tasks (``num_samples``
sessions per task: one group) on a local fleet each step, as ``launcher=local`` would, and pushes each step's
checkpoint to the fleet's engines through the rollout server's weight-update call. The engine is whatever
``inference`` names; for a closed loop on CPU serve the starting model with vLLM CPU in fp32
(``python -m polar_gym.trainer serve MODEL_DIR``) and set ``inference=vllm inference.upstreams=[URL]``.
Files go to ``out_dir/trainer/``: ``train_metrics.jsonl``, ``train_metrics.svg``, ``checkpoints/``.
"""

from __future__ import annotations

import asyncio

from rich.console import Console

from polar_gym.fleet import ensure_upstreams, local_fleet
from polar_gym.launch.config import LaunchJob
from polar_gym.launch.driver import sigterm_cancels_run
from polar_gym.launch.local import LocalLauncher
from polar_gym.private_files import write_secret
from polar_gym.server.client import RolloutClient
from polar_gym.settings import ConfigError
from polar_gym.trainer.loops import WeightSync, run_grpo, run_sft

__all__ = ["train"]


def train(job: LaunchJob) -> int:
    """Run the job's trainer; the exit code (a ConfigError for a setup it cannot run)."""
    assert job.trainer is not None
    console = Console(stderr=True)
    out = job.out_dir / "trainer"
    out.mkdir(parents=True, exist_ok=True)
    write_secret(job.out_dir / "config.yaml", job.resolved_config)
    if job.trainer.algorithm == "sft":
        if not job.trainer.data:
            raise ConfigError("sft needs data: trainer.data=[path/to/sft/train.jsonl, ...]", key="trainer.data")
        final = run_sft(job.trainer, out, echo=console.print)
        console.print(f"sft: checkpoint {final}; metrics {out / 'train_metrics.jsonl'}")
        return 0
    if not isinstance(job.launcher, LocalLauncher):
        raise ConfigError("grpo runs on a local fleet: launcher=local", key="launcher")
    return asyncio.run(_grpo(job, job.launcher, console))


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
                                heartbeat=launcher.settings.heartbeat_seconds, pools=launcher.pools) as (url, token),
                    RolloutClient(url, token) as client):
            weights = client if isinstance(client, WeightSync) else None
            final = await run_grpo(settings, job.requests, client, job.out_dir / "trainer", weights=weights,
                                   echo=console.print, timeout=max(r.timeout_seconds for r in job.requests) * 2)
    console.print(f"grpo: last checkpoint {final}; metrics {job.out_dir / 'trainer' / 'train_metrics.jsonl'}")
    return 0
