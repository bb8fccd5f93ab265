"""Training/inference mismatch metrics over per-token logprobs, under verl's names (``rollout_corr/*`` from
``verl.trainer.ppo.rollout_corr_helper``, ``training/rollout_probs_*`` from its trainer's debug metrics).

Pure Python, no torch: a trainer passes lists (or anything with ``.tolist()``, e.g. a 1-D tensor of one sequence's
trained tokens) and logs :meth:`MismatchMetrics.as_dict`. Conventions, as in verl:

- ``training`` is log pi_train(y_t) (the recomputed logprob), ``rollout`` is log pi_rollout(y_t) (the engine's);
  ``log_ratio = training - rollout`` and the importance ratio is ``rho = exp(log_ratio)``, clamped to exp(+-20)
  before it is exponentiated.
- Token means run over every token of every sequence; perplexities, ``log_ppl_diff`` and ``ppl_ratio`` are the
  mean over sequences of a per-sequence value.
- A token whose logprob is not finite on either side (-inf from an engine, NaN) is counted in
  ``nonfinite_tokens`` and left out of every mean: one -inf must not turn every metric into inf, and an auditor
  treats any such token as a failure anyway.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "SAFETY_BOUND",
    "MismatchMetrics",
    "effective_sample_size",
    "importance_ratios",
    "k3_kl",
    "mismatch_metrics",
    "pearson",
]

#: log-ratio clamp before exponentiation (verl's SAFETY_BOUND): exp(20) ~ 4.9e8
SAFETY_BOUND = 20.0


def _floats(values: Any) -> list[float]:
    """A list of floats from a list, a tuple or a tensor/array (``.tolist()``)."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [float(v) for v in values]


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def importance_ratios(training: Iterable[float], rollout: Iterable[float]) -> list[float]:
    """Per-token ``rho = pi_train / pi_rollout = exp(clamp(training - rollout, +-20))``."""
    return [math.exp(max(-SAFETY_BOUND, min(SAFETY_BOUND, t - r)))
            for t, r in zip(_floats(training), _floats(rollout), strict=True)]


def k3_kl(training: Iterable[float], rollout: Iterable[float]) -> float:
    """Schulman's k3 estimator of KL(pi_rollout || pi_train) on rollout samples: mean of ``rho - log rho - 1``
    (>= 0 token by token, unbiased, low variance when the two policies are close). 0.0 for no tokens."""
    t, r = _floats(training), _floats(rollout)
    if not t:
        return 0.0
    terms = []
    for a, b in zip(t, r, strict=True):
        log_ratio = a - b
        terms.append(math.exp(max(-SAFETY_BOUND, min(SAFETY_BOUND, log_ratio))) - log_ratio - 1.0)
    return _mean(terms)


def pearson(xs: Iterable[float], ys: Iterable[float]) -> float | None:
    """Pearson correlation, or None when it is undefined (fewer than two points, or a constant side)."""
    x, y = _floats(xs), _floats(ys)
    if len(x) != len(y):
        raise ValueError(f"pearson: {len(x)} and {len(y)} values")
    if len(x) < 2:
        return None
    mx, my = _mean(x), _mean(y)
    sxy = math.fsum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sxx = math.fsum((a - mx) ** 2 for a in x)
    syy = math.fsum((b - my) ** 2 for b in y)
    if sxx <= 0.0 or syy <= 0.0:
        return None
    return max(-1.0, min(1.0, sxy / math.sqrt(sxx * syy)))


def effective_sample_size(weights: Iterable[float], lower: float | None = None,
                          upper: float | None = None) -> float:
    """verl's normalised ESS of importance weights, ``1 / mean((w / mean(w))^2)`` in (0, 1] (1: all equal), with
    the weights first clamped to ``[lower, upper]`` when given. 1.0 for no weights."""
    w = _floats(weights)
    if not w:
        return 1.0
    if lower is not None or upper is not None:
        w = [min(upper if upper is not None else v, max(lower if lower is not None else v, v)) for v in w]
    mean = _mean(w)
    normalised = [v / (mean + 1e-8) for v in w]
    second = _mean([v * v for v in normalised])
    return 1.0 / second if second > 0 else 1.0


@dataclass(frozen=True)
class MismatchMetrics:
    """What :func:`mismatch_metrics` measures; :meth:`as_dict` names each field as verl logs it."""

    tokens: int
    sequences: int
    nonfinite_tokens: int
    #: mean(rollout - training): the plain estimator of KL(pi_rollout || pi_train)
    kl: float
    #: mean(rho - log rho - 1): the k3 estimator of the same KL (the one to threshold)
    k3_kl: float
    training_ppl: float
    training_log_ppl: float
    rollout_ppl: float
    rollout_log_ppl: float
    #: mean over sequences of mean(rollout) - mean(training) = log(training_ppl_i / rollout_ppl_i)
    log_ppl_diff: float
    log_ppl_abs_diff: float
    log_ppl_diff_max: float
    log_ppl_diff_min: float
    ppl_ratio: float
    #: E[rho^2] - 1 over tokens, E[(prod rho)^2] - 1 over sequences
    chi2_token: float
    chi2_seq: float
    rollout_is_mean: float
    rollout_is_std: float
    rollout_is_max: float
    rollout_is_min: float
    #: share of tokens whose rho is above the threshold (2 by default) / below its inverse
    rollout_is_ratio_fraction_high: float
    rollout_is_ratio_fraction_low: float
    rollout_is_eff_sample_size: float
    #: |exp(training) - exp(rollout)|: verl's training/rollout_probs_diff_*
    probs_diff_max: float
    probs_diff_mean: float
    probs_diff_std: float
    probs_pearson_corr: float | None
    logprob_abs_diff_max: float
    logprob_abs_diff_mean: float
    logprob_pearson_corr: float | None

    def as_dict(self) -> dict[str, float | int | None]:
        """verl's metric names (``rollout_corr/...``, ``training/rollout_probs_...``), plus ``audit/...`` for what
        verl does not log (token counts, logprob-space differences)."""
        d = asdict(self)
        out: dict[str, float | int | None] = {
            "audit/tokens": d.pop("tokens"), "audit/sequences": d.pop("sequences"),
            "audit/nonfinite_tokens": d.pop("nonfinite_tokens"),
            "training/rollout_probs_diff_max": d.pop("probs_diff_max"),
            "training/rollout_probs_diff_mean": d.pop("probs_diff_mean"),
            "training/rollout_probs_diff_std": d.pop("probs_diff_std"),
            "training/rollout_actor_probs_pearson_corr": d.pop("probs_pearson_corr"),
            "audit/logprob_abs_diff_max": d.pop("logprob_abs_diff_max"),
            "audit/logprob_abs_diff_mean": d.pop("logprob_abs_diff_mean"),
            "audit/logprob_pearson_corr": d.pop("logprob_pearson_corr"),
        }
        out.update({f"rollout_corr/{k}": v for k, v in d.items()})
        return out


