"""Every reward an evaluator produces is a finite number within ±MAX_REWARD, or the session ends ERROR with cause
``invalid_reward`` (issue 35, break 3). Pure: reward files in a temporary folder, evaluators as small classes; the
same through a real sandbox is in test_eval_harbor.py and tests/gateway/test_never_scored.py."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pydantic import ValidationError

from polar_gym.causes import INFRA_CAUSES, INVALID_REWARD, cause_of
from polar_gym.evaluate import EvaluationError, InvalidReward, checked_evaluation
from polar_gym.evaluate.base import EvalContext, Evaluator, check_reward
from polar_gym.evaluate.harbor import read_reward
from polar_gym.schema import MAX_REWARD, AgentSpec, EvalResult, SessionSpec, Trace, Trajectory


def _reading(tmp_path: Path, name: str, content: str | bytes) -> Any:
    (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return read_reward(tmp_path)


@pytest.mark.parametrize(("content", "named"), [
    ('{"a": 1e308, "b": 1e308}', "reward.json['a'] is 1e+308"),  # its mean was inf, stored as null: the hang
    ('{"a": 8e8, "b": 9e8, "c": 2e9}', "reward.json['c'] is 2000000000.0"),
    ('{"reward": NaN}', "reward.json['reward'] is nan"),
    ('{"reward": Infinity}', "reward.json['reward'] is inf"),
    ('{"reward": -Infinity}', "reward.json['reward'] is -inf"),
    ('{"reward": 1e400}', "reward.json['reward'] is inf"),
    ("1" + "0" * 400, "reward.json is an integer of 1329 bits"),  # float() of it raised OverflowError
    ('{"reward": -1e10}', "reward.json['reward'] is -10000000000.0"),
], ids=["mean-overflow", "one-value-huge", "nan", "inf", "-inf", "1e400", "huge-int", "huge-negative"])
def test_a_reward_json_number_no_reward_may_be_is_invalid_and_named(tmp_path: Path, content: str,
                                                                     named: str) -> None:
    reading = _reading(tmp_path, "reward.json", content)
    assert reading.invalid and reading.reward is None, reading
    assert named in str(reading.error) and "not finite or beyond ±1e+09" in str(reading.error)


@pytest.mark.parametrize("content", ["nan", "inf", "-inf", "1e999", "2e9"])
def test_a_reward_txt_number_no_reward_may_be_is_invalid(tmp_path: Path, content: str) -> None:
    reading = _reading(tmp_path, "reward.txt", content)
    assert reading.invalid and reading.reward is None and "reward.txt is" in str(reading.error)


def test_the_mean_of_large_values_is_their_mean_not_an_overflow(tmp_path: Path) -> None:
    reading = _reading(tmp_path, "reward.json", json.dumps({"a": MAX_REWARD, "b": MAX_REWARD, "c": -MAX_REWARD}))
    assert not reading.invalid and reading.reward == pytest.approx(MAX_REWARD / 3)


@pytest.mark.parametrize(("content", "error"), [
    ('{"reward": true}', "not a number"),
    ('{"reward": {"nested": 1}}', "not a number"),
    ('{"a": [1, 2]}', "not a number"),
    ("[" * 60000, "not JSON"),  # json.loads raised RecursionError, which nothing caught
], ids=["bool", "nested", "list", "deep"])
def test_a_value_that_is_no_number_is_unusable_not_invalid(tmp_path: Path, content: str, error: str) -> None:
    """Not numbers: an unusable file, which ``missing_reward`` turns into 0 or an error, as before."""
    reading = _reading(tmp_path, "reward.json", content)
    assert not reading.invalid and reading.reward is None and error in str(reading.error)


def test_a_1_gb_reward_file_is_refused_by_its_size_without_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "reward.json"
    with path.open("wb") as f:  # sparse: 1 GB by its size, nothing on disk
        f.truncate(1 << 30)
    reading = read_reward(tmp_path)
    assert reading.reward is None and f"{1 << 30} bytes" in str(reading.error)
    assert os.stat(path).st_blocks == 0


# -- the one place every evaluation goes through -----------------------------------------------------------------

class _Returns(Evaluator):
    name: ClassVar[str] = "returns"
    result: ClassVar[Any] = None

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        return type(self).result  # type: ignore[no-any-return]


def _evaluator(result: Any) -> Evaluator:
    return type("Made", (_Returns,), {"result": result})()


class _Builds(Evaluator):
    """A user's evaluator that builds its EvalResult from a bad number: the schema refuses it on the way."""

    name: ClassVar[str] = "builds"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        return EvalResult(reward=1.0, per_trace_rewards=[0.5, float(self.config["bad"])])


def _ctx() -> EvalContext:
    spec = SessionSpec(task_id="t", instruction="x", agent=AgentSpec(harness="shell"))
    return EvalContext(spec=spec, trajectory=Trajectory(session_id=spec.session_id), harness_result=None,
                       runtime=None)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 1e308, -2e9])
async def test_a_result_that_skipped_validation_is_refused(bad: float) -> None:
    made = EvalResult.model_construct(reward=bad, passed=None, per_trace_rewards=None, details={})
    with pytest.raises(InvalidReward, match="evaluator 'returns' gave reward"):
        await checked_evaluation(_evaluator(made), _ctx())
    per_trace = EvalResult.model_construct(reward=1.0, passed=None, per_trace_rewards=[0.0, bad], details={})
    with pytest.raises(InvalidReward, match=r"per_trace_rewards\[1\]"):
        await checked_evaluation(_evaluator(per_trace), _ctx())


@pytest.mark.parametrize("bad", ["nan", "inf", "1e300"])
async def test_a_reward_the_schema_refused_inside_the_evaluator_is_an_invalid_reward(bad: str) -> None:
    with pytest.raises(InvalidReward, match=r"evaluator 'builds' gave per_trace_rewards\[1\] "):
        await checked_evaluation(_Builds({"bad": bad}), _ctx())


async def test_a_good_result_passes_and_other_failures_keep_their_type() -> None:
    good = EvalResult(reward=0.5, per_trace_rewards=[0.0, 1.0])
    assert await checked_evaluation(_evaluator(good), _ctx()) is good
    with pytest.raises(EvaluationError, match="returned dict, not an EvalResult") as caught:
        await checked_evaluation(_evaluator({"reward": 1.0}), _ctx())
    assert not isinstance(caught.value, InvalidReward)
    with pytest.raises(InvalidReward, match="True, not a number"):
        check_reward(EvalResult.model_construct(reward=True, per_trace_rewards=None), "x")


def test_the_wire_types_refuse_what_json_cannot_carry() -> None:
    for bad in (math.inf, math.nan, MAX_REWARD * 2):
        with pytest.raises(ValidationError):
            EvalResult(reward=bad)
        with pytest.raises(ValidationError):
            Trace(prompt_ids=[1], response_ids=[2], loss_mask=[1], reward=bad)
    with pytest.raises(ValidationError):  # what a gateway serialized inf as
        EvalResult.model_validate_json('{"reward": null}')
    assert EvalResult(reward=-MAX_REWARD).reward == -MAX_REWARD


def test_the_cause_is_read_from_the_reason_and_is_not_an_infrastructure_one() -> None:
    assert cause_of("ERROR", "invalid_reward: evaluator 'x' gave reward inf, ...", {}) == INVALID_REWARD
    assert cause_of("ERROR", "unstorable_result: ...", {}) == "unstorable_result"
    assert INVALID_REWARD not in INFRA_CAUSES and "harness_not_run" in INFRA_CAUSES
