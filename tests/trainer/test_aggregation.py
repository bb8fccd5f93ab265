"""The GRPO loss's aggregation modes and trace weights, and the shuffled-reward control, against values computed by
hand (the three modes are defined in :mod:`polar_gym.trainer.losses`)."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import get_args

import pytest
import torch

from polar_gym.schema import EvalResult, SessionResult, SessionStatus, Trace, Trajectory
from polar_gym.trainer import Trainer, TrainerSettings, collate, group_advantages, grpo_sequences, trained_logprobs
from polar_gym.trainer.batch import TrainSequence
from polar_gym.trainer.correction import rollout_correction
from polar_gym.trainer.losses import Aggregation, aggregate, policy_loss, shuffled_rewards
from tests.trainer._tiny import small_qwen3_dir

MODES: tuple[Aggregation, ...] = get_args(Aggregation)

# five per-token terms: sequence 0 has three tokens, sequence 1 two; sequence 1 weighs 2
TERMS = [1.0, 2.0, 3.0, 4.0, 6.0]
ROWS = [0, 0, 0, 1, 1]
WEIGHTS = [1.0, 1.0, 1.0, 2.0, 2.0]
#: token_mean: (1+2+3 + 2*4+2*6) / (1+1+1+2+2); seq_mean_token_mean: (1*2 + 2*5) / (1+2);
#: seq_mean_token_sum_norm with 10 tokens: (1*6 + 2*10) / ((1+2) * 10)
EXPECTED = {"token_mean": 26 / 7, "seq_mean_token_mean": 4.0, "seq_mean_token_sum_norm": 26 / 30}


def _agg(terms: list[float], rows: list[int], weights: list[float], mode: Aggregation, norm: int = 10) -> float:
    return aggregate(torch.tensor(terms), torch.tensor(weights), torch.tensor(rows), mode,
                     loss_norm_tokens=norm).item()


@pytest.mark.parametrize("mode", MODES)
def test_each_aggregation_gives_its_hand_computed_value(mode: Aggregation) -> None:
    assert _agg(TERMS, ROWS, WEIGHTS, mode) == pytest.approx(EXPECTED[mode])


def test_the_default_is_token_mean_and_equals_the_old_unweighted_formula() -> None:
    """Weight-1 traces under the default train exactly as before the weights existed: ``-(w_is * min(...)).mean()``
    over all trained tokens, with and without truncated importance sampling."""
    assert TrainerSettings().loss_aggregation == "token_mean"
    g = torch.Generator().manual_seed(3)
    new, old = -torch.rand(12, generator=g) * 3, -torch.rand(12, generator=g) * 3
    adv = torch.randn(12, generator=g)
    rows = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4])
    for cap in (None, 1.5):
        ratio = torch.exp(new - new.detach()) if cap is not None else torch.exp(new - old)
        is_weight = torch.ones(12) if cap is None else torch.clamp(torch.exp(new - old), max=cap)
        old_formula = -(is_weight * torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.28) * adv)).mean()
        correction = None if cap is None else rollout_correction(new, old, mode="token_truncate", threshold=cap).weights
        loss, _ = policy_loss(new, old, adv, correction=correction, weights=torch.ones(12), rows=rows)
        assert loss.item() == pytest.approx(old_formula.item(), rel=1e-6)
        unweighted = policy_loss(new, old, adv, correction=correction)[0]
        assert unweighted.item() == pytest.approx(old_formula.item(), rel=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_weight_zero_removes_a_sequence(mode: Aggregation) -> None:
    alone = _agg([4.0, 6.0], [1, 1], [2.0, 2.0], mode)
    assert _agg(TERMS, ROWS, [0.0, 0.0, 0.0, 2.0, 2.0], mode) == pytest.approx(alone)
    terms = torch.tensor(TERMS, requires_grad=True)
    torch.autograd.backward(aggregate(terms, torch.tensor([0.0, 0.0, 0.0, 2.0, 2.0]), torch.tensor(ROWS), mode,
                                      loss_norm_tokens=10))
    assert terms.grad is not None and terms.grad[:3].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("mode", MODES)
def test_two_traces_of_weight_half_count_as_one_of_weight_one(mode: Aggregation) -> None:
    one = _agg(TERMS, ROWS, [1.0, 1.0, 1.0, 1.0, 1.0], mode)
    # sequence 1 split into two identical traces (rows 1 and 2) of weight 0.5 each
    split = _agg([*TERMS, 4.0, 6.0], [*ROWS, 2, 2], [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5], mode)
    assert split == pytest.approx(one)


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_a_session_split_in_two_traces_counts_once_per_sequence_mode(mode: Aggregation) -> None:
    """A session of two different traces (weights 0.5 + 0.5) beside a one-trace session (weight 1): the two
    sessions weigh the same, where unweighted the split one would count twice."""
    terms, rows = [1.0, 3.0, 10.0, 4.0], [0, 0, 1, 2]  # session A: traces 0 and 1; session B: trace 2
    if mode == "seq_mean_token_mean":
        expected = (0.5 * 2.0 + 0.5 * 10.0 + 1.0 * 4.0) / 2.0
    else:
        expected = (0.5 * 4.0 + 0.5 * 10.0 + 1.0 * 4.0) / (2.0 * 10)
    assert _agg(terms, rows, [0.5, 0.5, 0.5, 1.0], mode) == pytest.approx(expected)


@pytest.mark.parametrize("mode", MODES)
def test_gradients_flow_through_each_aggregation(mode: Aggregation) -> None:
    """At ratio 1 (new = old) a token's surrogate term is ``-A``, so d loss / d new_t is ``-A_t`` times the token's
    share in the aggregate: ``w_t / sum w`` (token_mean), ``w_s / (n_s sum w_s)`` (seq_mean_token_mean) or
    ``w_s / (sum w_s L)`` (seq_mean_token_sum_norm)."""
    old = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5]))
    new = old.clone().requires_grad_()
    adv = torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0])
    loss, _ = policy_loss(new, old, adv, weights=torch.tensor(WEIGHTS), rows=torch.tensor(ROWS), aggregation=mode,
                          loss_norm_tokens=10)
    torch.autograd.backward(loss)
    share = {"token_mean": [1 / 7] * 3 + [2 / 7] * 2,
             "seq_mean_token_mean": [1 / (3 * 3)] * 3 + [2 / (2 * 3)] * 2,
             "seq_mean_token_sum_norm": [1 / 30] * 3 + [2 / 30] * 2}[mode]
    assert new.grad is not None
    assert new.grad.tolist() == pytest.approx([-a * s for a, s in zip(adv.tolist(), share, strict=True)])


def test_bad_weights_and_modes_are_refused() -> None:
    for mode in MODES:
        with pytest.raises(ValueError, match="weight 0"):
            _agg(TERMS, ROWS, [0.0] * 5, mode)
    with pytest.raises(ValueError, match=">= 0"):
        _agg(TERMS, ROWS, [1.0, 1.0, 1.0, -1.0, -1.0], "token_mean")
    with pytest.raises(ValueError, match="share its weight"):
        _agg(TERMS, ROWS, [1.0, 2.0, 1.0, 2.0, 2.0], "seq_mean_token_mean")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        _agg(TERMS, ROWS, WEIGHTS, "sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no trained tokens"):
        _agg([], [], [], "token_mean")
    with pytest.raises(ValueError):
        TrainerSettings(loss_aggregation="seq-mean-token-mean")
    with pytest.raises(ValueError):
        TrainerSettings(loss_norm_tokens=0)
    for bad in (-0.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="weight"):
            TrainSequence([1], [2], [1], weight=bad)


def test_collate_carries_each_trained_tokens_sequence_weight() -> None:
    a = TrainSequence([1, 2], [3, 4, 5], [1, 0, 1], [-0.1, -0.2, -0.3], weight=0.25)
    b = TrainSequence([6], [7], [1], [-0.7])
    batch = collate([a, b])
    assert batch.weights.tolist() == [0.25, 0.25, 1.0]
    assert batch.rows.tolist() == [0, 0, 1]  # the sequence index of each trained token


# -- grpo_sequences: weights and the shuffled control -------------------------------------------------------------

def _session(task: str, index: int, reward: float, traces: int = 1, weight: object = "builder") -> SessionResult:
    meta: dict[str, object] = {} if weight is None else {"weight": 1.0 / traces if weight == "builder" else weight}
    made = [Trace(prompt_ids=[1], response_ids=[2 + k], loss_mask=[1], response_logprobs=[-0.1], metadata=meta)
            for k in range(traces)]
    return SessionResult(session_id=f"{task}-{index}", task_id=task, status=SessionStatus.COMPLETED,
                         trajectory=Trajectory(session_id=f"{task}-{index}", traces=made),
                         evaluation=EvalResult(reward=reward))


def test_grpo_sequences_read_the_builders_session_weight() -> None:
    results = [_session("a", 0, 1.0, traces=2), _session("a", 1, 0.0, weight=None), _session("a", 2, 0.0, weight=0)]
    sequences = grpo_sequences(results)
    assert [s.weight for s in sequences] == [0.5, 0.5, 1.0, 0.0]
    assert [s.true_reward for s in sequences] == [s.reward for s in sequences] == [1.0, 1.0, 0.0, 0.0]
    for bad in (-1.0, math.nan, "heavy", True):
        with pytest.raises(ValueError, match=r"session 'a-1' trace 0: metadata\['weight'\]"):
            grpo_sequences([_session("a", 0, 1.0), _session("a", 1, 0.0, weight=bad)])


def test_shuffled_rewards_are_a_seeded_permutation() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.25]
    out = shuffled_rewards(rewards, random.Random(7))
    assert sorted(out) == sorted(rewards) and rewards == [1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.25]
    assert shuffled_rewards(rewards, random.Random(7)) == out
    assert len({tuple(shuffled_rewards(rewards, random.Random(seed))) for seed in range(20)}) > 1


def test_the_shuffled_control_permutes_session_rewards_before_advantages() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    results = [_session("a", i, r, traces=1 + i % 3) for i, r in enumerate(rewards)]
    plain = grpo_sequences(results)
    shuffled = grpo_sequences(results, shuffle=random.Random(1))
    assert grpo_sequences(results, shuffle=random.Random(1)) == shuffled  # seeded
    assert [(s.response_ids, s.weight, s.true_reward) for s in shuffled] == \
        [(s.response_ids, s.weight, s.reward) for s in plain]  # same traces, weights and real rewards
    per_session: list[float] = []
    start = 0
    for i in range(len(rewards)):
        n = 1 + i % 3
        mine = shuffled[start:start + n]
        assert len({s.reward for s in mine}) == 1  # one session, one (permuted) reward
        per_session.append(mine[0].reward)
        start += n
    assert sorted(per_session) == sorted(rewards)  # a permutation of the sessions' rewards
    assert per_session == shuffled_rewards(rewards, random.Random(1))  # the pure function's permutation
    assert per_session != rewards  # this seed moves them
    expected = group_advantages([s.reward for s in shuffled], [s.group for s in shuffled])
    assert [s.advantage for s in shuffled] == pytest.approx(expected)


# -- the step: Trainer.grpo_step uses the configured aggregation ---------------------------------------------------

def test_the_grpo_step_uses_the_configured_aggregation(tmp_path: Path) -> None:
    """With the captured logprobs equal to the trainer's own the ratio is 1 and a token's term is ``-A``, so the
    step's loss is the aggregation of ``-A`` (values as in :func:`test_each_aggregation_gives_its_hand_computed_value`
    with sequence a: 3 tokens, A = 1, weight 0.5; b: 1 trained token of 2, A = -1, weight 1)."""
    settings = TrainerSettings(algorithm="grpo", learning_rate=1e-3, loss_norm_tokens=4)
    trainer = Trainer(settings, small_qwen3_dir(tmp_path))
    shapes = [([151644, 872], [11, 12, 13], [1, 1, 1]), ([151644], [21, 22], [0, 1])]
    expected = {"token_mean": (0.5 * -3 + 1.0) / 2.5, "seq_mean_token_mean": (0.5 * -1 + 1.0) / 1.5,
                "seq_mean_token_sum_norm": (0.5 * -3 + 1.0) / (1.5 * 4)}
    for mode in MODES:
        bare = [TrainSequence(*shape) for shape in shapes]
        with torch.no_grad():
            current = trained_logprobs(trainer.model, collate(bare)).tolist()
        sequences = [TrainSequence(shapes[0][0], shapes[0][1], shapes[0][2], current[:3], advantage=1.0, weight=0.5),
                     TrainSequence(shapes[1][0], shapes[1][1], shapes[1][2], [0.0, current[3]], advantage=-1.0)]
        trainer.settings = trainer.settings.model_copy(update={"loss_aggregation": mode})
        report = trainer.grpo_step(sequences)
        assert report.loss == pytest.approx(expected[mode], abs=1e-5), mode
        assert report.grad_norm > 0
    zero = [TrainSequence([151644], [11], [1], [-1.0], advantage=1.0, weight=0.0)]
    with pytest.raises(ValueError, match="weight 0"):
        trainer.grpo_step(zero)
