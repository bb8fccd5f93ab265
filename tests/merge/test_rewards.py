"""Rewards on trajectories: outcome broadcast, per-trace rewards (length-checked), session weights that make one
session count once whatever the builder (the paper's fix for reward hacking under per_request)."""

from __future__ import annotations

import math
from typing import get_args

import pytest

from polar_gym.merge import RewardError, apply_rewards, session_weights, with_session_weights
from polar_gym.merge.base import MergeConfig
from polar_gym.merge.per_request import per_request
from polar_gym.merge.prefix_merging import prefix_merging
from polar_gym.merge.rewards import Weighting
from polar_gym.schema import EvalResult
from tests.merge._sessions import EOT, rec, session

CFG = MergeConfig(end_of_turn_ids=(EOT,))

# A main chain of three turns and one sub-agent call: prefix_merging gives 2 traces, per_request 4.
RECORDS = (rec(0, [1, 2], [10, 11, EOT]), rec(1, [1, 2, 10, 11, EOT, 50], [12, EOT]),
           rec(2, [200, 201], [30, EOT]), rec(3, [1, 2, 10, 11, EOT, 50, 12, EOT, 51], [13, 14, 15, EOT]))


@pytest.fixture(params=["per_request", "prefix_merging"])
def traj(request):
    builder = {"per_request": per_request, "prefix_merging": prefix_merging}[request.param]
    return builder(session(*RECORDS), CFG)


def test_outcome_reward_is_broadcast_to_every_trace(traj):
    out = apply_rewards(traj, EvalResult(reward=0.75, passed=True))
    assert [t.reward for t in out.traces] == [0.75] * len(traj.traces)
    assert all(t.metadata["outcome_reward"] == 0.75 for t in out.traces)
    assert all(t.reward is None and "weight" not in t.metadata for t in traj.traces)  # the input is untouched
    assert [t.response_ids for t in out.traces] == [t.response_ids for t in traj.traces]


def test_per_trace_rewards_are_applied_in_trace_order(traj):
    rewards = [float(i) for i in range(len(traj.traces))]
    out = apply_rewards(traj, EvalResult(reward=1.0, per_trace_rewards=rewards))
    assert [t.reward for t in out.traces] == rewards
    assert {t.metadata["outcome_reward"] for t in out.traces} == {1.0}


def test_per_trace_rewards_of_the_wrong_length_fail_clearly(traj):
    n = len(traj.traces)
    with pytest.raises(RewardError, match=rf"has {n + 1} values .* has {n} traces \(builder '{traj.builder}'\)"):
        apply_rewards(traj, EvalResult(reward=1.0, per_trace_rewards=[0.0] * (n + 1)))


@pytest.mark.parametrize("weighting", ["traces", "tokens"])
def test_one_session_counts_once_under_either_builder(weighting):
    for builder in (per_request, prefix_merging):
        out = apply_rewards(builder(session(*RECORDS), CFG), EvalResult(reward=1.0), weighting)
        assert math.isclose(sum(t.metadata["weight"] for t in out.traces), 1.0)
        assert {t.metadata["weighting"] for t in out.traces} == {weighting}
    # the weighted reward mass is the same whatever the builder: no incentive to make more calls
    masses = [sum(t.reward * t.metadata["weight"] for t in apply_rewards(b(session(*RECORDS), CFG),
                                                                          EvalResult(reward=1.0), weighting).traces)
              for b in (per_request, prefix_merging)]
    assert math.isclose(masses[0], masses[1])


def test_token_weights_follow_trainable_tokens():
    traj = prefix_merging(session(*RECORDS), CFG)
    assert [sum(t.loss_mask) for t in traj.traces] == [9, 2]  # main chain: 3+2+4 sampled tokens; sub-agent: 2
    assert session_weights(traj.traces, "tokens") == pytest.approx([9 / 11, 2 / 11])
    assert session_weights(traj.traces, "traces") == [0.5, 0.5]
    assert session_weights(traj.traces, "none") == [1.0, 1.0]


def test_token_weights_fall_back_to_uniform_when_nothing_is_trainable():
    traj = per_request(session(*RECORDS), CFG)
    masked = [t.model_copy(update={"loss_mask": [0] * len(t.loss_mask)}) for t in traj.traces]
    assert session_weights(masked, "tokens") == [0.25] * 4


def test_empty_trajectory_and_unknown_weighting():
    empty = per_request(session(), CFG)
    assert apply_rewards(empty, EvalResult(reward=1.0)).traces == []
    assert apply_rewards(empty, EvalResult(reward=1.0, per_trace_rewards=[])).traces == []
    with pytest.raises(ValueError, match="unknown weighting"):
        session_weights(per_request(session(*RECORDS), CFG).traces, "sessions")  # type: ignore[arg-type]


def test_weights_without_rewards_keep_existing_rewards():
    traj = apply_rewards(per_request(session(*RECORDS), CFG), EvalResult(reward=0.5))
    out = with_session_weights(traj, "none")
    assert [t.reward for t in out.traces] == [0.5] * 4 and [t.metadata["weight"] for t in out.traces] == [1.0] * 4


def test_one_trainable_token_is_enough_to_weight_by_tokens():
    """Falling back to uniform weights is for a session with nothing trainable, not one with very little."""
    traj = per_request(session(*RECORDS), CFG)
    masks = [[0] * len(t.loss_mask) for t in traj.traces]
    masks[2][-1] = 1
    traces = [t.model_copy(update={"loss_mask": m}) for t, m in zip(traj.traces, masks, strict=True)]
    assert session_weights(traces, "tokens") == [0.0, 0.0, 1.0, 0.0]


def test_the_weighting_type_names_every_mode_session_weights_accepts():
    """``Weighting`` is the public list of modes (for configs and type checkers): each of them works, none is
    missing."""
    traces = per_request(session(*RECORDS), CFG).traces
    assert set(get_args(Weighting)) == {"traces", "tokens", "none"}
    for mode in get_args(Weighting):
        assert len(session_weights(traces, mode)) == len(traces)
