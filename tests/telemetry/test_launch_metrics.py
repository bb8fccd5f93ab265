"""Issue 15: W&B (offline: no network, no login) and TensorBoard files written by real runs and read back with the
tools' own formats: a launch's per-session series (step = the session's line in results.jsonl) and totals match
results.jsonl; an SFT run's series matches train_metrics.jsonl row by row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.telemetry._readers import tensorboard_scalars, wandb_history, wandb_run_dir, wandb_summary
from tests.telemetry.test_launch_spans import launch, results_of
from tests.trainer._tiny import small_qwen3_dir
from tests.trainer.test_sft import MESSAGES

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_a_launch_writes_its_sessions_and_totals_to_wandb_offline_and_tensorboard(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = launch("num_samples=2", "tasks.ids=[demo-calc-add,demo-slugify]", "logging.wandb.enabled=true",
                  "logging.wandb.mode=offline", "logging.tensorboard.enabled=true", out=out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "wandb:" not in proc.stdout + proc.stderr  # W&B's console chatter is silenced
    run_dir = wandb_run_dir(out)
    assert f"metrics: W&B offline run {run_dir} (`wandb sync {run_dir}` uploads it)" in proc.stdout
    assert f"metrics: TensorBoard event files in {out / 'tensorboard'}" in proc.stdout
    results = results_of(out)
    rewards = [r["evaluation"]["reward"] for r in results]
    mean = sum(rewards) / len(rewards)

    history = wandb_history(wandb_run_dir(out))
    assert [row["_step"] for row in history] == list(range(len(results)))
    assert [row["session/reward"] for row in history] == rewards
    assert [row["session/completions"] for row in history] == [r["completions"] for r in results]
    assert [row["session/traces"] for row in history] == [r["traces"] for r in results]
    assert [row["session/seconds"] for row in history] == pytest.approx([r["seconds"] for r in results], abs=1e-3)
    assert [row["session/timings/run"] for row in history] == [r["timings"]["run"] for r in results]
    assert [row["session/fidelity/trainable_tokens"] for row in history] == [
        r["trajectory_diagnostics"]["trainable_tokens"] for r in results]
    summary = wandb_summary(wandb_run_dir(out))
    assert summary["run/sessions"] == len(results) == 4
    assert summary["run/completed"] == 4 and summary["run/errored"] == 0
    assert summary["run/mean_reward"] == pytest.approx(mean)
    assert summary["run/completions"] == sum(r["completions"] for r in results)
    assert summary["run/traces"] == sum(r["traces"] for r in results)
    trainable = sum(sum(t["loss_mask"]) for t in map(json.loads, (out / "trajectories.jsonl").read_text().splitlines()))
    assert summary["run/fidelity/trainable_tokens"] == trainable > 0

    scalars = tensorboard_scalars(out / "tensorboard")
    assert scalars["session/reward"] == [(i, pytest.approx(r)) for i, r in enumerate(rewards)]
    assert [v for _, v in scalars["session/completions"]] == [r["completions"] for r in results]
    assert scalars["run/sessions"] == [(0, 4.0)]
    assert scalars["run/mean_reward"] == [(0, pytest.approx(mean))]
    assert scalars["run/fidelity/trainable_tokens"] == [(0, trainable)]


def test_sft_training_metrics_go_to_wandb_and_tensorboard_row_by_row(tmp_path: Path) -> None:
    data = tmp_path / "sft" / "train.jsonl"
    data.parent.mkdir()
    data.write_text(json.dumps({"messages": MESSAGES, "reward": 1.0}) + "\n")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "polar_gym.launch", "+trainer=sft",
                           f"trainer.model={small_qwen3_dir(tmp_path)}", f"trainer.data=[{data}]", "trainer.steps=3",
                           "trainer.batch_size=1", "logging.wandb=true", "logging.tensorboard=true",
                           f"out_dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "160"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (out / "trainer" / "train_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    history = wandb_history(wandb_run_dir(out))
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert [h["train/loss"] for h in history] == [r["loss"] for r in rows]
    assert [h["train/tokens"] for h in history] == [r["tokens"] for r in rows]
    assert [h["train/grad_norm"] for h in history] == [r["grad_norm"] for r in rows]
    scalars = tensorboard_scalars(out / "tensorboard")
    assert scalars["train/loss"] == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
    assert scalars["train/seconds"] == [(r["step"], pytest.approx(r["seconds"], rel=1e-6)) for r in rows]