def _std(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = _mean(values)
    return math.sqrt(max(0.0, _mean([v * v for v in values]) - mean * mean))


def mismatch_metrics(training: Sequence[Any], rollout: Sequence[Any], is_threshold: float = 2.0,
                     is_threshold_lower: float | None = None) -> MismatchMetrics | None:
    """Every metric over a batch of sequences: ``training[i]`` and ``rollout[i]`` are the logprobs of sequence i's
    trained tokens (mask 1 only; lists or 1-D tensors of equal length). None when no finite token is left (an
    empty batch, empty sequences, all -inf): there is nothing to measure, and a caller counts that instead."""
    if len(training) != len(rollout):
        raise ValueError(f"{len(training)} training sequences and {len(rollout)} rollout sequences")
    upper = is_threshold
    lower = is_threshold_lower if is_threshold_lower is not None else 1.0 / upper
    seqs: list[tuple[list[float], list[float]]] = []
    nonfinite = 0
    for i, (t_raw, r_raw) in enumerate(zip(training, rollout, strict=True)):
        t_all, r_all = _floats(t_raw), _floats(r_raw)
        if len(t_all) != len(r_all):
            raise ValueError(f"sequence {i}: {len(t_all)} training and {len(r_all)} rollout logprobs")
        keep = [(a, b) for a, b in zip(t_all, r_all, strict=True) if math.isfinite(a) and math.isfinite(b)]
        nonfinite += len(t_all) - len(keep)
        if keep:
            seqs.append(([a for a, _ in keep], [b for _, b in keep]))
    if not seqs:
        return None
    t = [v for s, _ in seqs for v in s]
    r = [v for _, s in seqs for v in s]
    log_ratio = [a - b for a, b in zip(t, r, strict=True)]
    rho = [math.exp(max(-SAFETY_BOUND, min(SAFETY_BOUND, x))) for x in log_ratio]
    seq_train = [_mean(s) for s, _ in seqs]
    seq_roll = [_mean(s) for _, s in seqs]
    log_ppl_diff = [b - a for a, b in zip(seq_train, seq_roll, strict=True)]
    seq_log_ratio_sum = [math.fsum(a - b for a, b in zip(st, sr, strict=True)) for st, sr in seqs]
    abs_diff = [abs(x) for x in log_ratio]
    p_train = [math.exp(a) for a in t]
    p_roll = [math.exp(b) for b in r]
    probs_diff = [abs(a - b) for a, b in zip(p_train, p_roll, strict=True)]
    clamped = [min(upper, max(lower, w)) for w in rho]
    return MismatchMetrics(
        tokens=len(t), sequences=len(seqs), nonfinite_tokens=nonfinite,
        kl=_mean([b - a for a, b in zip(t, r, strict=True)]),
        k3_kl=_mean([w - x - 1.0 for w, x in zip(rho, log_ratio, strict=True)]),
        training_ppl=_mean([math.exp(-m) for m in seq_train]), training_log_ppl=-_mean(seq_train),
        rollout_ppl=_mean([math.exp(-m) for m in seq_roll]), rollout_log_ppl=-_mean(seq_roll),
        log_ppl_diff=_mean(log_ppl_diff), log_ppl_abs_diff=_mean([abs(x) for x in log_ppl_diff]),
        log_ppl_diff_max=max(log_ppl_diff), log_ppl_diff_min=min(log_ppl_diff),
        ppl_ratio=_mean([math.exp(x) for x in log_ppl_diff]),
        chi2_token=_mean([w * w for w in rho]) - 1.0,
        chi2_seq=_mean([math.exp(2.0 * max(-SAFETY_BOUND, min(SAFETY_BOUND, s))) for s in seq_log_ratio_sum]) - 1.0,
        rollout_is_mean=_mean(rho), rollout_is_std=_std(clamped), rollout_is_max=max(rho), rollout_is_min=min(rho),
        rollout_is_ratio_fraction_high=sum(w > upper for w in rho) / len(rho),
        rollout_is_ratio_fraction_low=sum(w < lower for w in rho) / len(rho),
        rollout_is_eff_sample_size=effective_sample_size(rho, lower, upper),
        probs_diff_max=max(probs_diff), probs_diff_mean=_mean(probs_diff), probs_diff_std=_std(probs_diff),
        probs_pearson_corr=pearson(p_train, p_roll),
        logprob_abs_diff_max=max(abs_diff), logprob_abs_diff_mean=_mean(abs_diff),
        logprob_pearson_corr=pearson(t, r),
    )
