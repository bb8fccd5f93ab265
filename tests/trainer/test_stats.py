"""The learning-curve statistics, checked by hand: a mean and its standard error, a seeded bootstrap interval of a
difference of means, and confidence bands."""

from __future__ import annotations

import math

import pytest

from polar_gym.trainer import binomial_band, bootstrap_diff, mean_band, mean_se


def test_mean_se_by_hand_and_json_safe_for_one_value() -> None:
    mean, se = mean_se([1.0, 2.0, 3.0, 4.0])
    # sample variance (n - 1) = (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5 / 3; se = sqrt(5 / 3 / 4)
    assert mean == 2.5 and se == pytest.approx(math.sqrt(5 / 12))
    assert mean_se([0.0, 1.0]) == (0.5, pytest.approx(0.5))
    assert mean_se([0.7]) == (0.7, 0.0)  # one value: se 0.0, never nan
    assert mean_se([1, 1, 1]) == (1.0, 0.0)
    for bad in ([], [float("nan")], [1.0, float("inf")]):
        with pytest.raises(ValueError, match="mean_se"):
            mean_se(bad)


def test_bootstrap_is_seeded_contains_the_estimate_and_shrinks_with_more_data() -> None:
    later, earlier = [1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]
    point, low, high = bootstrap_diff(later, earlier, n_boot=4000, seed=3)
    assert point == 0.5 and low <= point <= high
    assert bootstrap_diff(later, earlier, n_boot=4000, seed=3) == (point, low, high)
    rewards = [0.3, 0.9, 0.1, 0.75, 0.6]  # not 0/1, so the interval's ends are not on a lattice the seed cannot move
    assert bootstrap_diff(rewards, earlier, seed=1) == bootstrap_diff(rewards, earlier, seed=1)
    assert bootstrap_diff(rewards, earlier, seed=1) != bootstrap_diff(rewards, earlier, seed=2)
    # the same proportions on 16x the sessions: the same estimate, a narrower interval that leaves 0 out
    big_point, big_low, big_high = bootstrap_diff(later * 16, earlier * 16, n_boot=4000, seed=3)
    assert big_point == 0.5 and big_low <= big_point <= big_high
    assert big_high - big_low < (high - low) / 2 and big_low > 0.0 and low <= 0.0
    # unequal sizes are fine (independent samples); a wider level gives a wider interval
    _, low99, high99 = bootstrap_diff(later * 16, earlier * 4, n_boot=4000, seed=3, level=0.99)
    _, low80, high80 = bootstrap_diff(later * 16, earlier * 4, n_boot=4000, seed=3, level=0.80)
    assert low99 < low80 and high80 < high99
    assert bootstrap_diff([2.0, 2.0], [0.5], n_boot=10) == (1.5, 1.5, 1.5)


def test_bootstrap_refuses_what_it_cannot_measure() -> None:
    with pytest.raises(ValueError, match="earlier: no values"):
        bootstrap_diff([1.0], [])
    with pytest.raises(ValueError, match="n_boot"):
        bootstrap_diff([1.0], [0.0], n_boot=0)
    with pytest.raises(ValueError, match="level"):
        bootstrap_diff([1.0], [0.0], level=1.0)


def test_bands_by_hand() -> None:
    low, high = binomial_band(0.5, 100)
    assert (low, high) == (pytest.approx(0.5 - 0.098), pytest.approx(0.5 + 0.098))
    assert binomial_band(0.95, 4)[1] == 1.0 and binomial_band(0.05, 4)[0] == 0.0  # clipped to [0, 1]
    assert binomial_band(0.0, 16) == (0.0, 0.0)
    assert binomial_band(0.5, 16, z=1.0) == (0.375, 0.625)
    with pytest.raises(ValueError, match="n must be"):
        binomial_band(0.5, 0)
    with pytest.raises(ValueError, match="p must be"):
        binomial_band(1.5, 4)
    mean, low, high = mean_band([1.0, 2.0, 3.0, 4.0], z=2.0)
    half = 2 * math.sqrt(5 / 12)
    assert mean == 2.5 and (low, high) == (pytest.approx(2.5 - half), pytest.approx(2.5 + half))
