"""The pure loss math against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from polar_gym.trainer import collate, group_advantages, logprob_diff_stats, policy_loss, sft_loss
from polar_gym.trainer.batch import TrainSequence
from polar_gym.trainer.correction import rollout_correction


def test_sft_loss_is_the_token_mean_nll() -> None:
    assert sft_loss(torch.tensor([-1.0, -2.0, -3.0])).item() == pytest.approx(2.0)
    with pytest.raises(ValueError):
        sft_loss(torch.tensor([]))


def test_group_advantages_normalise_within_each_task() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.7]
    groups = ["a", "a", "a", "b", "b", "c", "d"]
    out = group_advantages(rewards, groups)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased std of [1, 0, 0]
    assert out[:3] == pytest.approx([(2 / 3) / (std + 1e-6), -(1 / 3) / (std + 1e-6), -(1 / 3) / (std + 1e-6)])
    assert out[3:] == [0.0, 0.0, 0.0, 0.0]  # zero variance, then groups of one: no relative signal
    assert sum(out[:3]) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError):
        group_advantages([1.0], ["a", "b"])


def test_policy_loss_clips_the_ratio_per_token() -> None:
    old = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    new = torch.log(torch.tensor([0.75, 0.25, 0.75, 0.25])).requires_grad_()  # ratios 1.5, 0.5, 1.5, 0.5
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, stats = policy_loss(new, old, adv, clip_low=0.2, clip_high=0.28)
    # min(r A, clip(r) A): 1.28 (clipped), 0.5 (unclipped), -1.5 (unclipped), -0.8 (clipped)
    assert loss.item() == pytest.approx(-(1.28 + 0.5 - 1.5 - 0.8) / 4)
    assert stats["clip_fraction"] == pytest.approx(0.5)
    torch.autograd.backward(loss)
    assert new.grad is not None
    # clipped tokens get no gradient; unclipped ones get -A * r / N
    assert new.grad.tolist() == pytest.approx([0.0, -0.5 / 4, 1.5 / 4, 0.0])


def test_truncated_importance_weights_the_on_policy_gradient() -> None:
    rollout = torch.log(torch.tensor([0.5, 0.1]))
    new = torch.log(torch.tensor([0.6, 0.5])).requires_grad_()  # train/rollout ratios 1.2 and 5
    weights = rollout_correction(new, rollout, mode="token_truncate", threshold=2.0)
    loss, _ = policy_loss(new, rollout, torch.tensor([1.0, 1.0]), correction=weights.weights)
    assert loss.item() == pytest.approx(-(1.2 + 2.0) / 2)  # ratio 1 (proximal = current), weights 1.2 and cap 2
    assert weights.stats["rollout_corr/correction_truncated_fraction"] == pytest.approx(0.5)
    torch.autograd.backward(loss)
    assert new.grad is not None and new.grad.tolist() == pytest.approx([-1.2 / 2, -2.0 / 2])


def test_logprob_diff_stats() -> None:
    train = torch.tensor([-1.0, -2.0, -0.5])
    rollout = torch.tensor([-1.0, -2.0 - math.log(3), -0.5])  # the second token: train/rollout ratio 3
    stats = logprob_diff_stats(train, rollout, torch.tensor([0, 0, 1]))
    d = math.log(3)
    assert stats["rollout_corr/k3_kl"] == pytest.approx((math.exp(d) - d - 1) / 3)
    assert stats["audit/logprob_abs_diff_max"] == pytest.approx(d)
    assert stats["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert stats["audit/sequences"] == 2  # one per batch row
    assert stats["rollout_corr/log_ppl_diff"] == pytest.approx((-d / 2 + 0.0) / 2)
    assert logprob_diff_stats(torch.tensor([]), torch.tensor([]), torch.tensor([], dtype=torch.long)) == {}


def test_collate_lists_only_trained_positions() -> None:
    a = TrainSequence([1, 2], [3, 4, 5], [1, 0, 1], [-0.1, -0.2, -0.3], advantage=0.5)
    b = TrainSequence([6], [7], [1], [-0.7], advantage=-1.0)
    batch = collate([a, b], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert list(zip(batch.rows.tolist(), batch.positions.tolist(), strict=True)) == [(0, 2), (0, 4), (1, 1)]
    assert batch.targets.tolist() == [3, 5, 7]
    assert batch.old_logprobs.tolist() == pytest.approx([-0.1, -0.3, -0.7])
    assert batch.advantages.tolist() == [0.5, 0.5, -1.0] and batch.has_old_logprobs
    assert not collate([TrainSequence([1], [2], [1])]).has_old_logprobs
    with pytest.raises(ValueError):
        TrainSequence([], [1], [1])
    with pytest.raises(ValueError):
        collate([])
