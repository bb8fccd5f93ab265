"""The policy being trained: its weights, optimizer and one update of either algorithm (synchronous, no I/O but the
checkpoint). The loops in :mod:`polar_gym.trainer.loops` drive it.

A GRPO step (:meth:`Trainer.grpo_step`) measures two things against the engine's captured logprobs:

- the off-policy correction (``trainer.rollout_correction``): importance weights of the current weights against the
  engine, :mod:`polar_gym.audit.correction`; it covers both the engine's numerical mismatch and an asynchronous
  step's policy drift, and its masked tokens are not trained (counted in ``masked_tokens/rollout_correction``);
- the mismatch guard's metrics (``audit/*``, ``rollout_corr/*``; ``trainer.mismatch_metric`` is the one bounded):
  each token scored by the weights of the policy version that sampled it (:meth:`Trainer.keep_version` keeps CPU
  copies of the last ``max_staleness + 1`` versions), so only the engine's disagreement with those weights counts,
  not the drift of later updates; tokens of an unknown version are scored by the current weights, those of a
  version no longer kept are left out of the guard's metrics (they would measure the drift), each counted in
  ``guard/tokens_unknown_version`` / ``guard/tokens_version_not_kept``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from polar_gym.audit.correction import rollout_correction
from polar_gym.trainer.batch import TrainBatch, TrainSequence, collate
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

    def __init__(self, settings: TrainerSettings, model_dir: Path, weights: Path | None = None) -> None:
        """``model_dir``: the starting model (the KL reference, the tokenizer files); ``weights``: a checkpoint of
        the run to start from instead (a resumed run; :meth:`restore` brings back its optimizer)."""
        if settings.threads:
            torch.set_num_threads(settings.threads)
        torch.manual_seed(settings.seed)
        self.settings = settings
        self.model_dir = model_dir
        dtype = getattr(torch, settings.dtype)
        self.model = load_policy(weights or model_dir, dtype)
        self.reference = _frozen(load_policy(model_dir, dtype)) if settings.kl_coef > 0 else None
        self.optimizer: torch.optim.Optimizer
        if settings.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=settings.learning_rate,
                                             weight_decay=settings.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.learning_rate,
                                               weight_decay=settings.weight_decay)
        #: the policy version the current weights are (until the next update changes them)
        self.version = settings.initial_version
        self._changed = False
        self._kept: dict[int, dict[str, torch.Tensor]] = {}
        self._scorer = _Scorer(self.model, settings.lm_head_fp32)
        self.keep_version(settings.initial_version)

    def keep_version(self, version: int) -> None:
        """The current weights are policy ``version`` (the loop calls this after each push): with
        ``max_staleness`` >= 1 a CPU copy of them is kept, the newest ``max_staleness + 1`` versions in all, so the
        guard scores a token sampled by that version with its own weights after later updates."""
        self.version, self._changed = int(version), False
        keep = self.settings.max_staleness + 1
        if keep < 2:
            self._kept.clear()
            return
        self._kept[self.version] = {name: p.detach().to("cpu", copy=True) for name, p in self.model.named_parameters()}
        for old in sorted(self._kept)[:-keep]:
            del self._kept[old]

    def state(self) -> dict[str, Any]:
        """What a resumed run needs besides the weights: the optimizer's moments and step counts, torch's RNG."""
        return {"optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state()}

    def restore(self, state: Mapping[str, Any], version: int) -> None:
        """Continue from :meth:`state` with the weights of policy ``version`` (loaded by the constructor). The
        copies kept for the guard start again from this version: older versions' tokens are counted as not kept."""
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        self._kept.clear()
        self.keep_version(version)

    @property
    def kept_versions(self) -> list[int]:
        """The versions whose weights are kept for the guard (oldest first)."""
        return sorted(self._kept)

    def _apply(self, loss: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.max_grad_norm)
        self.optimizer.step()
        self._changed = True
        return float(norm)

    def sft_step(self, sequences: Sequence[TrainSequence]) -> StepReport:
        batch = collate(sequences, PAD_ID)
        logprobs = trained_logprobs(self.model, batch, fp32_head=self.settings.lm_head_fp32)
        loss = sft_loss(logprobs)
        norm = self._apply(loss)
        return StepReport(loss.item(), batch.trained_tokens, norm, {}, logprobs.detach())

    def grpo_step(self, sequences: Sequence[TrainSequence],
                  judge: Callable[[Mapping[str, float]], bool] | None = None) -> StepReport:
        """One update on ``sequences``; ``judge`` sees the step's statistics (the guard's mismatch metrics among
        them, see the module docstring) before the update and returns False to skip it
        (:mod:`polar_gym.trainer.verdict`)."""
        batch = collate(sequences, PAD_ID)
        if not batch.has_old_logprobs:
            raise ValueError("GRPO needs the captured logprobs of every trained token")
        s = self.settings
        logprobs = trained_logprobs(self.model, batch, fp32_head=s.lm_head_fp32)
        rollout = batch.old_logprobs
        corr = rollout_correction(logprobs, rollout, batch.rows, s.rollout_correction, s.correction_threshold)
        keep = ~corr.masked
        trainable = bool(keep.any())
        stats: dict[str, float] = dict(corr.stats)
        if trainable:
            loss, loss_stats = policy_loss(
                logprobs[keep], rollout[keep], batch.advantages[keep], clip_low=s.clip_low, clip_high=s.clip_high,
                correction=None if s.rollout_correction == "none" else corr.weights[keep],
                weights=batch.weights[keep], rows=batch.rows[keep], aggregation=s.loss_aggregation,
                loss_norm_tokens=s.loss_norm_tokens)
            stats.update(loss_stats)
            if self.reference is not None:
                with torch.no_grad():
                    reference = trained_logprobs(self.reference, batch, fp32_head=s.lm_head_fp32)
                kl = kl_k3(logprobs[keep], reference[keep])
                loss = loss + s.kl_coef * aggregate(kl, batch.weights[keep], batch.rows[keep], s.loss_aggregation,
                                                    loss_norm_tokens=s.loss_norm_tokens)
                stats["kl/k3_mean"] = kl.detach().mean().item()
        else:  # the correction masked every token: nothing to train on
            loss = (logprobs * 0.0).sum()
        scored, counts, own = self.sampling_logprobs(batch, logprobs.detach())
        # the guard's metrics leave out tokens of versions no longer kept: against the current weights they would
        # measure the policy's drift since (a stale group trained with stale_groups: correct), not the engine
        stats.update({**logprob_diff_stats(scored[own], rollout[own], batch.rows[own]), **counts})
        update = trainable and bool((batch.advantages[keep] != 0).any()) and (judge is None or judge(stats))
        norm = self._apply(loss) if update else 0.0
        return StepReport(loss.item(), batch.trained_tokens, norm, stats, logprobs.detach())

    def sampling_logprobs(self, batch: TrainBatch,
                          current: torch.Tensor) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        """``[N]``: each trained token's logprob under the weights of the version that sampled it (no gradient;
        ``current``, the current weights' logprobs, where the version is unknown, not kept or still current), the
        counts of each case (``guard/tokens_*``), and ``[N]`` True where the token was scored by its own version's
        weights or its version is unknown (what the guard measures)."""
        out = current.detach().clone()
        own = torch.ones_like(batch.rows, dtype=torch.bool)
        versions = batch.versions if batch.versions.numel() == out.numel() else torch.full_like(batch.rows, -1)
        counts = {"guard/tokens_own_version": 0.0, "guard/tokens_unknown_version": 0.0,
                  "guard/tokens_version_not_kept": 0.0}
        for version in torch.unique(versions).tolist():
            chosen = versions == version
            n = float(chosen.sum())
            if version < 0:
                counts["guard/tokens_unknown_version"] += n
            elif version == self.version and not self._changed:
                counts["guard/tokens_own_version"] += n
            elif version in self._kept:
                counts["guard/tokens_own_version"] += n
                out[chosen] = self._score(version, _sub_batch(batch, chosen)).to(out.dtype)
            else:
                counts["guard/tokens_version_not_kept"] += n
                own[chosen] = False
        return out, counts, own

    def _score(self, version: int, batch: TrainBatch) -> torch.Tensor:
        """The logprobs of ``batch``'s trained tokens under the kept weights of ``version``."""
        params = {f"model.{name}": value for name, value in self._kept[version].items()}
        with torch.no_grad():
            scored: torch.Tensor = torch.func.functional_call(self._scorer, params, (batch,))
        return scored

    def save(self, out_dir: Path) -> Path:
        return save_checkpoint(self.model, out_dir, self.model_dir)


class _Scorer(torch.nn.Module):
    """The trained-token logprobs as a module's forward, so :func:`torch.func.functional_call` runs them with other
    parameters (a kept version's) without touching the live ones."""

    def __init__(self, model: Any, fp32_head: bool) -> None:
        super().__init__()
        self.model = model
        self.fp32_head = fp32_head

    def forward(self, batch: TrainBatch) -> torch.Tensor:
        return trained_logprobs(self.model, batch, fp32_head=self.fp32_head)


def _sub_batch(batch: TrainBatch, chosen: torch.Tensor) -> TrainBatch:
    """The rows holding the ``chosen`` tokens, with those tokens only (the decoder runs over fewer rows)."""
    rows, inverse = torch.unique(batch.rows[chosen], return_inverse=True)
    return replace(batch, input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows], rows=inverse,
                   positions=batch.positions[chosen], targets=batch.targets[chosen],
                   old_logprobs=batch.old_logprobs[chosen], advantages=batch.advantages[chosen],
                   weights=batch.weights[chosen], versions=batch.versions[chosen])


def _frozen(model: Any) -> Any:
    """The reference policy of the KL term: evaluation mode, no gradients."""
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model
