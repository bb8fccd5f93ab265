"""The mismatch metrics against values worked out by hand, and their edge cases (empty, one token, -inf)."""

from __future__ import annotations

import math

import pytest

from polar_gym.audit.metrics import (
    MismatchMetrics,
    effective_sample_size,
    importance_ratios,
    k3_kl,
    mismatch_metrics,
    pearson,
)

E05 = math.exp(0.5)


def test_two_tokens_by_hand() -> None:
    # token 1 agrees; token 2: training says -2.0, the engine said -2.5, so rho = e^0.5
    m = mismatch_metrics([[-1.0, -2.0]], [[-1.0, -2.5]])
    assert m is not None
    assert (m.tokens, m.sequences, m.nonfinite_tokens) == (2, 1, 0)
    assert m.kl == pytest.approx(-0.25)  # mean(rollout - training) = (0 - 0.5) / 2
    assert m.k3_kl == pytest.approx((E05 - 0.5 - 1.0) / 2)  # (rho - log rho - 1) is 0 for the first token
    assert m.training_log_ppl == pytest.approx(1.5) and m.rollout_log_ppl == pytest.approx(1.75)
    assert m.training_ppl == pytest.approx(math.exp(1.5)) and m.rollout_ppl == pytest.approx(math.exp(1.75))
    assert m.log_ppl_diff == pytest.approx(-0.25) and m.log_ppl_abs_diff == pytest.approx(0.25)
    assert m.ppl_ratio == pytest.approx(math.exp(-0.25))
    assert m.chi2_token == pytest.approx((1 + E05**2) / 2 - 1)
    assert m.chi2_seq == pytest.approx(math.exp(1.0) - 1)  # (prod rho)^2 - 1 for the one sequence
    assert m.rollout_is_mean == pytest.approx((1 + E05) / 2)
    assert m.rollout_is_max == pytest.approx(E05) and m.rollout_is_min == pytest.approx(1.0)
    assert m.rollout_is_ratio_fraction_high == 0.0 and m.rollout_is_ratio_fraction_low == 0.0
    mean = (1 + E05) / 2
    assert m.rollout_is_eff_sample_size == pytest.approx(1 / (((1 / mean) ** 2 + (E05 / mean) ** 2) / 2), rel=1e-6)
    assert m.logprob_abs_diff_max == pytest.approx(0.5) and m.logprob_abs_diff_mean == pytest.approx(0.25)
    assert m.probs_diff_max == pytest.approx(math.exp(-2.0) - math.exp(-2.5))
    assert m.logprob_pearson_corr == pytest.approx(1.0)  # two points are always perfectly correlated


def test_verl_names() -> None:
    m = mismatch_metrics([[-1.0, -2.0]], [[-1.0, -2.5]])
    assert m is not None
    d = m.as_dict()
    assert d["rollout_corr/k3_kl"] == m.k3_kl and d["rollout_corr/log_ppl_diff"] == m.log_ppl_diff
    assert d["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0
    assert d["rollout_corr/rollout_is_eff_sample_size"] == m.rollout_is_eff_sample_size
    assert d["training/rollout_actor_probs_pearson_corr"] == m.probs_pearson_corr
    assert d["audit/logprob_abs_diff_max"] == 0.5 and d["audit/tokens"] == 2
    assert len(d) == len(MismatchMetrics.__dataclass_fields__)


def test_identical_logprobs_are_a_perfect_match() -> None:
    lp = [[-0.1, -3.0, -7.5], [-2.0]]
    m = mismatch_metrics(lp, lp)
    assert m is not None
    assert m.k3_kl == 0.0 and m.kl == 0.0 and m.logprob_abs_diff_max == 0.0 and m.chi2_token == 0.0
    assert m.rollout_is_eff_sample_size == pytest.approx(1.0) and m.logprob_pearson_corr == pytest.approx(1.0)


def test_ratio_above_two_and_sequence_means() -> None:
    # sequence 1: rho = e^1 > 2 for its one token; sequence 2: rho = 1
    m = mismatch_metrics([[-1.0], [-2.0, -2.0]], [[-2.0], [-2.0, -2.0]])
    assert m is not None
    assert m.rollout_is_ratio_fraction_high == pytest.approx(1 / 3)  # token share, not sequence share
    assert m.log_ppl_diff == pytest.approx((-1.0 + 0.0) / 2)  # mean over sequences
    assert m.rollout_is_max == pytest.approx(math.e)
    # ESS clamps to [0.5, 2]: weights 2, 1, 1
    assert m.rollout_is_eff_sample_size == pytest.approx(effective_sample_size([2.0, 1.0, 1.0]))


def test_empty_inputs_measure_nothing() -> None:
    assert mismatch_metrics([], []) is None
    assert mismatch_metrics([[]], [[]]) is None
    assert k3_kl([], []) == 0.0 and effective_sample_size([]) == 1.0


def test_single_token_has_no_pearson() -> None:
    m = mismatch_metrics([[-1.0]], [[-1.5]])
    assert m is not None and m.tokens == 1
    assert m.logprob_pearson_corr is None and m.probs_pearson_corr is None
    assert m.rollout_is_std == 0.0 and m.logprob_abs_diff_max == pytest.approx(0.5)


def test_nonfinite_tokens_are_counted_and_left_out() -> None:
    m = mismatch_metrics([[-1.0, -2.0, float("nan")]], [[-1.0, float("-inf"), -1.0]])
    assert m is not None
    assert m.nonfinite_tokens == 2 and m.tokens == 1 and m.k3_kl == 0.0
    assert mismatch_metrics([[float("-inf")]], [[-1.0]]) is None  # nothing finite left


def test_helpers() -> None:
    assert importance_ratios([-1.0, 0.0], [-1.0, -100.0]) == [1.0, pytest.approx(math.exp(20))]  # clamped at e^20
    assert k3_kl([-1.0, -2.0], [-1.0, -2.5]) == pytest.approx((E05 - 1.5) / 2)
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert pearson([1, 1, 1], [1, 2, 3]) is None
    assert effective_sample_size([1.0, 1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert effective_sample_size([4.0, 0.0]) == pytest.approx(0.5, rel=1e-6)  # one sample carries all the weight


def test_tensors_are_accepted() -> None:
    torch = pytest.importorskip("torch")
    m = mismatch_metrics([torch.tensor([-1.0, -2.0])], [torch.tensor([-1.0, -2.5])])
    assert m is not None and m.k3_kl == pytest.approx((E05 - 1.5) / 2)


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError):
        mismatch_metrics([[-1.0]], [[-1.0, -2.0]])
    with pytest.raises(ValueError):
        mismatch_metrics([[-1.0]], [])
