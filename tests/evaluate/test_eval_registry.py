"""The evaluator registry: built-in names, a user's dotted path (the example custom evaluator), registration,
per-trace rewards flowing into a trajectory, and the package's public surface."""

from __future__ import annotations

import importlib

import pytest

import polar_gym.evaluate as evaluate
from polar_gym.evaluate import EvaluatorConfigError, evaluator_class, load_evaluator, register_evaluator
from polar_gym.evaluate.examples import FinalAnswerContains, message_text
from polar_gym.evaluate.session_completed import SessionCompleted
from polar_gym.evaluate.test_on_output import TestOnOutput
from polar_gym.merge.rewards import apply_rewards
from polar_gym.registry import EVALUATORS
from polar_gym.schema import EvaluatorSpec, Trace
from polar_gym.tasks import demo_task
from tests.evaluate._evalkit import context

TASK = demo_task("demo-calc-add")


def _trace(text: str) -> Trace:
    return Trace(prompt_ids=[1], response_ids=[2, 3], loss_mask=[1, 1],
                 response_messages=[{"role": "assistant", "content": [{"type": "text", "text": text}]}])


def test_builtin_names_resolve() -> None:
    assert evaluator_class("session_completed") is SessionCompleted
    assert evaluator_class("test_on_output") is TestOnOutput
    assert isinstance(load_evaluator("session_completed"), SessionCompleted)
    assert isinstance(load_evaluator(EvaluatorSpec()), SessionCompleted)  # the default strategy


def test_unknown_and_wrong_targets_are_config_errors() -> None:
    with pytest.raises(EvaluatorConfigError, match="unknown evaluator"):
        evaluator_class("nope")
    with pytest.raises(EvaluatorConfigError, match="not an Evaluator"):
        evaluator_class("polar_gym.evaluate.examples:message_text")
    with pytest.raises(EvaluatorConfigError, match="cannot import"):
        evaluator_class("no_such_pkg.mod:Thing")


async def test_custom_evaluator_by_dotted_path_with_per_trace_rewards() -> None:
    spec = EvaluatorSpec(strategy="polar_gym.evaluate.examples:FinalAnswerContains",
                         config={"text": "tests pass", "ignore_case": True})
    evaluator = load_evaluator(spec)
    assert isinstance(evaluator, FinalAnswerContains) and not evaluator.wants_fresh_runtime(spec)
    ctx = context(TASK, runtime=None, evaluator=spec, traces=[_trace("looking"), _trace("Fixed. The TESTS PASS.")])
    result = await evaluator.evaluate(ctx)
    assert result.reward == 1.0 and result.per_trace_rewards == [0.0, 1.0]
    traj = apply_rewards(ctx.trajectory, result)
    assert [t.reward for t in traj.traces] == [0.0, 1.0]
    assert all(t.metadata["outcome_reward"] == 1.0 for t in traj.traces)
    miss = await load_evaluator(spec.model_copy(update={"config": {"text": "nope"}})).evaluate(ctx)
    assert miss.reward == 0.0 and miss.per_trace_rewards == [0.0, 0.0]
    empty = await evaluator.evaluate(context(TASK, runtime=None, evaluator=spec))
    assert empty.reward == 0.0 and empty.per_trace_rewards is None
    with pytest.raises(EvaluatorConfigError):
        load_evaluator("polar_gym.evaluate.examples:FinalAnswerContains")


def test_register_by_name() -> None:
    register_evaluator("answer_contains_test", "polar_gym.evaluate.examples:FinalAnswerContains")
    try:
        assert evaluator_class("answer_contains_test") is FinalAnswerContains
    finally:
        EVALUATORS._entries.pop("answer_contains_test", None)


def test_message_text_shapes() -> None:
    assert message_text({"content": "hi"}) == "hi"
    assert message_text({"content": [{"text": "a"}, {"type": "image"}, {"text": "b"}]}) == "ab"
    assert message_text({"content": None}) == ""


@pytest.mark.parametrize("module", ["polar_gym.evaluate", "polar_gym.evaluate.patches", "polar_gym.evaluate.results",
                                    "polar_gym.evaluate.registry", "polar_gym.evaluate.errors",
                                    "polar_gym.evaluate.session_completed", "polar_gym.evaluate.test_on_output",
                                    "polar_gym.evaluate.swebench_harness", "polar_gym.evaluate.examples",
                                    "polar_gym.tasks", "polar_gym.tasks.demo", "polar_gym.tasks.prepare"])
def test_exports(module: str) -> None:
    mod = importlib.import_module(module)
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.{name}"
    assert sorted(evaluate.__all__) == evaluate.__all__
