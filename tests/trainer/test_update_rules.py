"""How a GRPO step moves the weights: the KL penalty to the reference policy (trainer.kl_coef: k3 per sampled
token, the reference frozen at the starting weights, off by default) and the optimizer (trainer.optimizer)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from polar_gym.trainer import TrainerSettings
from polar_gym.trainer.batch import TrainSequence
from polar_gym.trainer.losses import kl_k3
from polar_gym.trainer.policy import Trainer
from tests.trainer._tiny import small_qwen3_dir


def test_k3_is_zero_at_the_reference_and_positive_away_from_it() -> None:
    new = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    reference = torch.tensor([-1.0, -1.0, -1.0])
    values = kl_k3(new, reference)
    expected = [math.exp(r - n) - (r - n) - 1 for n, r in ((-1.0, -1.0), (-2.0, -1.0), (-0.5, -1.0))]
    assert torch.allclose(values, torch.tensor(expected)) and values[0] == 0 and bool((values[1:] > 0).all())
    values.sum().backward()
    assert new.grad is not None and new.grad[0] == 0  # no pull where the policy agrees with the reference
    assert new.grad[1] < 0 < new.grad[2]  # the gradient step moves each token back toward the reference


def _sequences() -> list[TrainSequence]:
    prompt = [151644, 872, 198]
    return [TrainSequence(prompt, [1000, 1001], [1, 1], old_logprobs=[-11.0, -11.0], advantage=a, reward=r,
                          group="g") for a, r in ((1.0, 1.0), (-1.0, 0.0))]


def test_the_penalty_uses_a_frozen_reference_and_is_off_by_default(tmp_path: Path) -> None:
    model_dir = small_qwen3_dir(tmp_path)
    plain = Trainer(TrainerSettings(algorithm="grpo", model=str(model_dir)), model_dir)
    assert plain.reference is None and "kl/k3_mean" not in plain.grpo_step(_sequences()).stats
    trainer = Trainer(TrainerSettings(algorithm="grpo", model=str(model_dir), kl_coef=0.5, learning_rate=1e-2),
                      model_dir)
    assert trainer.reference is not None
    frozen = {k: v.clone() for k, v in trainer.reference.state_dict().items()}
    first = trainer.grpo_step(_sequences())
    assert first.stats["kl/k3_mean"] == 0.0  # the first step starts at the reference
    second = trainer.grpo_step(_sequences())
    assert second.stats["kl/k3_mean"] > 0.0  # the policy moved away; the reference did not
    assert all(torch.equal(frozen[k], v) for k, v in trainer.reference.state_dict().items())
    assert not any(p.requires_grad for p in trainer.reference.parameters())


def test_sgd_steps_by_the_gradient_times_the_rate(tmp_path: Path) -> None:
    """trainer.optimizer=sgd: a weight moves by lr x its (clipped) gradient, so a gradient of noise moves it little;
    AdamW moves every weight with a gradient by about lr whatever its size."""
    model_dir = small_qwen3_dir(tmp_path)
    trainer = Trainer(TrainerSettings(algorithm="grpo", model=str(model_dir), optimizer="sgd", learning_rate=0.5,
                                      max_grad_norm=1e9), model_dir)
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.grpo_step(_sequences())
    grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
    assert grads
    for name, grad in grads.items():
        moved = before[name] - dict(trainer.model.named_parameters())[name].detach()
        assert torch.allclose(moved, 0.5 * grad, atol=1e-6), name
    adam = Trainer(TrainerSettings(algorithm="grpo", model=str(model_dir)), model_dir)
    assert isinstance(adam.optimizer, torch.optim.AdamW)
