"""What runs inside the Slurm jobs ``launcher=slurm`` submits (through submitit): a gateway node, the rollout server
and an inference server. Each is a plain function of picklable arguments; each announces where it listens by
registering (gateways) or by writing a small JSON file next to the run's outputs (server, inference), so the launcher
needs no fixed ports. Pure command construction lives here too, so tests read it without Slurm."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from polar_gym.launch.config import InferenceSettings

__all__ = ["GatewayJobSettings", "InferenceJobSettings", "free_port", "gateway_argv", "inference_command",
           "run_gateway_job", "run_inference_job", "run_server_job"]


class GatewayJobSettings(BaseModel):
    """One gateway job's Slurm resources and pools."""

    model_config = ConfigDict(extra="forbid")

    cpus_per_task: int = Field(default=8, ge=1)
    mem_gb: float = Field(default=16, gt=0)
    timeout_min: int = Field(default=1440, ge=1)
    run_slots: int = Field(default=8, ge=1)
    init_workers: int = Field(default=4, ge=1)
    ready_buffer: int = Field(default=4, ge=0)
    postrun_workers: int = Field(default=4, ge=1)
    prewarm_workers: int = Field(default=2, ge=0)


class InferenceJobSettings(BaseModel):
    """Inference servers started as Slurm jobs (SGLang on GPU nodes; ``tiny_vllm`` is the project's tiny Qwen3 on
    vLLM's CPU build, for trying the path without GPUs). Their URLs become the gateways' upstreams."""

    model_config = ConfigDict(extra="forbid")

    count: int = Field(default=0, ge=0)
    kind: Literal["sglang", "vllm", "tiny_vllm"] = "sglang"
    python: str = "python3"
    model_path: str | None = None
    #: 0: a free port picked on the node
    port: int = Field(default=0, ge=0)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    gpus_per_node: int = Field(default=1, ge=0)
    cpus_per_task: int = Field(default=16, ge=1)
    mem_gb: float = Field(default=128, gt=0)
    timeout_min: int = Field(default=1440, ge=1)
    ready_timeout_seconds: float = Field(default=1800, gt=0)


def gateway_argv(inference: InferenceSettings, pools: GatewayJobSettings, upstreams: list[str], *,
                 server_url: str, workdir: Path, heartbeat: float) -> list[str]:
    """``python -m polar_gym.gateway`` arguments for a gateway job (port and advertised host are added on the node).
    The engine comes from the ``inference`` group; ``upstreams`` are its URLs plus those of inference jobs."""
    argv = ["--engine", inference.engine, "--host", "0.0.0.0", "--workdir", str(workdir),
            "--capture-dir", str(workdir / "capture"), "--server-url", server_url, "--heartbeat", str(heartbeat),
            "--run-slots", str(pools.run_slots), "--init-workers", str(pools.init_workers),
            "--ready-buffer", str(pools.ready_buffer), "--postrun-workers", str(pools.postrun_workers),
            "--prewarm-workers", str(pools.prewarm_workers), "--upstream-timeout", str(inference.upstream_timeout),
            "--drift-every", str(inference.drift_every)]
    if upstreams:
        argv += ["--upstream", *upstreams]
    if inference.await_upstreams:
        argv.append("--await-upstreams")
    tokenizer = inference.tokenizer
    if tokenizer is None and inference.engine in ("oracle", "sglang_generate"):
        from polar_gym.assets import tokenizer_dir

        tokenizer = str(tokenizer_dir())  # the project's built Qwen tokenizer (a path the nodes share)
    for flag, value in (("--tokenizer", tokenizer), ("--upstream-model", inference.upstream_model),
                        ("--policy-version", inference.policy_version),
                        ("--max-tokens-cap", inference.max_tokens_cap)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def inference_command(settings: InferenceJobSettings, port: int) -> tuple[list[str], dict[str, str]]:
    """The server command for one inference job and the environment changes it needs."""
    if settings.kind == "tiny_vllm":
        from polar_gym.assets import vllm_server_command, vllm_server_env

        cmd = vllm_server_command(port, host="0.0.0.0") + settings.args
        base = vllm_server_env({})
        return cmd, {**base, **settings.env}
    if not settings.model_path:
        raise ValueError(f"inference_jobs.model_path is required for kind={settings.kind}")
    if settings.kind == "sglang":
        cmd = [settings.python, "-m", "sglang.launch_server", "--model-path", settings.model_path, "--host", "0.0.0.0",
               "--port", str(port), "--tp-size", str(max(settings.gpus_per_node, 1))]
    else:
        cmd = [settings.python, "-m", "vllm.entrypoints.openai.api_server", "--model", settings.model_path,
               "--host", "0.0.0.0", "--port", str(port), "--tensor-parallel-size", str(max(settings.gpus_per_node, 1))]
    return cmd + settings.args, dict(settings.env)


# -- inside the jobs ---------------------------------------------------------------------------------------------


def free_port() -> int:
    """A free TCP port on every interface of this node."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


def _write_info(path: Path, info: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)


def run_gateway_job(argv: list[str], advertise_host: str | None = None, server_token: str | None = None) -> None:
    """A gateway node until Slurm stops the job (SIGTERM: sessions are cancelled and torn down). The server's
    token travels in the environment, not on the command line other users can read."""
    from polar_gym.gateway.__main__ import main

    if server_token:
        os.environ["POLAR_SERVER_TOKEN"] = server_token
    host = advertise_host or socket.gethostname()
    main([*argv, "--port", str(free_port()), "--advertise-host", host])


def run_server_job(db: str, admin_token: str, info_path: str, advertise_host: str | None = None,
                   heartbeat: float = 2.0) -> None:
    """The rollout server until SIGTERM; writes ``{"url": ...}`` to ``info_path`` once it answers."""
    from polar_gym.launch.local import rollout_server

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        port = free_port()
        async with rollout_server(Path(db), "0.0.0.0", port, admin_token, heartbeat):
            _write_info(Path(info_path), {"url": f"http://{advertise_host or socket.gethostname()}:{port}",
                                          "job_id": os.environ.get("SLURM_JOB_ID")})
            await stop.wait()

    asyncio.run(serve())


def run_inference_job(settings: dict[str, Any], info_path: str, advertise_host: str | None = None) -> int:
    """An inference server as a child process; its URL goes to ``info_path`` once /health answers. SIGTERM (scancel,
    time limit) is passed to the server's process group."""
    config = InferenceJobSettings.model_validate(settings)
    port = config.port or free_port()
    cmd, env_changes = inference_command(config, port)
    env = {**os.environ, **env_changes}
    if config.kind == "tiny_vllm":
        env.pop("PYTHONPATH", None)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    deadline = time.monotonic() + config.ready_timeout_seconds
    url = f"http://127.0.0.1:{port}/health"
    while proc.poll() is None:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
            if resp.status == 200:
                _write_info(Path(info_path), {"url": f"http://{advertise_host or socket.gethostname()}:{port}",
                                              "job_id": os.environ.get("SLURM_JOB_ID")})
                break
        if time.monotonic() > deadline:
            forward(signal.SIGTERM, None)
            raise TimeoutError(f"{cmd[:4]} did not answer {url} within {config.ready_timeout_seconds:.0f} s")
        time.sleep(1.0)
    code = proc.wait()
    print(f"inference server exited with {code}", file=sys.stderr)
    return code
