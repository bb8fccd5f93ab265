"""Does the loop learn? (issue 14) SFT of the tiny Qwen3 on oracle demo trajectories, then GRPO steps in which the
model itself, served by vLLM CPU in float32, solves demo tasks through the unmodified pi harness, sampled at
temperature 1, with the new weights reloaded into the running engine after every step.

The oracle only writes the SFT demos (phase 1). Every GRPO rollout is sampled by the policy on vLLM. pi sends no
temperature and the tiny model's generation_config.json sets none, so vLLM would sample at its default, 1.0; the
engine is also started with ``--override-generation-config {"temperature": 1.0, "top_p": 1.0}`` so that default is
explicit, and the summary counts the temperatures the harness's requests carried (from the capture journal).

    nice -n 10 .venv/bin/python benchmarks/bench_learning.py --out /tmp/bench-learning

Writes under ``--out``: demo/ (oracle sessions, datagen export), sft/ (train_metrics.jsonl, checkpoint),
grpo/trainer/train_metrics.jsonl (one row per GRPO step: reward, loss, versions, the audit's mismatch metrics),
reward_curve.svg (the trainer's plot writer), samples.jsonl (what the model sampled, one session per task and step),
summary.md (the per-step table).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import httpx

from polar_gym.assets import TINY_MODEL_NAME, vllm_server_command, vllm_server_env
from polar_gym.datagen.export import write_dataset
from polar_gym.fleet import InferenceSettings, local_fleet
from polar_gym.gateway.config import GatewayPools
from polar_gym.schema import SessionResult, TaskRequest
from polar_gym.server.client import RolloutClient
from polar_gym.tasks import DEMO_TASKS
from polar_gym.trainer import TrainerSettings, run_grpo, run_sft
from polar_gym.trainer.metrics import svg_plot

COLUMNS = ("step", "version", "sessions", "errored", "reward_mean", "reward_std", "tokens", "loss",
           "audit/logprob_abs_diff_max", "rollout_seconds", "train_seconds", "push_seconds")


def _say(msg: str) -> None:
    print(f"[bench_learning {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _requests(tasks: list[str], samples: int, timeout: float) -> list[TaskRequest]:
    return [DEMO_TASKS[name].to_request(harness="pi", model_name="policy", num_samples=samples)
            .model_copy(update={"timeout_seconds": timeout}) for name in tasks]


async def oracle_demos(out: Path, tasks: list[str], samples: int) -> Path:
    """Phase 1: the oracle plays the reference solutions through pi; datagen exports them as SFT records."""
    requests = _requests(tasks, samples, 300.0)
    async with (local_fleet(out, InferenceSettings(), pools=GatewayPools(run_slots=4)) as (url, token),
                RolloutClient(url, token) as client):
        await client.submit_all(requests)
        results = [r async for r in client.results([r.task_id for r in requests], timeout=900)]
    summary = write_dataset(out / "datagen", results, requests, {"test_fraction": 0.0})
    _say(f"oracle demos: {summary.sft_records['train']} SFT records, rewards "
         f"{[r.evaluation.reward if r.evaluation else None for r in results]}")
    return out / "datagen" / "sft" / "train.jsonl"


class Recorder:
    """The RolloutClient calls run_grpo makes, passed through; keeps every step's results for samples.jsonl."""

    def __init__(self, client: RolloutClient, tokenizer: Any, path: Path) -> None:
        self.client, self.tokenizer, self.path = client, tokenizer, path
        self.step = 0
        path.write_text("", encoding="utf-8")

    async def submit(self, task: TaskRequest) -> dict[str, Any]:
        return await self.client.submit(task)

    async def results(self, task_ids: Iterable[str], *, timeout: float = 3600.0,
                      poll: float = 1.0) -> AsyncIterator[SessionResult]:
        self.step += 1
        seen: set[str] = set()
        async for result in self.client.results(task_ids, timeout=timeout, poll=poll):
            self._sample(result, seen)
            yield result

    def _sample(self, result: SessionResult, seen: set[str]) -> None:
        reward = result.evaluation.reward if result.evaluation else None
        first = result.task_id not in seen or bool(reward)
        seen.add(result.task_id)
        if not first or result.trajectory is None:
            return
        turns = [self.tokenizer.decode([t for t, m in zip(tr.response_ids, tr.loss_mask, strict=True) if m])
                 for tr in result.trajectory.traces]
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": self.step, "task_id": result.task_id, "status": str(result.status),
                                "reward": reward, "turns": [t[:600] for t in turns]}) + "\n")


def start_vllm(model_dir: Path, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    cmd = [*vllm_server_command(port, model_dir=model_dir, max_model_len=16384,
                                                    dtype="float32", weight_updates=True),
           "--override-generation-config", json.dumps({"temperature": 1.0, "top_p": 1.0})]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=vllm_server_env(weight_updates=True), cwd=str(log_path.parent),
                                start_new_session=True)
    started = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}; see {log_path}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                _say(f"vLLM fp32 ready on :{port} after {time.monotonic() - started:.0f} s")
                return proc
        if time.monotonic() - started > 600:
            raise RuntimeError(f"vLLM not ready after 600 s; see {log_path}")
        time.sleep(1.0)


def stop(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=20)
            return
        except subprocess.TimeoutExpired:
            continue


