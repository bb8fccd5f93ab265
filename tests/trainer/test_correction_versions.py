"""The mismatch guard scores each token with the weights of the policy version that sampled it: after an update,
tokens the previous version sampled (with that version's exact logprobs, as a perfect engine reports them) show no
mismatch, while the correction, taken against the current weights, sees the update's drift; tokens of an unknown
version are scored by the current weights, those of a version no longer kept are left out of the guard's metrics
(they would measure the drift), each counted as such."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from polar_gym.trainer import Trainer, TrainerSettings, TrainSequence, collate, trained_logprobs
from polar_gym.trainer.policy import PAD_ID
from tests.trainer._tiny import small_qwen3_dir

SHAPES = [([151644, 872, 198], [9707, 11, 1879, 0]), ([151644, 77091], [40, 1079, 264])]


def _sampled(trainer: Trainer, version: int | None) -> list[TrainSequence]:
    """SHAPES with the trainer's current logprobs as the captured ones, stamped ``version``."""
    bare = [TrainSequence(p, r, [1] * len(r)) for p, r in SHAPES]
    with torch.no_grad():
        logprobs = trained_logprobs(trainer.model, collate(bare, PAD_ID)).tolist()
    out, at = [], 0
    for (p, r), advantage in zip(SHAPES, (1.0, -1.0), strict=True):
        out.append(TrainSequence(p, r, [1] * len(r), logprobs[at:at + len(r)], advantage=advantage,
                                 versions=[version] * len(r)))
        at += len(r)
    return out


def _stats(trainer: Trainer, sequences: list[TrainSequence]) -> dict[str, float]:
    seen: dict[str, float] = {}
    trainer.grpo_step(sequences, lambda stats: bool(seen.update(stats)) and False)  # measure, do not update
    return seen


def test_the_guard_scores_each_token_with_its_own_versions_weights(tmp_path: Path) -> None:
    settings = TrainerSettings(algorithm="grpo", optimizer="sgd", learning_rate=50.0, max_staleness=1,
                               initial_version=3)
    trainer = Trainer(settings, small_qwen3_dir(tmp_path))
    assert trainer.kept_versions == [3]
    old = _sampled(trainer, 3)
    trainer.grpo_step(old)  # an update: the weights are no longer version 3's
    trainer.keep_version(4)
    assert trainer.kept_versions == [3, 4]

    stats = _stats(trainer, old)
    assert stats["audit/logprob_abs_diff_max"] < 1e-5  # version 3's weights reproduce version 3's logprobs
    assert stats["guard/tokens_own_version"] == 7 and stats["guard/tokens_unknown_version"] == 0
    assert stats["rollout_corr/correction_k3_kl"] > 1e-4  # the correction sees the drift of the update

    unknown = [TrainSequence(s.prompt_ids, s.response_ids, s.loss_mask, s.old_logprobs, advantage=s.advantage)
               for s in old]
    stats = _stats(trainer, unknown)
    assert stats["guard/tokens_unknown_version"] == 7
    assert stats["audit/logprob_abs_diff_mean"] > 1e-4  # scored by the current weights: the drift shows

    trainer.grpo_step(_sampled(trainer, 4))
    trainer.keep_version(5)
    assert trainer.kept_versions == [4, 5]  # max_staleness + 1
    stats = _stats(trainer, old)
    assert stats["guard/tokens_version_not_kept"] == 7 and "audit/logprob_abs_diff_mean" not in stats
    assert stats["rollout_corr/correction_k3_kl"] > 1e-4  # the correction still weighs them
    mixed = _stats(trainer, [*old, *_sampled(trainer, 5)])  # only version 5's own tokens are measured
    assert mixed["guard/tokens_version_not_kept"] == 7 and mixed["audit/tokens"] == 7
    assert mixed["audit/logprob_abs_diff_max"] < 1e-5


def test_synchronous_training_keeps_no_copy(tmp_path: Path) -> None:
    trainer = Trainer(TrainerSettings(algorithm="grpo"), small_qwen3_dir(tmp_path))
    assert trainer.kept_versions == []
    stats = _stats(trainer, _sampled(trainer, 0))
    assert stats["guard/tokens_own_version"] == 7
    assert stats["audit/logprob_abs_diff_max"] == pytest.approx(0.0, abs=1e-6)
