"""The loss math, pure tensor functions with no model or I/O.

Definitions followed (cited per function):

- SFT: token-mean negative log-likelihood over the trained (mask-1) tokens of the whole batch.
- GRPO advantages: Shao et al. 2024, "DeepSeekMath" (arXiv 2402.03300) §4.1.2 outcome supervision,
  ``A_i = (r_i - mean(r)) / (std(r) + eps)`` within the group of samples of one prompt, given to every token of the
  sample; std is the unbiased sample std with ``eps = 1e-6`` as in verl's ``compute_grpo_outcome_advantage``.
  Unlike verl (which passes a lone sample's raw reward through), a group of one or with zero variance gets advantage
  0: it carries no relative signal.
- Policy loss: PPO's clipped surrogate (Schulman et al. 2017) at token level, averaged over all trained tokens of
  the batch (DAPO, Yu et al. 2025, arXiv 2503.14476 "token-level policy gradient loss"), with DAPO's asymmetric clip
  ``[1 - eps_low, 1 + eps_high]``; ``ratio = exp(new - old)`` with the engine's captured logprobs as ``old``.
- Truncated importance sampling (TIS): Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
  RL Training" (fengyao.notion.site/off-policy-rl; verl ``rollout_is`` / ``tis_imp_ratio_cap``): the surrogate is
  taken against the trainer's own logprobs before the update (``proximal``, detached) and each token is weighted by
  ``min(exp(proximal - rollout), C)``, which corrects for the engine sampling from a slightly different
  distribution than the trainer computes.
- Mismatch statistics (:func:`logprob_diff_stats`): :func:`polar_gym.audit.metrics.mismatch_metrics` over the
  step's trained tokens, under verl's names (``rollout_corr/k3_kl``, ``audit/logprob_abs_diff_max``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from polar_gym.audit.metrics import mismatch_metrics

__all__ = ["GRPO_EPS", "group_advantages", "logprob_diff_stats", "policy_loss", "sft_loss"]

GRPO_EPS = 1e-6


def sft_loss(logprobs: torch.Tensor) -> torch.Tensor:
    """Token-mean NLL over the trained tokens (``logprobs`` is ``[N]``, all trained)."""
    if logprobs.numel() == 0:
        raise ValueError("no trained tokens in the batch")
    return -logprobs.mean()


def group_advantages(rewards: Sequence[float], groups: Sequence[str], eps: float = GRPO_EPS) -> list[float]:
    """GRPO's group-normalised advantage of each sample (same order as ``rewards``); see the module docstring."""
    if len(rewards) != len(groups):
        raise ValueError("rewards and groups must align")
    members: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        values = [float(rewards[i]) for i in idx]
        if len(values) < 2:
            continue
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
        if var == 0.0:
            continue
        std = math.sqrt(var)
        for i in idx:
            out[i] = (float(rewards[i]) - mean) / (std + eps)
    return out


def policy_loss(new: torch.Tensor, rollout: torch.Tensor, advantages: torch.Tensor, *, clip_low: float = 0.2,
                clip_high: float = 0.28, tis_cap: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The token-level clipped objective (to minimise) and its statistics; all tensors ``[N]`` over trained tokens.

    Without ``tis_cap``: ``ratio = exp(new - rollout)``. With it: ``ratio = exp(new - new.detach())`` (1 in value,
    the policy gradient in its derivative: one update per batch, so the proximal policy is the current one) and
    each token's term is weighted by ``min(exp(new.detach() - rollout), tis_cap)``.
    """
    if new.numel() == 0:
        raise ValueError("no trained tokens in the batch")
    if tis_cap is None:
        log_ratio = new - rollout
        weight = torch.ones_like(new)
    else:
        proximal = new.detach()
        log_ratio = new - proximal
        weight = torch.clamp(torch.exp(proximal - rollout), max=tis_cap)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -(weight * torch.minimum(unclipped, clipped)).mean()
    with torch.no_grad():
        clip_frac = ((unclipped > clipped) & (advantages != 0)).float().mean().item()
        stats = {"clip_fraction": clip_frac, "ratio_mean": ratio.mean().item(),
                 "tis_weight_mean": weight.mean().item(),
                 "tis_capped_fraction": 0.0 if tis_cap is None else
                 (torch.exp(new.detach() - rollout) > tis_cap).float().mean().item()}
    return loss, stats


def logprob_diff_stats(train: torch.Tensor, rollout: torch.Tensor, rows: torch.Tensor) -> Mapping[str, float]:
    """Trainer vs engine logprobs of the same tokens (``[N]`` each, token ``k`` from batch row ``rows[k]``): the
    mismatch metrics of :mod:`polar_gym.audit.metrics` (verl's names), one sequence per row, so a step's log and
    an audit of its traces say the same thing under the same names."""
    if train.numel() == 0:
        return {}
    t, r, row = train.detach().double().tolist(), rollout.double().tolist(), rows.tolist()
    by_row: dict[int, tuple[list[float], list[float]]] = {}
    for a, b, k in zip(t, r, row, strict=True):
        seq = by_row.setdefault(k, ([], []))
        seq[0].append(a)
        seq[1].append(b)
    metrics = mismatch_metrics([s[0] for s in by_row.values()], [s[1] for s in by_row.values()])
    if metrics is None:
        return {}
    return {k: float(v) for k, v in metrics.as_dict().items() if v is not None}
