"""Small statistics for learning curves, in pure Python (no torch, no numpy): a run's metrics and the benchmark's
acceptance lines use them, and both must stay JSON-safe (no nan in ``train_metrics.jsonl``).

- :func:`mean_se`: a mean and its standard error (sample std / sqrt(n)); one value has se 0.0, not nan, so report
  ``n`` beside it to tell "no spread measured" from "no spread".
- :func:`bootstrap_diff`: the difference of two means (later - earlier) with a seeded percentile bootstrap
  interval, each side resampled on its own (the two samples are independent sessions).
- :func:`binomial_band` and :func:`mean_band`: a curve's confidence band, mean +- z * se, clipped where the
  quantity is bounded.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

__all__ = ["binomial_band", "bootstrap_diff", "mean_band", "mean_se"]


def _values(values: Sequence[float], what: str) -> list[float]:
    out = [float(v) for v in values]
    if not out:
        raise ValueError(f"{what}: no values (a mean of nothing is not a measurement)")
    if not all(math.isfinite(v) for v in out):
        raise ValueError(f"{what}: non-finite value in {out[:8]}")
    return out


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """``(mean, standard error)``, the error from the sample standard deviation (n - 1); fewer than two values give
    se 0.0 (JSON-safe; the caller logs ``n`` so a reader can tell). Empty or non-finite input raises ValueError."""
    xs = _values(values, "mean_se")
    n = len(xs)
    mean = math.fsum(xs) / n
    if n < 2:
        return mean, 0.0
    var = math.fsum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, math.sqrt(var / n)


def _percentile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default "linear" method)."""
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def bootstrap_diff(later: Sequence[float], earlier: Sequence[float], *, n_boot: int = 10000, seed: int = 0,
                   level: float = 0.95) -> tuple[float, float, float]:
    """``(mean(later) - mean(earlier), low, high)``: the point estimate and its percentile bootstrap interval at
    ``level``. Each side is resampled with replacement independently (independent sessions, unequal sizes
    allowed), ``n_boot`` times from ``random.Random(seed)``, so the same inputs give the same interval."""
    a, b = _values(later, "bootstrap_diff later"), _values(earlier, "bootstrap_diff earlier")
    if n_boot < 1:
        raise ValueError(f"bootstrap_diff: n_boot must be >= 1 (got {n_boot})")
    if not 0.0 < level < 1.0:
        raise ValueError(f"bootstrap_diff: level must be in (0, 1) (got {level})")
    rng = random.Random(seed)
    point = math.fsum(a) / len(a) - math.fsum(b) / len(b)
    diffs = sorted(math.fsum(rng.choices(a, k=len(a))) / len(a) - math.fsum(rng.choices(b, k=len(b))) / len(b)
                   for _ in range(n_boot))
    tail = (1.0 - level) / 2.0
    return point, _percentile(diffs, tail), _percentile(diffs, 1.0 - tail)


def binomial_band(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """``(low, high)`` = p +- z * sqrt(p (1 - p) / n), clipped to [0, 1]: the band of a success rate measured on
    ``n`` sessions (Wald interval; at p = 0 or 1 it has no width, which a plot shows as it is)."""
    if n < 1:
        raise ValueError(f"binomial_band: n must be >= 1 (got {n})")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"binomial_band: p must be in [0, 1] (got {p})")
    half = z * math.sqrt(p * (1.0 - p) / n)
    return max(0.0, p - half), min(1.0, p + half)


def mean_band(values: Sequence[float], z: float = 1.96) -> tuple[float, float, float]:
    """``(mean, low, high)`` = mean +- z * se (:func:`mean_se`), for rewards that are not just 0/1; not clipped
    (the caller knows its bounds)."""
    mean, se = mean_se(values)
    return mean, mean - z * se, mean + z * se
