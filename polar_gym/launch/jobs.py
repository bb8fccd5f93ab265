"""What runs inside the Slurm jobs ``launcher=slurm`` submits (through submitit): a gateway node, the rollout server
and an inference server. Each is a plain function of picklable arguments; each announces where it listens by
registering (gateways) or by writing a small JSON file next to the run's outputs (server, inference), so the launcher
needs no fixed ports. Pure command construction lives here too, so tests read it without Slurm."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from polar_gym.fleet.settings import InferenceSettings
from polar_gym.gateway.config import GatewayPools
from polar_gym.proxy.settings import ENGINES_WITH_TOKENIZER, configured_prompt_mode
from polar_gym.serving import free_port
from polar_gym.telemetry import TelemetrySettings

__all__ = ["GatewayJobSettings", "InferenceJobSettings", "advertised_host", "gateway_argv", "gateway_workdir",
           "inference_command", "node_port", "node_workdir", "run_gateway_job", "run_inference_job", "run_server_job",
           "telemetry_argv"]


class GatewayJobSettings(GatewayPools):
    """One gateway job's Slurm resources and its pools (defaults: the gateway's own)."""

    cpus_per_task: int = Field(default=8, ge=1, description="CPUs of the gateway job")
    mem_gb: float = Field(default=16, gt=0, description="memory of the gateway job, in GB")
    timeout_min: int = Field(default=1440, ge=1, description="the gateway job's time limit, in minutes")
    workdir: str | None = Field(default=None, description="the job's working dir (session dirs, capture journal), "
                                "made on the node: a template with {job_id}, {index} and environment variables, "
                                "e.g. '$TMPDIR/polar-{job_id}' for node-local scratch; null: "
                                "OUT_DIR/gateways/gateway-{index}")
    keep_workdir: bool = Field(default=False, description="keep a templated workdir when the job ends (default: "
                               "removed; OUT_DIR/gateways is always kept)")


class InferenceJobSettings(BaseModel):
    """Inference servers started as Slurm jobs (SGLang on GPU nodes; ``tiny_vllm`` is the project's tiny Qwen3 on
    vLLM's CPU build, for trying the path without GPUs). Their URLs become the gateways' upstreams."""

    model_config = ConfigDict(extra="forbid")

    count: int = Field(default=0, ge=0, description="inference jobs to start (0: use inference.upstreams as they "
                       "are)")
    kind: Literal["sglang", "vllm", "tiny_vllm"] = Field(default="sglang", description="sglang, vllm, or tiny_vllm "
                                                         "(the project's tiny Qwen3 on vLLM's CPU build, to try "
                                                         "the path without GPUs)")
    python: str = Field(default="python3", description="the interpreter with sglang / vllm installed (not used "
                        "by tiny_vllm)")
    model_path: str | None = Field(default=None, description="the model to serve (required for sglang and vllm)")
    port: int = Field(default=0, ge=0, description="the server's port (0: a free port picked on the node)")
    args: list[str] = Field(default_factory=list, description="extra arguments of the server command")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of the server")
    dtype: str = Field(default="bfloat16", description="tiny_vllm's --dtype (float32 for a training loop: its "
                       "logprobs then match a float32 trainer's)")
    weight_updates: bool = Field(default=False, description="tiny_vllm: VLLM_SERVER_DEV_MODE=1, so weight updates "
                                 "(POST /backends/weights) reload it in place")
    gpus_per_node: int = Field(default=1, ge=0, description="GPUs per inference job (also its tensor parallelism)")
    cpus_per_task: int = Field(default=16, ge=1, description="CPUs per inference job")
    mem_gb: float = Field(default=128, gt=0, description="memory per inference job, in GB")
    timeout_min: int = Field(default=1440, ge=1, description="an inference job's time limit, in minutes")
    ready_timeout_seconds: float = Field(default=1800, gt=0, description="how long a server may take to answer "
                                         "/health")


def gateway_argv(inference: InferenceSettings, pools: GatewayJobSettings, upstreams: list[str], *,
                 server_url: str, workdir: Path, heartbeat: float,
                 telemetry: TelemetrySettings | None = None) -> list[str]:
    """``python -m polar_gym.gateway`` arguments for a gateway job (port and advertised host are added on the node).
    The engine comes from the ``inference`` group; ``upstreams`` are its URLs plus those of inference jobs;
    ``telemetry`` the launch's span settings."""
    argv = ["--engine", inference.engine, "--host", "0.0.0.0", "--workdir", str(workdir),
            "--capture-dir", str(workdir / "capture"), "--server-url", server_url, "--heartbeat", str(heartbeat),
            "--run-slots", str(pools.run_slots), "--init-workers", str(pools.init_workers),
            "--ready-buffer", str(pools.ready_buffer), "--postrun-workers", str(pools.postrun_workers),
            "--prewarm-workers", str(pools.prewarm_workers), "--postrun-grace", str(pools.postrun_grace_seconds),
            "--pool-sizing", pools.pool_sizing,
            "--upstream-timeout", str(inference.upstream_timeout), "--drift-every", str(inference.drift_every)]
    if pools.max_runtimes is not None:
        argv += ["--max-runtimes", str(pools.max_runtimes)]
    for key, value in pools.runtime_options.items():
        argv += ["--runtime-option", f"{key}={json.dumps(value)}"]
    for root in pools.expose_roots:
        argv += ["--expose-root", str(root)]
    if upstreams:
        argv += ["--upstream", *upstreams]
    if inference.await_upstreams:
        argv.append("--await-upstreams")
    if inference.prompt_mode is not None:
        argv += ["--prompt-mode", inference.prompt_mode]
    if inference.parser is not None:
        argv += ["--parser", inference.parser]
    tokenizer = inference.tokenizer
    if tokenizer is None and (inference.engine in ENGINES_WITH_TOKENIZER
                              or configured_prompt_mode(inference) == "token_in"):
        from polar_gym.assets import tokenizer_dir

        # the project's built Qwen tokenizer (a path the nodes share), named: the node renders with the very
        # tokenizer the launch resolved, not whatever its own cache holds
        tokenizer = str(tokenizer_dir())
    if telemetry is not None and telemetry.enabled:
        argv += telemetry_argv(telemetry)
    for flag, value in (("--tokenizer", tokenizer), ("--oracle-script", inference.oracle_script),
                        ("--upstream-model", inference.upstream_model),
                        ("--policy-version", inference.policy_version),
                        ("--max-tokens-cap", inference.max_tokens_cap)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def telemetry_argv(telemetry: TelemetrySettings) -> list[str]:
    """The gateway flags of the ``telemetry`` settings (``python -m polar_gym.gateway --help``)."""
    argv = ["--telemetry-service-name", telemetry.service_name,
            "--telemetry-timeout", str(telemetry.export_timeout_seconds)]
    if telemetry.otlp_endpoint:
        argv += ["--otlp-endpoint", telemetry.otlp_endpoint]
    if telemetry.file:
        argv += ["--telemetry-file", telemetry.file]
    for key, value in telemetry.resource.items():
        argv += ["--telemetry-resource", f"{key}={value}"]
    return argv


def inference_command(settings: InferenceJobSettings, port: int) -> tuple[list[str], dict[str, str]]:
    """The server command for one inference job and the environment changes it needs."""
    if settings.kind == "tiny_vllm":
        from polar_gym.assets import vllm_server_command, vllm_server_env

        cmd = vllm_server_command(port, host="0.0.0.0", dtype=settings.dtype,
                                  weight_updates=settings.weight_updates) + settings.args
        base = vllm_server_env({}, weight_updates=settings.weight_updates)
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


def gateway_workdir(pools: GatewayJobSettings, out_dir: Path, index: str) -> tuple[Path, dict[str, Any] | None]:
    """The working dir a gateway job is started with, and its node-side scratch settings (None: the default
    OUT_DIR/gateways/gateway-INDEX, which the job uses as it is). A template is resolved on the node by
    :func:`node_workdir`; the argv carries a placeholder path until then."""
    if pools.workdir is None:
        return out_dir / "gateways" / f"gateway-{index}", None
    return Path(_WORKDIR_PLACEHOLDER), {"template": pools.workdir, "index": index, "keep": pools.keep_workdir}


_WORKDIR_PLACEHOLDER = "/polar-gateway-workdir-resolved-on-the-node"
_VAR = re.compile(r"\$(?:(\w+)|\{(\w+)\})")


def node_workdir(template: str, index: str, env: dict[str, str] | None = None) -> Path:
    """A workdir template resolved on the node: ``{job_id}`` (SLURM_JOB_ID, else ``local-PID``), ``{index}``, then
    ``$VARS`` and ``~``. An environment variable the node does not set is an error (a literal ``$TMPDIR`` directory
    would be made in the job's current dir)."""
    env = dict(os.environ if env is None else env)
    job_id = env.get("SLURM_JOB_ID") or f"local-{os.getpid()}"
    text = template.replace("{job_id}", job_id).replace("{index}", index)
    missing = [m.group(1) or m.group(2) for m in _VAR.finditer(text) if (m.group(1) or m.group(2)) not in env]
    if missing:
        raise ValueError(f"launcher.gateway.workdir={template!r} names {', '.join(missing)}, which this node does "
                         "not set")
    expanded = _VAR.sub(lambda m: env[m.group(1) or m.group(2)], text)
    if expanded.startswith("~"):
        expanded = os.path.expanduser(expanded)
    if not os.path.isabs(expanded):
        raise ValueError(f"launcher.gateway.workdir={template!r}: {expanded!r} is not an absolute path")
    return Path(expanded)


def _with_workdir(argv: list[str], workdir: Path) -> list[str]:
    """``argv`` with the placeholder workdir (and its capture dir) replaced by the resolved one."""
    return [arg.replace(_WORKDIR_PLACEHOLDER, str(workdir)) for arg in argv]


def node_port() -> int:
    """A free TCP port on every interface of this node."""
    return free_port("0.0.0.0")


def advertised_host(pattern: str | None, hostname: str | None = None) -> str:
    """The name this node's service is reached by: the node's host name, or ``pattern`` with ``{host}`` replaced by
    it (``{host}-ib`` for a fabric's interface). A pattern without ``{host}`` is the same on every node: only right
    when everything runs on one node."""
    host = hostname or socket.gethostname()
    return pattern.replace("{host}", host) if pattern else host


def _write_info(path: Path, info: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)


def run_gateway_job(argv: list[str], advertise_host: str | None = None, server_token: str | None = None,
                    scratch: dict[str, Any] | None = None) -> None:
    """A gateway node until Slurm stops the job (SIGTERM: sessions are cancelled and torn down). The server's
    token travels in the environment, not on the command line other users can read. ``scratch`` (from
    :func:`gateway_workdir`): the workdir is made here, on the node, mode 0700, and removed when the gateway
    stops unless ``keep``; results reach the launcher through the rollout server, never through this dir."""
    from polar_gym.gateway.cli import main

    if server_token:
        os.environ["POLAR_SERVER_TOKEN"] = server_token
    host = advertised_host(advertise_host)
    workdir, keep = None, bool(scratch and scratch.get("keep"))
    # a job cancelled while the gateway still starts (submitit passes SIGTERM by, then Slurm SIGKILLs after
    # KillWait) would leave its workdir on the node: until the gateway's own handlers are in, SIGTERM ends the
    # job through the ``finally`` below
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if scratch is not None:
        workdir = node_workdir(str(scratch["template"]), str(scratch["index"]))
        workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        argv = _with_workdir(argv, workdir)
        print(f"gateway workdir: {workdir} ({'kept' if keep else 'removed'} when the job ends)",
              file=sys.stderr, flush=True)
    try:
        main([*argv, "--port", str(node_port()), "--advertise-host", host])
    finally:
        if workdir is not None and not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_server_job(db: str, admin_token: str, info_path: str, advertise_host: str | None = None,
                   heartbeat: float = 2.0, workers: int = 1) -> None:
    """The rollout server (``workers`` of them on a private PostgreSQL, see polar_gym.fleet.server_workers) until
    SIGTERM; writes ``{"url": ..., "urls": [...]}`` to ``info_path`` once they answer."""
    from polar_gym.fleet import rollout_servers

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        ports = [node_port() for _ in range(workers)]
        async with rollout_servers(Path(db), "0.0.0.0", ports, admin_token, heartbeat):
            urls = [f"http://{advertised_host(advertise_host)}:{port}" for port in ports]
            _write_info(Path(info_path), {"url": urls[0], "urls": urls, "job_id": os.environ.get("SLURM_JOB_ID")})
            await stop.wait()

    asyncio.run(serve())


def run_inference_job(settings: dict[str, Any], info_path: str, advertise_host: str | None = None) -> int:
    """An inference server as a child process; its URL goes to ``info_path`` once /health answers. SIGTERM (scancel,
    time limit) is passed to the server's process group."""
    config = InferenceJobSettings.model_validate(settings)
    port = config.port or node_port()
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
                _write_info(Path(info_path), {"url": f"http://{advertised_host(advertise_host)}:{port}",
                                              "job_id": os.environ.get("SLURM_JOB_ID")})
                break
        if time.monotonic() > deadline:
            forward(signal.SIGTERM, None)
            raise TimeoutError(f"{cmd[:4]} did not answer {url} within {config.ready_timeout_seconds:.0f} s")
        time.sleep(1.0)
    code = proc.wait()
    print(f"inference server exited with {code}", file=sys.stderr)
    return code
