"""``+trainer=sft`` / ``+trainer=grpo``: the reference trainer run from a composed config.

SFT needs no fleet: it trains on ``trainer.data`` (datagen's exports). GRPO runs the job's tasks (``num_samples``
sessions per task: one group) on a local fleet each step, as ``launcher=local`` would, and pushes each step's
checkpoint to the fleet's engines through the rollout server's weight-update call. The engine is whatever
``inference`` names, but never the oracle: its scripted answers are not the policy's samples, so a GRPO run on it
"trains" on nothing (issue 36: reward 1.000 everywhere, 10.98 nats between trainer and "engine"). With
``inference=oracle`` (the default) the run serves the model being trained itself: ``python -m polar_gym.trainer
serve MODEL_DIR`` (vLLM CPU, fp32, weight reloads on) on a free loopback port for the run's length, log in
``out_dir/trainer/vllm-server.log``, and runs on it as ``inference=vllm`` would (:func:`policy_server`); without
vLLM's CPU build it refuses with the command that installs it.
Files go to ``out_dir/trainer/``: ``train_metrics.jsonl``, ``train_metrics.svg``, ``checkpoints/``; and
``out_dir/report.html`` (:mod:`polar_gym.report`): the training curves and, for GRPO, every step's sessions (also in
``out_dir/results.jsonl``, one line per session with its ``step``), written even when the loop stops on an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Coroutine, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape

from polar_gym.assets import TINY_MODEL_NAME, tiny_model_dir, vllm_python
from polar_gym.fleet import InferenceSettings, UpstreamCheckFailed, describe_inference, ensure_upstreams, local_fleet
from polar_gym.launch.config import LaunchJob
from polar_gym.launch.driver import fleet_in_flight, outcome_of, sigterm_cancels_run
from polar_gym.launch.local import LocalLauncher
from polar_gym.launch.outputs import REPORT, SessionOutcome, result_row, write_report
from polar_gym.merge.fidelity import run_fidelity
from polar_gym.private_files import open_private, private_dir, write_secret
from polar_gym.report.files import read_jsonl, train_keys_of
from polar_gym.runtime.processes import start_process
from polar_gym.schema import SessionResult, TaskRequest
from polar_gym.server.client import RolloutClient
from polar_gym.serving import free_port
from polar_gym.settings import ConfigError
from polar_gym.telemetry import MetricSinks
from polar_gym.trainer.loops import RolloutSource, RunControl, WeightSync, run_grpo, run_sft
from polar_gym.trainer.resume import newest_state

__all__ = ["SCRIPTED_ENGINE", "SETUP_ENGINE", "PolicyServer", "SessionRecorder", "policy_server", "served_inference",
           "started_policy_server", "train", "write_training_report"]

#: the engine GRPO never trains on (scripted answers, not samples of the policy)
SCRIPTED_ENGINE = "oracle"
#: what installs vLLM's CPU build and the tiny model
SETUP_ENGINE = "bash scripts/setup.sh --engine"


class SessionRecorder:
    """A RolloutSource that passes every call through and keeps each session it returns, with the step that
    sampled it (its request's ``metadata.rollout_step``, the GRPO round; else the count of ``results`` calls), so
    the run's report covers every step's sessions."""

    def __init__(self, source: RolloutSource) -> None:
        self.source = source
        self.requests: dict[str, TaskRequest] = {}
        self.sessions: list[tuple[int, SessionOutcome]] = []
        self.step = 0

    async def cancel(self, task_id: str) -> Any:
        """The source's cancel (groups an asynchronous run sampled ahead and will not train on), when it has one."""
        cancel = getattr(self.source, "cancel", None)
        return None if cancel is None else await cancel(task_id)

    async def submit(self, task: TaskRequest) -> dict[str, Any]:
        self.requests[task.task_id] = task
        return await self.source.submit(task)

    async def results(self, task_ids: Iterable[str], **kwargs: Any) -> AsyncIterator[SessionResult]:
        self.step += 1
        started = time.monotonic()
        async for result in self.source.results(task_ids, **kwargs):
            request = self.requests[result.task_id]
            step = request.metadata.rollout_step or self.step
            self.sessions.append((step, outcome_of(request, result, time.monotonic() - started)))
            yield result


def write_training_report(out_dir: Path, algorithm: str, sessions: list[tuple[int, SessionOutcome]],
                          wall: float, *, resumed: bool = False) -> Path:
    """report.html for a training run: train_metrics.jsonl's curves and the sessions of every step (written to
    results.jsonl too, so ``python -m polar_gym.report`` rebuilds the page). A resumed run keeps the rows of the
    earlier jobs' sessions (a session both saw, re-attached from the store, once: this job's row)."""
    rows = [{**result_row(o), "step": step} for step, o in sessions]
    if resumed:
        mine = {row["session_id"] for row in rows}
        rows = [r for r in read_jsonl(out_dir / "results.jsonl") if r.get("session_id") not in mine] + rows
    if rows:
        with open_private(out_dir / "results.jsonl") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    outcomes = [o for _, o in sessions]
    train_rows = read_jsonl(out_dir / "trainer" / "train_metrics.jsonl")
    return write_report(out_dir, outcomes, rows, run_fidelity(o.result.trajectory for o in outcomes),
                        wall=wall, title=algorithm.upper() + " training run", train_rows=train_rows,
                        train_keys=train_keys_of(train_rows))


@dataclass(frozen=True)
class PolicyServer:
    """The engine a ``+trainer=grpo`` run with ``inference=oracle`` starts on the model it trains: ``command``
    (``python -m polar_gym.trainer serve``: vLLM CPU, fp32, weight reloads on) on 127.0.0.1:``port``, its output
    in ``log``."""

    command: list[str]
    port: int
    model_dir: Path
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def notice(self) -> str:
        """What the console says before starting it: the run does not train on the engine it was given."""
        return (f"inference=oracle plays scripted answers, not the policy's samples: serving the model being trained "
                f"({self.model_dir}) with vLLM CPU fp32 for this run and training on it (inference=vllm "
                f"inference.upstreams=[{self.url}]; log {self.log})")


def _trained_model_dir(job: LaunchJob) -> Path:
    assert job.trainer is not None
    return Path(job.trainer.model) if job.trainer.model else tiny_model_dir()


def policy_server(job: LaunchJob, port: int | None = None) -> PolicyServer | None:
    """The policy server a GRPO job needs started, or None when its ``inference`` names a real engine. A ConfigError
    (exit 2) naming the commands to run when vLLM's CPU build or the model is missing: nothing is started then."""
    assert job.trainer is not None
    if job.trainer.algorithm != "grpo" or job.inference.engine != SCRIPTED_ENGINE:
        return None
    model = _trained_model_dir(job)
    manual = (f"or serve the model yourself: `python -m polar_gym.trainer serve {model} --port 8000`, then add "
              "`inference=vllm inference.upstreams=[http://127.0.0.1:8000] inference.upstream_model="
              f"{TINY_MODEL_NAME}`")
    why = ("+trainer=grpo needs an engine that samples from the policy being trained, and inference=oracle plays "
           "scripted answers (a run on it trains on nothing). The launch serves the model itself with vLLM's CPU "
           "build")
    if not vllm_python().exists():
        raise ConfigError(f"{why}, which is not installed ({vllm_python()} is missing): run `{SETUP_ENGINE}` "
                          f"(about 4 minutes, once); {manual}", key="inference")
    if not (model / "config.json").exists():
        hint = f"run `{SETUP_ENGINE}` (it builds the tiny model)" if not job.trainer.model else "fix trainer.model"
        raise ConfigError(f"{why}, but {model} is not a model directory (no config.json): {hint}",
                          key="trainer.model")
    port = port or free_port()
    command = [sys.executable, "-m", "polar_gym.trainer", "serve", str(model), "--port", str(port),
               "--dtype", job.trainer.engine_dtype]
    return PolicyServer(command, port, model, job.out_dir / "trainer" / "vllm-server.log")


def served_inference(inference: InferenceSettings, server: PolicyServer, policy_version: int) -> InferenceSettings:
    """``inference`` as a user's ``inference=vllm inference.upstreams=[URL]`` on the policy server: token_in (as
    ``conf/inference/vllm.yaml`` says; ``inference.prompt_mode=chat`` is kept) with ``inference.tokenizer``, else
    the built Qwen one, the served name sent upstream, the starting weights recorded as ``policy_version`` (so step
    1's traces carry a version too), no oracle options."""
    data = inference.model_dump()
    data.update(engine="vllm", upstreams=[server.url], await_upstreams=False, upstream_model=TINY_MODEL_NAME,
                oracle_script=None, drift_every=0, policy_version=policy_version,
                max_tokens_cap=inference.max_tokens_cap or 4096, preflight=True,
                prompt_mode=inference.prompt_mode or "token_in")
    return InferenceSettings.model_validate(data)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


async def _stop(proc: asyncio.subprocess.Process, grace: float = 20.0) -> None:
    """SIGTERM the server's process group (vLLM starts workers) at once, SIGKILL it after ``grace`` seconds or as
    soon as the leader is gone (no worker of the group lingers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), grace)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 10.0)


@contextlib.asynccontextmanager
async def started_policy_server(server: PolicyServer, console: Console, *, wait_seconds: float,
                                poll: float = 0.5) -> AsyncIterator[str]:
    """Run ``server.command`` in its own process group while the block runs; yields its URL once ``/health``
    answers 200, showing the seconds waited. Stopped with its group however the block ends (an error, Ctrl-C,
    SIGTERM through :func:`sigterm_cancels_run`). :class:`UpstreamCheckFailed` (exit 3) with the log's end when
    it exits or is not ready within ``wait_seconds``."""
    server.log.parent.mkdir(parents=True, exist_ok=True)
    with open_private(server.log) as log:
        log.write(" ".join(server.command) + "\n")
        log.flush()
        proc = await start_process(*server.command, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, cwd=str(server.log.parent), start_new_session=True)
    try:
        started = time.monotonic()
        dtype = server.command[server.command.index("--dtype") + 1] if "--dtype" in server.command else "float32"
        what = escape(f"starting the policy server (vLLM CPU, {dtype}) on {server.url}; log {server.log}")
        with console.status(what) as status:
            async with httpx.AsyncClient(timeout=2.0) as client:
                while True:
                    if proc.returncode is not None:
                        raise UpstreamCheckFailed(f"the policy server exited with {proc.returncode} before it was "
                                                  f"ready; log {server.log}:\n{_tail(server.log)}")
                    with contextlib.suppress(httpx.HTTPError):
                        if (await client.get(server.url + "/health")).status_code == 200:
                            break
                    waited = time.monotonic() - started
                    if waited > wait_seconds:
                        raise UpstreamCheckFailed(f"the policy server was not ready after {wait_seconds:.0f} s "
                                                  f"(inference.upstream_wait_seconds); log {server.log}:\n"
                                                  f"{_tail(server.log)}")
                    status.update(f"{what} ({waited:.0f} s)")
                    await asyncio.sleep(poll)
        console.print(escape(f"policy server ready on {server.url} after {time.monotonic() - started:.1f} s"),
                      highlight=False)
        yield server.url
    finally:
        await _stop(proc)


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
    return asyncio.run(_grpo(job, job.launcher, console, policy_server(job)))


def _sinks(job: LaunchJob) -> MetricSinks:
    """``logging.wandb`` / ``logging.tensorboard`` for the training metrics (``train/KEY`` at each step)."""
    assert job.trainer is not None
    return MetricSinks.open(job.logging, job.out_dir, job_type=job.trainer.algorithm,
                            config={"trainer": job.trainer.model_dump(mode="json"), "launch_id": job.launch_id})


async def _grpo(job: LaunchJob, launcher: LocalLauncher, console: Console, server: PolicyServer | None) -> int:
    assert job.trainer is not None
    settings, inference = job.trainer, job.inference
    if settings.push_weights and not issubclass(RolloutClient, WeightSync):
        raise ConfigError("this rollout server client has no update_weights (the fleet's weight-update call); "
                          "trainer.push_weights=false trains without updating the engines", key="trainer.push_weights")
    async with contextlib.AsyncExitStack() as stack:
        stack.enter_context(sigterm_cancels_run())
        if server is not None:
            console.print(f"[yellow]{escape(server.notice)}[/]", highlight=False)
            await stack.enter_async_context(started_policy_server(server, console,
                                                                  wait_seconds=inference.upstream_wait_seconds))
            inference = served_inference(inference, server, settings.initial_version)
        console.print(describe_inference(inference), markup=False, highlight=False, soft_wrap=True)
        if not inference.await_upstreams:
            await ensure_upstreams(inference, inference.upstreams, console)
        # a resumed run: the store's queued sessions start at once, and sample only after the trainer's first push
        resuming = job.resume and newest_state(job.out_dir / "trainer" / "checkpoints") is not None
        if inference.policy_version is None and not resuming:  # the engines serve the starting weights
            inference = inference.model_copy(update={"policy_version": settings.initial_version})
        async with (local_fleet(job.out_dir, inference, host=launcher.settings.host,
                                gateway_port=launcher.settings.port, server_port=launcher.settings.server_port,
                                heartbeat=launcher.settings.heartbeat_seconds, pools=launcher.pools,
                                telemetry=job.telemetry, state_dir=job.state_dir,
                                hold_model_calls=resuming and settings.push_weights) as (url, token),
                    RolloutClient(url, token) as client):
            weights = client if isinstance(client, WeightSync) else None
            recorder, started, control = SessionRecorder(client), time.monotonic(), RunControl()
            try:
                with _sinks(job) as sinks:
                    final = await _handing_over(job, client, control, run_grpo(
                        settings, job.requests, recorder, job.out_dir / "trainer", weights=weights,
                        echo=console.print, timeout=max(r.timeout_seconds for r in job.requests) * 2, sinks=sinks,
                        resume=job.resume, control=control))
            finally:
                write_training_report(job.out_dir, "grpo", recorder.sessions, time.monotonic() - started,
                                      resumed=job.resume)
    if not control.handed_over:
        console.print(f"grpo: last checkpoint {final}; metrics {job.out_dir / 'trainer' / 'train_metrics.jsonl'}; "
                      f"report {job.out_dir / REPORT}")
    return 0


async def _handing_over(job: LaunchJob, client: RolloutClient, control: RunControl,
                        training: Coroutine[Any, Any, Path]) -> Path:
    """Run ``training``; with a relay (a run in a Slurm job with a time limit) watch the time left: once the relay
    has drained the fleet and submitted the successor job (``job.handover``), the run starts no further step; a
    step whose groups have not all come in within a grace (results on their way from the drained fleet; at most
    10 s, and 10 s before the limit) is left to the successor. Its state is saved for the successor
    (:mod:`polar_gym.trainer.resume`). A hand-over that fails stops the run."""
    assert job.trainer is not None
    if job.relay is None:
        return await training
    steps, relay = job.trainer.steps, job.relay

    def grace() -> float:
        """How long results on their way from the drained fleet may take: at most 10 s, and 10 s before the limit."""
        return max(0.0, min(10.0, relay.left() - 10.0))

    async def unfinished() -> int:
        """Steps left for a successor. The last step, once its groups are in (within the grace), trains, saves and
        pushes without the fleet: wait for it while the job has time, so a run that ends in this job submits no
        successor that would only resume after its last step (one more job's start-up for nothing)."""
        if control.last_step == steps - 1 and await control.collected(steps, grace()):
            await asyncio.wait({work}, timeout=max(0.0, relay.left() - 10.0))
        return steps - control.last_step

    work = asyncio.ensure_future(training)
    watch = asyncio.ensure_future(relay.watch(client, functools.partial(fleet_in_flight, client), unfinished))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            job.handover = await watch
            if job.handover is not None:
                control.stop.set()
                await asyncio.wait({work}, timeout=grace())
                control.abandon.set()
        return await work
    finally:
        for future in (work, watch):
            future.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
