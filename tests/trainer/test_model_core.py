"""The core on a real (small, random) Qwen3: logprobs at trained positions only, an SFT step, a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from polar_gym.trainer import (
    TrainerSettings,
    TrainSequence,
    collate,
    full_logprobs,
    load_policy,
    save_checkpoint,
    trained_logprobs,
)
from polar_gym.trainer.policy import Trainer
from tests.trainer._tiny import small_qwen3, small_qwen3_dir


def _sequences() -> list[TrainSequence]:
    return [TrainSequence([5, 9, 11, 40], [17, 3, 99, 2], [1, 0, 1, 1]),
            TrainSequence([7, 8], [100, 101, 102, 103, 104, 105], [1, 1, 1, 0, 1, 1])]


def test_logprobs_at_trained_positions_equal_the_full_forward() -> None:
    model = small_qwen3()
    model.eval()
    batch = collate(_sequences(), pad_id=0)
    with torch.no_grad():
        fast, full = trained_logprobs(model, batch), full_logprobs(model, batch)
    assert fast.shape == (batch.trained_tokens,) == (8,)
    assert torch.allclose(fast, full, atol=1e-5), (fast - full).abs().max()
    # padding does not leak: each sequence alone gives the same values
    alone = torch.cat([trained_logprobs(model, collate([s])) for s in _sequences()]).detach()
    assert torch.allclose(fast, alone, atol=1e-5)


def test_one_sft_step_lowers_the_batch_nll(tmp_path: Path) -> None:
    model_dir = small_qwen3_dir(tmp_path)
    trainer = Trainer(TrainerSettings(algorithm="sft", learning_rate=1e-2), model_dir)
    first = trainer.sft_step(_sequences())
    with torch.no_grad():
        after = -trained_logprobs(trainer.model, collate(_sequences(), 0)).mean().item()
    assert first.tokens == 8 and after < first.loss - 0.05, (first.loss, after)


def test_checkpoint_round_trip_gives_identical_logits(tmp_path: Path) -> None:
    model_dir = small_qwen3_dir(tmp_path)
    trainer = Trainer(TrainerSettings(algorithm="sft", learning_rate=1e-2), model_dir)
    trainer.sft_step(_sequences())  # weights differ from the saved start
    out = save_checkpoint(trainer.model, tmp_path / "ckpt", model_dir)
    assert {"model.safetensors", "config.json", "tokenizer.json", ".complete"} <= {p.name for p in out.iterdir()}
    reloaded = load_policy(out)
    ids = collate(_sequences(), 0)
    trainer.model.eval()
    reloaded.eval()
    with torch.no_grad():
        a = trainer.model(input_ids=ids.input_ids, attention_mask=ids.attention_mask).logits
        b = reloaded(input_ids=ids.input_ids, attention_mask=ids.attention_mask).logits
    assert torch.equal(a, b)
    assert next(reloaded.parameters()).dtype is torch.float32
    with pytest.raises(TypeError):
        trained_logprobs(object(), ids)