async def grpo(args: argparse.Namespace, sft_checkpoint: Path, engine_url: str, out: Path) -> Path:
    """Phase 3: GRPO through pi on vLLM fp32 serving the SFT checkpoint (policy version 0)."""
    from transformers import AutoTokenizer

    inference = InferenceSettings(engine="vllm", upstreams=[engine_url], upstream_model=TINY_MODEL_NAME,
                                  max_tokens_cap=args.max_tokens)
    settings = TrainerSettings(algorithm="grpo", model=str(sft_checkpoint), steps=args.grpo_steps,
                               learning_rate=args.grpo_lr, initial_version=0, threads=args.threads)
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(sft_checkpoint))
    async with (local_fleet(out, inference, pools=GatewayPools(run_slots=args.slots)) as (url, token),
                RolloutClient(url, token) as client):
        # the SFT checkpoint as policy version 0 (a running engine loads it; one started on it only gets the tag)
        await client.update_weights(str(sft_checkpoint), 0)
        recorder = Recorder(client, tokenizer, out / "samples.jsonl")
        await run_grpo(settings, _requests(args.tasks, args.samples, args.session_timeout), recorder,
                       out / "trainer", weights=client, echo=_say, timeout=3600)
    return out / "trainer" / "train_metrics.jsonl"


def request_temperatures(capture: Path) -> dict[str, int]:
    """How many captured calls carried which ``temperature`` (``unset``: the engine's default applies)."""
    from polar_gym.journal import read_session

    counts: dict[str, int] = {}
    for attempt in capture.glob("*/attempts/*"):
        for record in read_session(attempt):
            key = str(record.request.get("temperature", "unset"))
            counts[key] = counts.get(key, 0) + 1
    return counts


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return "" if value is None else str(value)


def summarize(metrics: Path, out: Path, header: str) -> None:
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    (out / "reward_curve.svg").write_text(svg_plot(rows, ["reward_mean", "audit/logprob_abs_diff_max"],
                                                   "GRPO through pi on vLLM fp32: reward mean per step"))
    lines = [header, "", "| " + " | ".join(COLUMNS) + " | sampled by |", "|" + "---|" * (len(COLUMNS) + 1)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in COLUMNS) + f" | {_cell(r.get('sampled_versions'))} |"
              for r in rows]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-learning"))
    parser.add_argument("--tasks", nargs="+", default=["demo-calc-add"], choices=sorted(DEMO_TASKS))
    parser.add_argument("--demos", type=int, default=2, help="oracle sessions per task for SFT")
    parser.add_argument("--sft-steps", type=int, default=120)
    parser.add_argument("--sft-lr", type=float, default=3e-3)
    parser.add_argument("--sft-batch", type=int, default=2)
    parser.add_argument("--sft-from", type=Path, help="SFT starts from this checkpoint (default: the stock tiny "
                        "model) to continue an earlier SFT run")
    parser.add_argument("--sft-data", type=Path, help="skip phase 1: SFT on this datagen sft/train.jsonl")
    parser.add_argument("--sft-save-every", type=int, default=0, help="also keep SFT checkpoints every N steps")
    parser.add_argument("--sft-checkpoint", type=Path, help="skip phases 1-2: start GRPO from this checkpoint")
    parser.add_argument("--sft-only", action="store_true", help="stop after SFT")
    parser.add_argument("--engine-url", help="use this running fp32 vLLM with weight updates (python -m "
                        "polar_gym.trainer serve) instead of starting one")
    parser.add_argument("--grpo-steps", type=int, default=10)
    parser.add_argument("--grpo-lr", type=float, default=1e-4)
    parser.add_argument("--samples", type=int, default=4, help="sessions per task per GRPO step (one group)")
    parser.add_argument("--slots", type=int, default=4, help="concurrent sessions")
    parser.add_argument("--max-tokens", type=int, default=256, help="the proxy's max_tokens cap per call")
    parser.add_argument("--session-timeout", type=float, default=240.0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sft_checkpoint is None:
        data = args.sft_data or asyncio.run(oracle_demos(args.out / "demo", args.tasks, args.demos))
        _say(f"phase 1 done ({time.monotonic() - started:.0f} s)")
        sft = TrainerSettings(algorithm="sft", model=str(args.sft_from) if args.sft_from else None, data=[str(data)],
                              steps=args.sft_steps, batch_size=args.sft_batch,
                              learning_rate=args.sft_lr, threads=args.threads,
                              save_every=args.sft_save_every)
        checkpoint = run_sft(sft, args.out / "sft", echo=_say)
        _say(f"phase 2 (SFT) done ({time.monotonic() - started:.0f} s)")
        if args.sft_only:
            return 0
    else:
        checkpoint = args.sft_checkpoint
    (args.out / "grpo").mkdir(parents=True, exist_ok=True)
    if args.engine_url:
        metrics = asyncio.run(grpo(args, checkpoint, args.engine_url, args.out / "grpo"))
    else:
        port = _free_port()
        proc = start_vllm(checkpoint, port, args.out / "grpo" / "vllm-server.log")
        try:
            metrics = asyncio.run(grpo(args, checkpoint, f"http://127.0.0.1:{port}", args.out / "grpo"))
        finally:
            stop(proc)
    wall = time.monotonic() - started
    temperatures = request_temperatures(args.out / "grpo" / "capture")
    sft_note = (f"SFT {args.sft_steps} steps lr {args.sft_lr} batch {args.sft_batch} on {args.demos} oracle demos/task"
                if args.sft_checkpoint is None else f"GRPO from the SFT checkpoint {args.sft_checkpoint}")
    header = (f"`{' '.join([Path(sys.executable).name, *sys.argv])}`: tasks {', '.join(args.tasks)}; "
              f"{sft_note}; GRPO {args.grpo_steps} steps x {args.samples} "
              f"sessions/task lr {args.grpo_lr}; wall {wall / 60:.1f} min; temperature in the harness's "
              f"requests: {temperatures} (engine default forced to 1.0)")
    summarize(metrics, args.out, header)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
