"""Rollout-correction importance weights: how much each sampled token counts in a policy-gradient loss when the
engine that sampled it (another dtype, other kernels, an older policy version) gave it a different probability than
the weights being trained.

Pure torch, no model and no I/O, so any trainer can import them (``polar_gym.bridges.correction`` and
``polar_gym.trainer.correction`` re-export this module; the reference trainer applies them with
``trainer.rollout_correction``). Definitions (our code, following the two menus trainers ship):

- ms-swift's ``rollout_importance_sampling_mode`` with ``rollout_importance_sampling_threshold`` C (2.0 by default
  there; ms-swift PR 6678, ``GRPOTrainer._apply_rollout_importance_sampling``), and verl's ``rollout_is`` (token /
  sequence truncated weights) with ``rollout_rs`` (rejection: masking), ``verl.trainer.ppo.rollout_corr_helper``.
  With the per-token log-ratio ``d_t = clamp(train_t - rollout_t, +-20)`` (``train`` detached: the trainer's
  logprob before the update, ``rollout`` the engine's captured one) and ``rho_t = exp(d_t)``:

  - ``token_truncate``: ``w_t = min(rho_t, C)`` (truncated IS, "TIS", Yao et al. 2025);
  - ``token_mask``: ``w_t = rho_t`` if ``rho_t <= C`` else the token is masked (not trained, ``w_t = 0``);
  - ``sequence_truncate``: the sequence's geometric-mean ratio ``rho_s = exp(mean_t d_t)`` (the length-normalised
    sequence ratio both menus use), ``w_t = min(rho_s, C)`` for every token of the sequence;
  - ``sequence_mask``: ``w_t = rho_t`` if ``rho_s <= C`` else every token of the sequence is masked;
  - ``none``: ``w_t = 1``, nothing masked.

  Only the upper threshold is applied (as ms-swift does); a ratio far below 1 already weighs little.
- Statistics (:func:`correction_stats`), under ``rollout_corr/correction_*`` (verl's ``rollout_corr/`` prefix; the
  ``correction_`` part keeps them apart from :func:`polar_gym.audit.metrics.mismatch_metrics`' raw-ratio
  ``rollout_corr/rollout_is_*``): the applied weights' mean / max / min, the normalised effective sample size
  ``(sum w)^2 / (n sum w^2)`` over the kept tokens (1: every token counts alike), the share of tokens whose weight
  was truncated, the shares of tokens masked and of sequences with a masked token (verl's
  ``rollout_rs_masked_fraction`` / ``rollout_rs_seq_masked_fraction``), the share of sequences whose ``rho_s``
  is above C, and the k3 KL of the trained against the rollout logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

__all__ = ["CorrectionMode", "RolloutCorrection", "correction_stats", "rollout_correction", "sequence_log_ratios"]

#: the correction menu (ms-swift's ``rollout_importance_sampling_mode`` names, plus ``none``)
CorrectionMode = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]

#: log-ratio clamp before exponentiation (verl's and ms-swift's SAFETY_BOUND)
SAFETY_BOUND = 20.0


@dataclass(frozen=True)
class RolloutCorrection:
    """``weights`` ``[N]`` (detached, 0 where masked) multiply each token's loss term; ``masked`` ``[N]`` (bool)
    marks the tokens the correction drops (a trainer leaves them out of the loss and its denominator, and counts
    them); ``stats`` are :func:`correction_stats`."""

    weights: torch.Tensor
    masked: torch.Tensor
    stats: dict[str, float]


def sequence_log_ratios(log_ratio: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[N]``: each token's sequence mean of ``log_ratio`` (``rows[k]`` is token k's sequence), i.e. the log of the
    sequence's geometric-mean ratio, broadcast back to its tokens."""
    if log_ratio.shape != rows.shape:
        raise ValueError("log_ratio and rows must align")
    if log_ratio.numel() == 0:
        return log_ratio.clone()
    _, seq = torch.unique(rows, return_inverse=True)
    count = int(seq.max().item()) + 1
    sums = torch.zeros(count, dtype=log_ratio.dtype).index_add(0, seq, log_ratio)
    lengths = torch.zeros(count, dtype=log_ratio.dtype).index_add(0, seq, torch.ones_like(log_ratio))
    means: torch.Tensor = (sums / lengths)[seq]
    return means


