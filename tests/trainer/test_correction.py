"""The rollout correction (every mode, hand-computed), its settings (tis_cap retired with a message naming the new
keys) and the Trainer applying it: masked tokens are not trained and are counted."""

from __future__ import annotations

import math
from pathlib import Path
from typing import get_args

import pytest
import torch
from pydantic import ValidationError

from polar_gym.audit import correction as audit_correction
from polar_gym.bridges import correction as bridge
from polar_gym.launch import CONF_DIR, ConfigError, build_job
from polar_gym.trainer import Trainer, TrainerSettings, TrainSequence
from polar_gym.trainer.correction import rollout_correction
from polar_gym.trainer.settings import CorrectionMode
from tests.trainer._tiny import small_qwen3_dir

LOG3, LOG_HALF = math.log(3.0), math.log(0.5)
#: three tokens whose train/rollout ratios are 1, 3 and 0.5; the first two one sequence, the third another
TRAIN = torch.tensor([-1.0, -2.0 + LOG3, -0.7 + LOG_HALF])
ROLLOUT = torch.tensor([-1.0, -2.0, -0.7])
ROWS = torch.tensor([0, 0, 1])


def test_token_truncate_caps_each_ratio() -> None:
    c = rollout_correction(TRAIN, ROLLOUT, ROWS, "token_truncate", 2.0)
    assert c.weights.tolist() == pytest.approx([1.0, 2.0, 0.5])
    assert not c.masked.any()
    assert c.stats["rollout_corr/correction_truncated_fraction"] == pytest.approx(1 / 3)
    assert c.stats["rollout_corr/correction_is_mean"] == pytest.approx(3.5 / 3)
    # normalised ESS (sum w)^2 / (n sum w^2) = 3.5^2 / (3 * 5.25)
    assert c.stats["rollout_corr/correction_is_eff_sample_size"] == pytest.approx(12.25 / 15.75)
    assert c.stats["masked_tokens/rollout_correction"] == 0.0


def test_token_mask_drops_the_tokens_above_the_threshold() -> None:
    c = rollout_correction(TRAIN, ROLLOUT, ROWS, "token_mask", 2.0)
    assert c.weights.tolist() == pytest.approx([1.0, 0.0, 0.5])
    assert c.masked.tolist() == [False, True, False]
    assert c.stats["rollout_corr/correction_masked_fraction"] == pytest.approx(1 / 3)
    assert c.stats["rollout_corr/correction_seq_masked_fraction"] == pytest.approx(0.5)  # sequence 0 has one
    assert c.stats["masked_tokens/rollout_correction"] == 1.0
    assert c.stats["rollout_corr/correction_is_eff_sample_size"] == pytest.approx(1.5 ** 2 / (2 * 1.25))


def test_sequence_truncate_uses_the_geometric_mean_ratio() -> None:
    # sequence 0: ratios 1 and 3, geometric mean sqrt(3) = 1.732; sequence 1: 0.5
    c = rollout_correction(TRAIN, ROLLOUT, ROWS, "sequence_truncate", 2.0)
    assert c.weights.tolist() == pytest.approx([math.sqrt(3), math.sqrt(3), 0.5])
    c = rollout_correction(TRAIN, ROLLOUT, ROWS, "sequence_truncate", 1.5)
    assert c.weights.tolist() == pytest.approx([1.5, 1.5, 0.5])
    assert c.stats["rollout_corr/correction_truncated_fraction"] == pytest.approx(2 / 3)
    assert c.stats["rollout_corr/correction_seq_fraction_high"] == pytest.approx(0.5)


def test_sequence_mask_drops_whole_sequences_and_keeps_token_ratios_elsewhere() -> None:
    assert rollout_correction(TRAIN, ROLLOUT, ROWS, "sequence_mask", 2.0).weights.tolist() == pytest.approx(
        [1.0, 3.0, 0.5])  # sqrt(3) <= 2: kept, each token with its own ratio (ms-swift's sequence_mask)
    c = rollout_correction(TRAIN, ROLLOUT, ROWS, "sequence_mask", 1.5)
    assert c.weights.tolist() == pytest.approx([0.0, 0.0, 0.5])
    assert c.masked.tolist() == [True, True, False]
    assert c.stats["rollout_corr/correction_seq_masked_fraction"] == pytest.approx(0.5)
    assert c.stats["masked_tokens/rollout_correction"] == 2.0


