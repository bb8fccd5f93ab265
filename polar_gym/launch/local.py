"""``launcher=local``: a rollout server and a gateway node (the proxy plus staged sandboxes) in this process, each
served on loopback; the gateway registers with the server like a remote one, the tasks go through the server's API
and a rich live display shows the fleet while they run."""

from __future__ import annotations

import asyncio
import functools
from typing import ClassVar

from pydantic import Field
from rich.console import Console

from polar_gym.fleet import describe_inference, ensure_upstreams, local_fleet, rollout_backends
from polar_gym.gateway.config import GatewayPools
from polar_gym.launch.config import LaunchJob
from polar_gym.launch.driver import RunDriver, run_job, sigterm_cancels_run
from polar_gym.launch.outputs import SessionOutcome, finish
from polar_gym.private_files import private_dir, write_secret
from polar_gym.server.client import RolloutClient

__all__ = ["LocalLauncher", "LocalLauncherSettings"]


class LocalLauncherSettings(GatewayPools):
    """The ``launcher=local`` keys: the gateway's pools and operator options (defaults: the gateway's own), where
    the fleet listens, the heartbeat and the live display."""

    host: str = Field(default="127.0.0.1", description="where the gateway and the rollout server listen")
    port: int = Field(default=0, ge=0, description="the gateway's port (0: any free port)")
    server_port: int = Field(default=0, ge=0, description="the rollout server's port (0: any free port)")
    heartbeat_seconds: float = Field(default=1.0, gt=0, description="seconds between the gateway's heartbeats "
                                     "(the server's health probes run at the same pace)")
    progress: bool = Field(default=True, description="the rich live display (sessions by stage, rewards, "
                           "throughput)")


class LocalLauncher:
    """Run a job on this machine the way a cluster runs it: a rollout server and one gateway node (proxy + staged
    sandboxes) in this process, each on its own loopback port; the gateway registers and heartbeats like a remote
    one and the tasks go through the server's API. Returns the exit code (1 if any session ended ERROR or
    CANCELLED)."""

    settings_model: ClassVar[type[LocalLauncherSettings]] = LocalLauncherSettings

    def __init__(self, settings: LocalLauncherSettings | None = None) -> None:
        self.settings = settings or LocalLauncherSettings()
        # runtime_options / expose_roots are the gateway's own configuration: the only place options that reach
        # the host (a container CLI, binds, limits) may come from (docs/security.md)
        self.pools = GatewayPools.model_validate(self.settings.model_dump(include=set(GatewayPools.model_fields)))
        self.console = Console(stderr=True)

    def launch(self, job: LaunchJob) -> int:
        private_dir(job.out_dir)
        write_secret(job.out_dir / "config.yaml", job.resolved_config)  # it may hold a key (runtime.env, ...)
        outcomes, wall = asyncio.run(self._run(job))
        return finish(self.console, job, outcomes, wall)

    async def _run(self, job: LaunchJob) -> tuple[list[SessionOutcome], float]:
        with sigterm_cancels_run():
            return await self._fleet(job)

    async def _fleet(self, job: LaunchJob) -> tuple[list[SessionOutcome], float]:
        inference, settings = job.inference, self.settings
        self.console.print(describe_inference(inference), markup=False, highlight=False, soft_wrap=True)
        if not inference.await_upstreams:  # a wrong URL stops the launch before anything starts
            await ensure_upstreams(inference, inference.upstreams, self.console)
        async with local_fleet(job.out_dir, inference, host=settings.host, gateway_port=settings.port,
                               server_port=settings.server_port, heartbeat=settings.heartbeat_seconds,
                               pools=self.pools, telemetry=job.telemetry,
                               state_dir=job.state_dir) as (server_url, server_token):
            self.console.print(f"rollout server {server_url} (token in {job.out_dir / 'server.json'})")
            async with RolloutClient(server_url, server_token) as client:
                if inference.await_upstreams:  # the policy may start after the fleet: wait for it (bounded)
                    await ensure_upstreams(inference, inference.upstreams, self.console,
                                           backends=functools.partial(rollout_backends, client))
                return await run_job(RunDriver(client, self.console, progress=settings.progress), job)
