"""The policy being trained: its weights, optimizer and one update of either algorithm (synchronous, no I/O but the
checkpoint). The loops in :mod:`polar_gym.trainer.loops` drive it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from polar_gym.trainer.batch import TrainSequence, collate
from polar_gym.trainer.checkpoint import load_policy, save_checkpoint
from polar_gym.trainer.logprobs import trained_logprobs
from polar_gym.trainer.losses import aggregate, kl_k3, logprob_diff_stats, policy_loss, sft_loss
from polar_gym.trainer.settings import TrainerSettings

__all__ = ["PAD_ID", "StepReport", "Trainer"]

PAD_ID = 151643  # <|endoftext|>: never attended to (attention mask 0), any id works


@dataclass(frozen=True)
class StepReport:
    loss: float
    tokens: int
    grad_norm: float
    stats: Mapping[str, float]
    logprobs: torch.Tensor


class Trainer:
    """A policy, its optimizer and one step of either algorithm (synchronous; no I/O but the checkpoint)."""

    def __init__(self, settings: TrainerSettings, model_dir: Path) -> None:
        if settings.threads:
            torch.set_num_threads(settings.threads)
        torch.manual_seed(settings.seed)
        self.settings = settings
        self.model_dir = model_dir
        self.model = load_policy(model_dir)
        self.reference = _frozen(load_policy(model_dir)) if settings.kl_coef > 0 else None
        self.optimizer: torch.optim.Optimizer
        if settings.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=settings.learning_rate,
                                             weight_decay=settings.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.learning_rate,
                                               weight_decay=settings.weight_decay)

    def _apply(self, loss: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.max_grad_norm)
        self.optimizer.step()
        return float(norm)

    def sft_step(self, sequences: Sequence[TrainSequence]) -> StepReport:
        batch = collate(sequences, PAD_ID)
        logprobs = trained_logprobs(self.model, batch)
        loss = sft_loss(logprobs)
        norm = self._apply(loss)
        return StepReport(loss.item(), batch.trained_tokens, norm, {}, logprobs.detach())

    def grpo_step(self, sequences: Sequence[TrainSequence],
                  judge: Callable[[Mapping[str, float]], bool] | None = None) -> StepReport:
        """One update on ``sequences``; ``judge`` sees the step's statistics (the trainer-vs-engine mismatch
        among them) before the update and returns False to skip it (see :mod:`polar_gym.trainer.verdict`)."""
        batch = collate(sequences, PAD_ID)
        if not batch.has_old_logprobs:
            raise ValueError("GRPO needs the captured logprobs of every trained token")
        s = self.settings
        logprobs = trained_logprobs(self.model, batch)
        loss, stats = policy_loss(logprobs, batch.old_logprobs, batch.advantages, clip_low=s.clip_low,
                                  clip_high=s.clip_high, tis_cap=s.tis_cap, weights=batch.weights, rows=batch.rows,
                                  aggregation=s.loss_aggregation, loss_norm_tokens=s.loss_norm_tokens)
        if self.reference is not None:
            with torch.no_grad():
                reference = trained_logprobs(self.reference, batch)
            kl = kl_k3(logprobs, reference)
            loss = loss + s.kl_coef * aggregate(kl, batch.weights, batch.rows, s.loss_aggregation,
                                                loss_norm_tokens=s.loss_norm_tokens)
            stats = {**stats, "kl/k3_mean": kl.detach().mean().item()}
        diff = logprob_diff_stats(logprobs, batch.old_logprobs, batch.rows)
        update = bool((batch.advantages != 0).any()) and (judge is None or judge({**stats, **diff}))
        norm = self._apply(loss) if update else 0.0
        return StepReport(loss.item(), batch.trained_tokens, norm, {**stats, **diff}, logprobs.detach())

    def save(self, out_dir: Path) -> Path:
        return save_checkpoint(self.model, out_dir, self.model_dir)


def _frozen(model: Any) -> Any:
    """The reference policy of the KL term: evaluation mode, no gradients."""
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model