def test_none_weighs_every_token_one_and_rows_default_to_one_sequence_per_token() -> None:
    c = rollout_correction(TRAIN, ROLLOUT, mode="none")
    assert c.weights.tolist() == [1.0, 1.0, 1.0] and not c.masked.any()
    k3 = ((3 - LOG3 - 1) + (0.5 - LOG_HALF - 1)) / 3
    assert c.stats["rollout_corr/correction_k3_kl"] == pytest.approx(k3)
    # one sequence per token: the third token alone is sequence-masked at 0.4 (ratio 0.5 > 0.4)
    assert rollout_correction(TRAIN, ROLLOUT, mode="sequence_mask", threshold=0.4).masked.tolist() == [
        True, True, True]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown rollout correction 'tis'"):
        rollout_correction(TRAIN, ROLLOUT, mode="tis")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threshold must be > 0"):
        rollout_correction(TRAIN, ROLLOUT, threshold=0.0)
    with pytest.raises(ValueError, match="align"):
        rollout_correction(TRAIN, ROLLOUT[:2])


def test_the_bridges_and_the_settings_name_the_same_menu() -> None:
    assert bridge.rollout_correction is audit_correction.rollout_correction
    assert get_args(CorrectionMode) == get_args(audit_correction.CorrectionMode)


def test_tis_cap_is_refused_with_the_keys_that_replaced_it(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="rollout_correction=token_truncate correction_threshold=C"):
        TrainerSettings.model_validate({"algorithm": "grpo", "tis_cap": 2.0})
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        config = compose("config", overrides=["+trainer=grpo", "+trainer.tis_cap=2.0", f"out_dir={tmp_path}"])
    with pytest.raises(ConfigError) as err:
        build_job(config)
    assert "trainer.rollout_correction" in str(err.value) and "trainer.correction_threshold" in str(err.value)
    settings = TrainerSettings(algorithm="grpo", rollout_correction="token_truncate", correction_threshold=2.0)
    assert settings.rollout_correction == "token_truncate"


def _sequences() -> list[TrainSequence]:
    """Two sequences; their captured logprobs are made up so that one token's ratio is huge (masked at 2)."""
    return [TrainSequence([10, 11, 12], [20, 21, 22], [1, 1, 1], [-3.0, -60.0, -3.0], advantage=1.0),
            TrainSequence([10, 13], [23, 24], [1, 1], [-3.0, -3.0], advantage=-1.0)]


def test_the_trainer_leaves_masked_tokens_out_and_counts_them(tmp_path: Path) -> None:
    model_dir = small_qwen3_dir(tmp_path)
    masked = Trainer(TrainerSettings(algorithm="grpo", rollout_correction="token_mask"), model_dir)
    seen: dict[str, float] = {}
    report = masked.grpo_step(_sequences(), lambda stats: bool(seen.update(stats)) or False)
    assert report.tokens == 5  # every sampled token is in the row: trained, or masked with its reason
    assert seen["masked_tokens/rollout_correction"] == 1.0  # the -60 token: ratio exp(~50) > 2
    assert seen["rollout_corr/correction_masked_fraction"] == pytest.approx(0.2)
    # the loss is the token mean over the four kept tokens, each weighted by its ratio
    logprobs = report.logprobs
    keep = torch.tensor([True, False, True, True, True])
    rollout = torch.tensor([-3.0, -60.0, -3.0, -3.0, -3.0])
    advantages = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0])
    expected = -(torch.exp(logprobs - rollout) * advantages)[keep].mean()
    assert report.loss == pytest.approx(expected.item(), rel=1e-5)


def test_a_bf16_trainer_with_an_fp32_head_trains_and_scores_in_fp32(tmp_path: Path) -> None:
    settings = TrainerSettings(algorithm="grpo", dtype="bfloat16", lm_head_fp32=True, max_mismatch=None)
    trainer = Trainer(settings, small_qwen3_dir(tmp_path))
    assert next(trainer.model.parameters()).dtype == torch.bfloat16
    report = trainer.grpo_step(_sequences())
    assert report.logprobs.dtype == torch.float32 and report.grad_norm > 0


def test_the_fp32_head_upcasts_hidden_states_and_weights() -> None:
    from polar_gym.audit.recompute import head_logprobs
    from tests.trainer._tiny import small_qwen3

    model = small_qwen3().to(torch.bfloat16)
    hidden = torch.randn(3, 32).to(torch.bfloat16)
    targets = torch.tensor([1, 2, 3])
    head = model.get_output_embeddings().weight
    exact = torch.log_softmax(hidden.float() @ head.float().T, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    assert head_logprobs(model, hidden, targets, 2, fp32_head=True).tolist() == pytest.approx(exact.tolist(),
                                                                                             abs=1e-6)
    rounded = torch.log_softmax((hidden @ head.T).float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    assert head_logprobs(model, hidden, targets, 2).tolist() == pytest.approx(rounded.tolist(), abs=1e-6)
