"""Issue 15: W&B (offline: no network, no login) and TensorBoard files written by a real SFT run and read back with
the tools' own formats: its series matches train_metrics.jsonl row by row. A launch's per-session series and totals
are checked on tests/launch/test_launch_outputs.py's shared launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.telemetry._readers import tensorboard_scalars, wandb_history, wandb_run_dir
from tests.trainer._tiny import small_qwen3_dir
from tests.trainer.test_sft import MESSAGES

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


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
