"""Learning, proven (issue 36): a policy that gets better through the whole stack, against a control.

A forked demo task: the oracle plays the task's reference solution and a wrong variant that differs from it in one
token (demo-calc-add: ``return a + b`` against ``return a * b``) through the unmodified pi harness; datagen keeps
both (``sft_include_failures``); SFT of the tiny Qwen3 on the two leaves it near 50/50 between them, so imitation
alone cannot pass ~0.5 and only the reward can separate them. Then GRPO arms start from that checkpoint, each on a
fresh local fleet: the model itself, served by vLLM CPU in float32 in token-in mode, samples every session through
pi at temperature 1; the capture journal, prefix_merging, the test_on_output evaluator and the trainer close the loop,
and every step's weights are reloaded into the running engine. Arms: treatment seeds (real rewards) and a control
(``trainer.shuffle_rewards``: the same rewards permuted within the step).

Every step the trainer logs the noise-free evaluation: the exact log-probability of the right and the wrong answer
under the current weights (teacher-forced on the token ids the oracle's sessions captured), their share, greedy
success on held-out sessions (temperature 0 forced by the proxy), and the sampled success with its standard error.

    nice -n 10 .venv/bin/python benchmarks/bench_learning.py --out /tmp/bench-learning
    nice -n 10 .venv/bin/python benchmarks/bench_learning.py --task demo-inventory   # another task's fork
    nice -n 10 .venv/bin/python benchmarks/bench_learning.py --trainer trl           # TRL's GRPOTrainer (issue 38)

``--trainer trl`` runs the same arms with TRL's own ``GRPOTrainer`` fed by :mod:`polar_gym.bridges.trl` instead of
the reference trainer: the same sessions, SFT checkpoint, sampling, optimizer (SGD), learning rate, group size and
noise-free evaluation (a TRL callback scores the reference answers before the first step and after each one); the
control shuffles the evaluator's rewards within each step in the reward function TRL calls. No greedy sessions.

Writes under ``--out``: demo/ (oracle sessions, datagen export: the reference answers), sft/ (its checkpoint),
arm-NAME/trainer/train_metrics.jsonl (one row per step, step 0 = the SFT checkpoint), learning.svg (the arms on
one figure, with 95 % bands), summary.md (the acceptance lines and a per-step table) and acceptance.json. Exit 0
when every acceptance line holds, 1 when one does not.
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
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from polar_gym.assets import TINY_MODEL_NAME, vllm_server_command, vllm_server_env
from polar_gym.datagen.export import write_dataset
from polar_gym.fleet import InferenceSettings, local_fleet
from polar_gym.gateway.config import GatewayPools
from polar_gym.plots import arm_panels
from polar_gym.schema import SessionResult, TaskRequest
from polar_gym.server.client import RolloutClient
from polar_gym.tasks import DEMO_TASKS
from polar_gym.tasks.forks import Replacement, TaskFork, fork_requests
from polar_gym.trainer import TrainerSettings, bootstrap_diff, mean_se, run_grpo, run_sft
from polar_gym.trainer.step_eval import is_greedy, session_reward

#: a one-token (or nearly) wrong variant of each demo task's reference solution, whose tests then fail
DEFAULT_FORKS: dict[str, list[tuple[str, str]]] = {
    "demo-calc-add": [("return a + b", "return a * b")],
    "demo-slugify": [('"-".join', '"_".join')],
    "demo-stack-module": [('raise IndexError("pop', 'raise KeyError("pop')],
    "demo-inventory": [("unit_price * (1 - discount)", "unit_price * (1 + discount)")],
}
#: the acceptance's learning thresholds for a treatment arm: the share of the right answer at the last step, and how
#: far P(right) rose from the SFT checkpoint's (bench_async times how long each arm takes to reach both)
SHARE_RIGHT_MIN = 0.85
P_RIGHT_GAIN_MIN = 0.2
FIGURE_KEYS = ("eval/share_right", "eval/p_right", "reward_mean", "eval/greedy_success")
TABLE_KEYS = ("step", "eval/p_right", "eval/p_wrong", "eval/share_right", "reward_mean", "reward_se",
              "eval/greedy_success", "trained", "grad_norm", "audit/logprob_abs_diff_max", "seconds")


def _say(msg: str) -> None:
    print(f"[bench_learning {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def task_request(task: str, samples: int, timeout: float) -> TaskRequest:
    return DEMO_TASKS[task].to_request(harness="pi", model_name="policy", num_samples=samples,
                                       timeout_seconds=timeout)


async def oracle_demos(out: Path, task: str, replace: Sequence[tuple[str, str]], demos: int) -> Path:
    """Phase 1: the oracle plays the reference and the wrong variant (``demos`` sessions each) through pi;
    datagen keeps both (the wrong ones with reward 0). Refuses a fork whose variant does not fail or whose
    reference does not pass: such a fork cannot show anything."""
    fork = TaskFork(name="wrong", replace=[Replacement(old=old, new=new) for old, new in replace])
    requests = fork_requests([task_request(task, 2 * demos, 300.0)], [fork])
    async with (local_fleet(out, InferenceSettings(), pools=GatewayPools(run_slots=4)) as (url, token),
                RolloutClient(url, token) as client):
        await client.submit_all(requests)
        results = [r async for r in client.results([r.task_id for r in requests], timeout=900)]
    played = {(r.metadata.get("task_metadata", {}).get("oracle_variant"), session_reward(r)) for r in results}
    if played != {("reference", 1.0), ("wrong", 0.0)}:
        raise SystemExit(f"the fork of {task} does not separate: (variant, reward) played {sorted(played)}; the "
                         "reference must pass and the wrong variant fail")
    write_dataset(out / "datagen", results, requests, {"test_fraction": 0.0, "sft_include_failures": True})
    _say(f"oracle demos of {task}: reference reward 1, wrong reward 0 ({len(results)} sessions)")
    return out / "datagen" / "sft" / "train.jsonl"


def warm_start(args: argparse.Namespace, replace: Sequence[tuple[str, str]]) -> tuple[Path, Path]:
    """Phases 1-2 (the oracle's demos of the fork, SFT on both, then the anneal) under ``args.out``; returns the SFT
    checkpoint and the reference answers. Reads ``args.task``, ``demos``, ``sft_steps``, ``sft_lr``,
    ``sft_anneal_steps`` and ``threads`` (bench_async runs the same phases)."""
    references = asyncio.run(oracle_demos(args.out / "demo", args.task, replace, args.demos))
    sft = TrainerSettings(algorithm="sft", data=[str(references)], steps=args.sft_steps, batch_size=2 * args.demos,
                          learning_rate=args.sft_lr, threads=args.threads)
    checkpoint = run_sft(sft, args.out / "sft", echo=lambda m: None)
    if args.sft_anneal_steps:  # the same data at a tenth of the rate: the demos memorised with a margin
        anneal = sft.model_copy(update={"model": str(checkpoint), "steps": args.sft_anneal_steps,
                                        "learning_rate": args.sft_lr / 10})
        checkpoint = run_sft(anneal, args.out / "sft-anneal", echo=lambda m: None)
    return checkpoint, references


@dataclass
class Recorder:
    """The RolloutClient calls run_grpo makes, passed through; keeps the reward of every training session by step
    (the sampled success the acceptance's bootstrap reads)."""

    client: RolloutClient
    rewards: dict[int, list[float]] = field(default_factory=dict)
    step: int = 0

    async def submit(self, task: TaskRequest) -> dict[str, Any]:
        return await self.client.submit(task)

    async def results(self, task_ids: Iterable[str], *, timeout: float = 3600.0,
                      poll: float = 1.0) -> AsyncIterator[SessionResult]:
        self.step += 1
        async for result in self.client.results(task_ids, timeout=timeout, poll=poll):
            if not is_greedy(result):
                self.rewards.setdefault(self.step, []).append(session_reward(result))
            yield result


def start_vllm(model_dir: Path, port: int, log_path: Path, top_p: float) -> subprocess.Popen[bytes]:
    """vLLM CPU in fp32 with weight updates, sampling at temperature 1 and ``top_p`` unless a request says
    otherwise (pi sends neither)."""
    cmd = [*vllm_server_command(port, model_dir=model_dir, max_model_len=16384, dtype="float32",
                                weight_updates=True),
           "--override-generation-config", json.dumps({"temperature": 1.0, "top_p": top_p})]
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


@dataclass(frozen=True)
class Arm:
    name: str
    seed: int
    shuffle: bool


async def run_arm(args: argparse.Namespace, arm: Arm, sft: Path, references: Path, engine_url: str,
                  out: Path) -> tuple[list[dict[str, Any]], dict[int, list[float]]]:
    """One GRPO arm from the SFT checkpoint (reloaded into the engine as version 0) on a fleet of its own."""
    inference = InferenceSettings(engine="vllm", upstreams=[engine_url], upstream_model=TINY_MODEL_NAME,
                                  max_tokens_cap=args.max_tokens, prompt_mode="token_in")
    settings = TrainerSettings(algorithm="grpo", model=str(sft), steps=args.steps, learning_rate=args.lr,
                               optimizer=args.optimizer,
                               seed=arm.seed, shuffle_rewards=arm.shuffle, threads=args.threads, kl_coef=args.kl_coef,
                               reference_answers=[str(references)], greedy_samples=args.greedy)
    async with (local_fleet(out, inference, pools=GatewayPools(run_slots=args.slots)) as (url, token),
                RolloutClient(url, token) as client):
        await client.update_weights(str(sft), 0)
        recorder = Recorder(client)
        await run_grpo(settings, [task_request(args.task, args.samples, args.session_timeout)], recorder,
                       out / "trainer", weights=client, echo=lambda m: _say(f"{arm.name}: {m}"), timeout=3600)
    rows = [json.loads(x) for x in (out / "trainer" / "train_metrics.jsonl").read_text().splitlines() if x.strip()]
    return rows, recorder.rewards


def run_arm_trl(args: argparse.Namespace, arm: Arm, sft: Path, references: Path, engine_url: str,
                out: Path) -> tuple[list[dict[str, Any]], dict[int, list[float]]]:
    """One GRPO arm with TRL's GRPOTrainer from the SFT checkpoint, on a fleet of its own (the bridge pushes the
    SFT weights to the engine as version 0 before the first batch)."""
    return asyncio.run(_run_arm_trl(args, arm, sft, references, engine_url, out))


async def _run_arm_trl(args: argparse.Namespace, arm: Arm, sft: Path, references: Path, engine_url: str,
                       out: Path) -> tuple[list[dict[str, Any]], dict[int, list[float]]]:
    import random

    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from polar_gym.bridges.trl import PolarRollout, TRLBridgeSettings
    from polar_gym.trainer.policy import PAD_ID
    from polar_gym.trainer.step_eval import ReferenceScorer

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    rewards: dict[int, list[float]] = {}
    rows: dict[int, dict[str, Any]] = {}
    shuffle = random.Random(arm.seed)
    scorer = ReferenceScorer([str(references)], sft, PAD_ID)

    def reward(completions: list[Any], polar_reward: list[float | None], trainer_state: Any,
               **_: Any) -> list[float | None]:
        real = [r for r in polar_reward if r is not None]
        rewards.setdefault(int(trainer_state.global_step) + 1, []).extend(real)
        if not arm.shuffle:
            return list(polar_reward)
        permuted = iter(shuffle.sample(real, len(real)))  # the control: the step's rewards, permuted
        return [None if r is None else next(permuted) for r in polar_reward]

    class Evaluate(TrainerCallback):  # type: ignore[misc]
        """The noise-free evaluation before the first step and after each one, with TRL's logged loss."""

        def on_train_begin(self, args_: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            rows[0] = {"step": 0, **scorer(model)}

        def on_step_begin(self, args_: Any, state: Any, control: Any, **_: Any) -> None:
            self.started = time.monotonic()

        def on_step_end(self, args_: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            step = int(state.global_step)
            got = rewards.get(step, [])
            mean, se = mean_se(got) if got else (0.0, 0.0)
            rows[step] = {"step": step, **scorer(model), "reward_mean": mean, "reward_se": se, "trained": len(got),
                          "seconds": time.monotonic() - self.started}
            _say(f"{arm.name}: step {step} share_right {rows[step]['eval/share_right']:.3f} reward {mean:.2f}")

        def on_log(self, args_: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
            if logs and "grad_norm" in logs and int(state.global_step) in rows:
                rows[int(state.global_step)]["grad_norm"] = float(logs["grad_norm"])

    inference = InferenceSettings(engine="vllm", upstreams=[engine_url], upstream_model=TINY_MODEL_NAME,
                                  max_tokens_cap=args.max_tokens, prompt_mode="token_in")
    config = GRPOConfig(output_dir=str(out / "trl"), per_device_train_batch_size=args.samples,
                        num_generations=args.samples, max_steps=args.steps, learning_rate=args.lr,
                        optim="sgd", lr_scheduler_type="constant", max_grad_norm=1.0, beta=args.kl_coef,
                        temperature=1.0, top_p=args.top_p, use_cpu=True, bf16=False, seed=arm.seed,
                        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
                        model_init_kwargs={"dtype": torch.float32})
    task = task_request(args.task, 1, args.session_timeout)
    async with local_fleet(out, inference, pools=GatewayPools(run_slots=args.slots)) as (url, token):
        rollout = PolarRollout([task], TRLBridgeSettings(server_url=url, admin_token=token, keep_checkpoints=1))
        trainer = GRPOTrainer(model=str(sft), reward_funcs=reward, args=config, train_dataset=rollout.dataset(),
                              rollout_func=rollout, callbacks=[Evaluate()])
        await asyncio.to_thread(trainer.train)
    metrics = out / "trainer" / "train_metrics.jsonl"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    ordered = [rows[k] for k in sorted(rows)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in ordered))
    return ordered, rewards


@dataclass(frozen=True)
class Check:
    text: str
    passed: bool


def _at(rows: Sequence[Mapping[str, Any]], step: int, key: str) -> float:
    return float(next(r[key] for r in rows if r["step"] == step))


def acceptance(arms: Mapping[Arm, tuple[list[dict[str, Any]], dict[int, list[float]]]], last: int) -> list[Check]:
    """The issue's acceptance lines, at step ``last`` (10), each with the numbers it was decided on."""
    checks: list[Check] = []
    treatment = [a for a in arms if not a.shuffle]
    controls = [a for a in arms if a.shuffle]
    for arm in treatment:
        rows = arms[arm][0]
        share, p0, p1 = _at(rows, last, "eval/share_right"), _at(rows, 0, "eval/p_right"), _at(rows, last,
                                                                                                "eval/p_right")
        checks.append(Check(f"{arm.name}: share right at step {last} {share:.3f} >= {SHARE_RIGHT_MIN}",
                            share >= SHARE_RIGHT_MIN))
        checks.append(Check(f"{arm.name}: P(right) step 0 -> {last}: {p0:.3f} -> {p1:.3f}, up {p1 - p0:+.3f} "
                            f">= {P_RIGHT_GAIN_MIN}", p1 - p0 >= P_RIGHT_GAIN_MIN))
    late = [x for a in treatment for s in range(last - 2, last + 1) for x in arms[a][1].get(s, [])]
    early = [x for a in treatment for x in arms[a][1].get(1, [])]
    diff, low, high = bootstrap_diff(late, early, seed=0)
    checks.append(Check(f"treatment sampled success, steps {last - 2}-{last} minus step 1, pooled over seeds: "
                        f"{diff:+.3f} (95 % bootstrap [{low:+.3f}, {high:+.3f}]; n {len(late)} vs {len(early)}) "
                        ">= 0.2 and interval above 0", diff >= 0.2 and low > 0))
    for arm in controls:
        rows = arms[arm][0]
        p0, p1 = _at(rows, 0, "eval/p_right"), _at(rows, last, "eval/p_right")
        shares = [float(r["eval/share_right"]) for r in rows if r["step"] <= last]
        checks.append(Check(f"{arm.name}: P(right) at step {last} {p1:.3f} <= step 0 {p0:.3f} + 0.05",
                            p1 <= p0 + 0.05))
        checks.append(Check(f"{arm.name}: share right within [0.25, 0.75] at every step (min {min(shares):.3f}, "
                            f"max {max(shares):.3f})", all(0.25 <= s <= 0.75 for s in shares)))
        for t in treatment:
            gap = _at(arms[t][0], last, "eval/share_right") - _at(rows, last, "eval/share_right")
            checks.append(Check(f"{t.name} share minus {arm.name} share at step {last}: {gap:+.3f} >= 0.25",
                                gap >= 0.25))
    return checks


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value)


def summarize(out: Path, header: str, arms: Mapping[Arm, tuple[list[dict[str, Any]], dict[int, list[float]]]],
              checks: Sequence[Check]) -> None:
    (out / "learning.svg").write_text(arm_panels({a.name: rows for a, (rows, _) in arms.items()}, FIGURE_KEYS,
                                                 "GRPO through pi on vLLM fp32: a forked task, treatment vs control"))
    lines = [header, "", "## Acceptance", ""]
    lines += [f"- {'PASS' if c.passed else 'FAIL'}: {c.text}" for c in checks]
    for arm, (rows, _) in arms.items():
        lines += ["", f"## {arm.name} (seed {arm.seed}{', rewards shuffled' if arm.shuffle else ''})", "",
                  "| " + " | ".join(TABLE_KEYS) + " |", "|" + "---|" * len(TABLE_KEYS)]
        lines += ["| " + " | ".join(_cell(r.get(k)) for k in TABLE_KEYS) + " |" for r in rows]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (out / "acceptance.json").write_text(json.dumps([c.__dict__ for c in checks], indent=2) + "\n")
    print("\n".join(lines), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-learning"))
    parser.add_argument("--task", default="demo-calc-add", choices=sorted(DEMO_TASKS))
    parser.add_argument("--replace", nargs=2, action="append", metavar=("OLD", "NEW"),
                        help="the wrong variant: OLD -> NEW in the reference solution (repeatable; default: the "
                        "task's entry in DEFAULT_FORKS)")
    parser.add_argument("--demos", type=int, default=1, help="oracle sessions per variant")
    parser.add_argument("--sft-steps", type=int, default=120)
    parser.add_argument("--sft-lr", type=float, default=5e-3)
    parser.add_argument("--sft-anneal-steps", type=int, default=60, help="then this many SFT steps at a tenth of "
                        "the rate: at a constant 5e-3 the demos plateau at P(right) + P(wrong) ~0.75, after 60 steps "
                        "at 5e-4 ~0.97, and GRPO's updates then erode the rest of the answer far less")
    parser.add_argument("--sft-checkpoint", type=Path, help="skip phases 1-2: this SFT checkpoint (with --references)")
    parser.add_argument("--references", type=Path, help="the reference answers (phase 1's sft/train.jsonl)")
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps per arm")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd", help="trainer.optimizer: AdamW "
                        "gives a shuffled-reward control steps as large as the treatment's (its first step is lr x "
                        "sign(g) whatever |g|) and erodes the memorised answer; SGD's steps follow the gradient")
    parser.add_argument("--lr", type=float, default=0.3, help="GRPO learning rate (sgd ~0.3; adamw ~2e-4)")
    parser.add_argument("--samples", type=int, default=16, help="sessions per GRPO step (one group)")
    parser.add_argument("--greedy", type=int, default=1, help="greedy held-out sessions per step")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="treatment seeds")
    parser.add_argument("--control-seeds", type=int, nargs="*", default=[0], help="shuffled-reward control seeds")
    parser.add_argument("--top-p", type=float, default=0.95, help="the engine's nucleus sampling (temperature 1): "
                        "at 1.0 the tiny model's vocabulary tail (tokens of p < e^-6, one in ~4 sessions) gets sampled "
                        "and a rewarded tail session teaches it noise")
    parser.add_argument("--kl-coef", type=float, default=0.0, help="trainer.kl_coef")
    parser.add_argument("--slots", type=int, default=4, help="concurrent sessions")
    parser.add_argument("--max-tokens", type=int, default=256, help="the proxy's max_tokens cap per call")
    parser.add_argument("--session-timeout", type=float, default=240.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trainer", choices=["polar", "trl"], default="polar", help="the GRPO trainer: polar_gym's "
                        "reference trainer, or TRL's GRPOTrainer through polar_gym.bridges.trl (pip install "
                        "polar_gym[trl])")
    args = parser.parse_args()
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    replace = [tuple(pair) for pair in args.replace] if args.replace else DEFAULT_FORKS.get(args.task)
    if not replace:
        parser.error(f"no default fork for {args.task}: give --replace OLD NEW")
    if args.sft_checkpoint is None:
        checkpoint, references = warm_start(args, replace)
        _say(f"SFT done ({time.monotonic() - started:.0f} s)")
    else:
        if args.references is None:
            parser.error("--sft-checkpoint needs --references")
        checkpoint, references = args.sft_checkpoint, args.references
    arms = [*(Arm(f"treatment-seed{s}", s, False) for s in args.seeds),
            *(Arm(f"control-seed{s}", s, True) for s in args.control_seeds)]
    port = _free_port()
    proc = start_vllm(checkpoint, port, args.out / "vllm-server.log", args.top_p)
    done: dict[Arm, tuple[list[dict[str, Any]], dict[int, list[float]]]] = {}
    try:
        for arm in arms:
            if args.trainer == "trl":
                done[arm] = run_arm_trl(args, arm, checkpoint, references, f"http://127.0.0.1:{port}",
                                        args.out / f"arm-{arm.name}")
            else:
                done[arm] = asyncio.run(run_arm(args, arm, checkpoint, references, f"http://127.0.0.1:{port}",
                                                args.out / f"arm-{arm.name}"))
    finally:
        stop(proc)
    last = min(10, args.steps)
    checks = acceptance(done, last)
    header = (f"`{' '.join([Path(sys.executable).name, *sys.argv])}`: task {args.task}, fork "
              f"{'; '.join(f'{o!r} -> {n!r}' for o, n in replace)}; SFT {args.sft_steps} steps lr {args.sft_lr} + "
              f"{args.sft_anneal_steps} at {args.sft_lr / 10:g}; "
              f"{'TRL GRPOTrainer' if args.trainer == 'trl' else 'GRPO'} "
              f"{args.steps} steps x {args.samples} sessions {args.optimizer} lr {args.lr} kl {args.kl_coef}, "
              f"sampled at temperature 1 top_p {args.top_p}; wall "
              f"{(time.monotonic() - started) / 60:.1f} min")
    summarize(args.out, header, done, checks)
    return 0 if all(c.passed for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
