"""``python -m polar_gym.launch +trainer=sft|grpo``: composed by Hydra, validated with the other groups, run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from polar_gym.launch import CONF_DIR, ConfigError, build_job, run
from polar_gym.trainer import TrainerSettings
from tests.trainer._tiny import small_qwen3_dir
from tests.trainer.test_sft import MESSAGES


def composed(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_trainer_groups_validate_into_trainer_settings(tmp_path: Path) -> None:
    job = build_job(composed("+trainer=grpo", "trainer.tis_cap=2.0", f"out_dir={tmp_path}"))
    assert job.trainer == TrainerSettings(algorithm="grpo", tis_cap=2.0)
    assert build_job(composed("+trainer=sft", f"out_dir={tmp_path}")).trainer == TrainerSettings()
    assert build_job(composed(f"out_dir={tmp_path}")).trainer is None
    with pytest.raises(ConfigError) as err:
        build_job(composed("+trainer=sft", "trainer.steps=0", "trainer.algorithm=ppo", f"out_dir={tmp_path}"))
    assert sorted(err.value.keys) == ["trainer.algorithm", "trainer.steps"]


def test_launch_trainer_sft_trains_on_a_datagen_export(tmp_path: Path) -> None:
    data = tmp_path / "sft" / "train.jsonl"
    data.parent.mkdir()
    data.write_text(json.dumps({"messages": MESSAGES, "reward": 1.0}) + "\n")
    out = tmp_path / "run"
    code = run(composed("+trainer=sft", f"trainer.model={small_qwen3_dir(tmp_path)}", f"trainer.data=[{data}]",
                        "trainer.steps=2", "trainer.batch_size=1", f"out_dir={out}"))
    assert code == 0
    rows = [json.loads(x) for x in (out / "trainer" / "train_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] < rows[0]["loss"]
    assert (out / "trainer" / "checkpoints" / "final" / "model.safetensors").exists()
    assert (out / "config.yaml").exists()
    assert run(composed("+trainer=sft", f"out_dir={tmp_path / 'nodata'}")) == 2  # no trainer.data: config error


@pytest.mark.slow
def test_launch_trainer_grpo_runs_a_step_through_a_real_fleet(tmp_path: Path) -> None:
    """pi on the oracle engine (rewards all 1: zero advantages, so no update, but the whole path runs: submit,
    collect through the rollout server, step, checkpoint, metrics). Weight pushes need the fleet's update call."""
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is needed: run `bash scripts/setup.sh`")
    out = tmp_path / "run"
    code = run(composed("+trainer=grpo", f"trainer.model={small_qwen3_dir(tmp_path)}", "trainer.steps=1",
                        "trainer.push_weights=false", "num_samples=2", "tasks.ids=[demo-calc-add]",
                        "launcher.progress=false", f"out_dir={out}"))
    assert code == 0
    (row,) = [json.loads(x) for x in (out / "trainer" / "train_metrics.jsonl").read_text().splitlines()]
    assert row["sessions"] == 2 and row["errored"] == 0 and row["traces"] == 2
    assert row["reward_mean"] == 1.0 and row["grad_norm"] == 0.0 and row["tokens"] > 0
    assert (out / "trainer" / "checkpoints" / "step-1" / "model.safetensors").exists()
