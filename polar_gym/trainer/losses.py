"""The loss math, pure tensor functions with no model or I/O.

Definitions followed (cited per function):

- SFT: token-mean negative log-likelihood over the trained (mask-1) tokens of the whole batch.
- GRPO advantages: Shao et al. 2024, "DeepSeekMath" (arXiv 2402.03300) §4.1.2 outcome supervision,
  ``A_i = (r_i - mean(r)) / (std(r) + eps)`` within the group of samples of one prompt, given to every token of the
  sample; std is the unbiased sample std with ``eps = 1e-6`` as in verl's ``compute_grpo_outcome_advantage``.
  Unlike verl (which passes a lone sample's raw reward through), a group of one or with zero variance gets advantage
  0: it carries no relative signal.
- Policy loss: PPO's clipped surrogate (Schulman et al. 2017) per token ``l_t``, with DAPO's asymmetric clip
  ``[1 - eps_low, 1 + eps_high]``; ``ratio = exp(new - old)`` with the engine's captured logprobs as ``old``.
- Loss aggregation (:data:`Aggregation`, verl's ``loss_agg_mode`` names with underscores), each sequence ``s``
  weighted by ``w_s >= 0`` (the builder's session weight, so a session split into k traces counts once; a token's
  ``w_t`` is its sequence's); only sequences with trained tokens take part, and all weights 0 is an error:

  - ``token_mean`` (the default; what the trainer always did, unchanged for weight-1 traces):
    ``sum_t w_t l_t / sum_t w_t`` over all trained tokens of the batch (DAPO, Yu et al. 2025, arXiv 2503.14476,
    "token-level policy gradient loss": a long sequence has more say, in proportion to its tokens);
  - ``seq_mean_token_mean``: ``sum_s w_s mean_t(l_t in s) / sum_s w_s`` (the original GRPO objective, Shao et al.
    2024, arXiv 2402.03300 eq. 3: each sequence's mean, then the mean over sequences; a short answer weighs as
    much as a long one, so each of its tokens weighs more);
  - ``seq_mean_token_sum_norm``: ``sum_s w_s sum_t(l_t in s) / (sum_s w_s * loss_norm_tokens)`` (Dr.GRPO, Liu et
    al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783 §3.1: a sequence's token sum divided by a
    constant, the generation budget, instead of its length, which removes GRPO's length bias).
- Rollout correction (``trainer.rollout_correction``; truncated importance sampling, TIS, is its
  ``token_truncate``: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
  fengyao.notion.site/off-policy-rl): the surrogate is taken against the trainer's own logprobs before the update
  (``proximal``, detached) and each token is weighted by the importance weight of
  :func:`polar_gym.audit.correction.rollout_correction` (truncated or masked ``exp(proximal - rollout)``), which
  corrects for the engine sampling from a different distribution than the trainer computes (another dtype, an
  older policy version).
- Mismatch statistics (:func:`logprob_diff_stats`): :func:`polar_gym.audit.metrics.mismatch_metrics` over the
  step's trained tokens, under verl's names (``rollout_corr/k3_kl``, ``audit/logprob_abs_diff_max``, ...).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import get_args

import torch

from polar_gym.audit.metrics import mismatch_metrics
from polar_gym.trainer.settings import Aggregation

__all__ = [
    "GRPO_EPS",
    "Aggregation",
    "aggregate",
    "group_advantages",
    "kl_k3",
    "logprob_diff_stats",
    "policy_loss",
    "sft_loss",
    "shuffled_rewards",
]

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


def shuffled_rewards(rewards: Sequence[float], rng: random.Random) -> list[float]:
    """A permutation of one step's session rewards (``trainer.shuffle_rewards``, the control): advantages computed
    from it train on noise with the same reward distribution, so a curve that also rises under it is not learning
    from the reward. ``rng`` alone decides the order (same seed, same permutation)."""
    out = [float(r) for r in rewards]
    rng.shuffle(out)
    return out


def aggregate(terms: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, aggregation: Aggregation = "token_mean",
              *, loss_norm_tokens: int = 4096) -> torch.Tensor:
    """Per-token terms ``[N]`` to one scalar, each token ``k`` of sequence ``rows[k]`` with its sequence's weight
    ``weights[k]``; the three modes are defined in the module docstring."""
    if aggregation not in get_args(Aggregation):
        raise ValueError(f"unknown loss aggregation {aggregation!r}; use one of {', '.join(get_args(Aggregation))}")
    if not (terms.shape == weights.shape == rows.shape):
        raise ValueError("terms, weights and rows must align")
    if terms.numel() == 0:
        raise ValueError("no trained tokens in the batch")
    if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
        raise ValueError("sequence weights must be finite and >= 0")
    weights = weights.to(terms.dtype)
    if aggregation == "token_mean":
        total = weights.sum()
        if total.item() <= 0:
            raise ValueError("every trained sequence of the batch has weight 0: nothing to train on")
        return (weights * terms).sum() / total
    if loss_norm_tokens < 1:
        raise ValueError("loss_norm_tokens must be >= 1")
    unique, seq = torch.unique(rows, return_inverse=True)
    count = unique.numel()
    sums = torch.zeros(count, dtype=terms.dtype).index_add(0, seq, terms)
    lengths = torch.zeros(count, dtype=terms.dtype).index_add(0, seq, torch.ones_like(terms))
    seq_weights = torch.zeros(count, dtype=terms.dtype).scatter(0, seq, weights)
    if not torch.equal(seq_weights[seq], weights):
        raise ValueError("the tokens of one sequence must share its weight")
    total = seq_weights.sum()
    if total.item() <= 0:
        raise ValueError("every trained sequence of the batch has weight 0: nothing to train on")
    if aggregation == "seq_mean_token_mean":
        return (seq_weights * sums / lengths).sum() / total
    return (seq_weights * sums).sum() / (total * loss_norm_tokens)


def policy_loss(new: torch.Tensor, rollout: torch.Tensor, advantages: torch.Tensor, *, clip_low: float = 0.2,
                clip_high: float = 0.28, correction: torch.Tensor | None = None, weights: torch.Tensor | None = None,
                rows: torch.Tensor | None = None, aggregation: Aggregation = "token_mean",
                loss_norm_tokens: int = 4096) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped objective (to minimise), aggregated by ``aggregation`` (:func:`aggregate`), and its statistics;
    all tensors ``[N]`` over trained tokens. ``weights`` (each token's sequence weight) default to 1 and ``rows``
    (each token's sequence) to one sequence per token; the statistics are plain token means.

    Without ``correction``: ``ratio = exp(new - rollout)``. With it (each token's importance weight,
    :func:`polar_gym.audit.correction.rollout_correction`'s ``weights``; masked tokens are left out by the caller):
    ``ratio = exp(new - new.detach())`` (1 in value, the policy gradient in its derivative: one update per batch,
    so the proximal policy is the current one) and each token's term is multiplied by its weight.
    """
    if new.numel() == 0:
        raise ValueError("no trained tokens in the batch")
    if correction is None:
        log_ratio = new - rollout
        is_weight = torch.ones_like(new)
    else:
        if correction.shape != new.shape:
            raise ValueError("correction weights must align with the trained tokens")
        log_ratio = new - new.detach()
        is_weight = correction.detach().to(new.dtype)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    terms = -(is_weight * torch.minimum(unclipped, clipped))
    loss = aggregate(terms, torch.ones_like(new) if weights is None else weights,
                     torch.arange(new.numel()) if rows is None else rows, aggregation,
                     loss_norm_tokens=loss_norm_tokens)
    with torch.no_grad():
        clip_frac = ((unclipped > clipped) & (advantages != 0)).float().mean().item()
        stats = {"clip_fraction": clip_frac, "ratio_mean": ratio.mean().item()}
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


def kl_k3(new: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) on tokens the policy sampled: Schulman's k3,
    ``exp(ref - new) - (ref - new) - 1`` (>= 0, unbiased, low variance), the penalty of DeepSeekMath's GRPO objective
    (Shao et al. 2024, eq. 4; verl's ``low_var_kl``). Its gradient pulls each sampled token's logprob back toward the
    reference policy's, which keeps noisy updates from eroding what the reference knew."""
    delta = reference - new
    return torch.exp(delta) - delta - 1.0