def rollout_correction(train: torch.Tensor, rollout: torch.Tensor, rows: torch.Tensor | None = None,
                       mode: CorrectionMode = "token_truncate", threshold: float = 2.0) -> RolloutCorrection:
    """The weights of ``mode`` for tokens with trainer logprobs ``train`` and engine logprobs ``rollout`` (``[N]``
    each; ``rows[k]``: token k's sequence, default one sequence per token); see the module docstring."""
    if mode not in get_args(CorrectionMode):
        raise ValueError(f"unknown rollout correction {mode!r}; use one of {', '.join(get_args(CorrectionMode))}")
    if not threshold > 0:
        raise ValueError(f"the correction threshold must be > 0, not {threshold!r}")
    if train.shape != rollout.shape:
        raise ValueError("train and rollout logprobs must align")
    rows = torch.arange(train.numel()) if rows is None else rows
    with torch.no_grad():
        log_ratio = torch.clamp(train.detach().double() - rollout.double(), -SAFETY_BOUND, SAFETY_BOUND)
        rho = torch.exp(log_ratio)
        seq_rho = torch.exp(sequence_log_ratios(log_ratio, rows))
        masked = torch.zeros_like(rho, dtype=torch.bool)
        truncated = torch.zeros_like(masked)
        if mode == "none":
            weights = torch.ones_like(rho)
        elif mode == "token_truncate":
            truncated = rho > threshold
            weights = torch.clamp(rho, max=threshold)
        elif mode == "token_mask":
            masked = rho > threshold
            weights = torch.where(masked, torch.zeros_like(rho), rho)
        elif mode == "sequence_truncate":
            truncated = seq_rho > threshold
            weights = torch.clamp(seq_rho, max=threshold)
        else:  # sequence_mask
            masked = seq_rho > threshold
            weights = torch.where(masked, torch.zeros_like(rho), rho)
        stats = correction_stats(weights, masked, truncated, log_ratio, seq_rho, rows, threshold)
    return RolloutCorrection(weights.to(train.dtype), masked, stats)


def correction_stats(weights: torch.Tensor, masked: torch.Tensor, truncated: torch.Tensor, log_ratio: torch.Tensor,
                     seq_rho: torch.Tensor, rows: torch.Tensor, threshold: float) -> dict[str, float]:
    """The correction's statistics (names in the module docstring); all 0-safe for an empty batch."""
    n = weights.numel()
    if n == 0:
        return {}
    kept = weights[~masked]
    ess = float(kept.sum() ** 2 / (kept.numel() * (kept * kept).sum())) if kept.numel() and float(
        (kept * kept).sum()) > 0 else 0.0
    _, seq = torch.unique(rows, return_inverse=True)
    count = int(seq.max().item()) + 1
    seq_masked = torch.zeros(count, dtype=torch.float64).index_add(0, seq, masked.double()) > 0
    seq_high = torch.zeros(count, dtype=torch.float64).scatter(0, seq, seq_rho.double()) > threshold
    rho = torch.exp(log_ratio)
    return {
        "rollout_corr/correction_is_mean": float(weights.mean()),
        "rollout_corr/correction_is_max": float(weights.max()),
        "rollout_corr/correction_is_min": float(weights.min()),
        "rollout_corr/correction_is_eff_sample_size": ess,
        "rollout_corr/correction_truncated_fraction": float(truncated.double().mean()),
        "rollout_corr/correction_masked_fraction": float(masked.double().mean()),
        "rollout_corr/correction_seq_masked_fraction": float(seq_masked.double().mean()),
        "rollout_corr/correction_seq_fraction_high": float(seq_high.double().mean()),
        "rollout_corr/correction_k3_kl": float((rho - log_ratio - 1.0).mean()),
        "masked_tokens/rollout_correction": float(masked.sum()),
    }
