"""The noise-free evaluation on the real Qwen chat template and tokenizer and a small Qwen3: a forked task's right
and wrong answers (datagen records that differ in one token of a tool call's arguments) are loaded, de-duplicated,
scored exactly, and summarised into P(right), P(wrong) and the share right."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from polar_gym.assets import tokenizer_dir
from polar_gym.datagen.export import DatagenRecord
from polar_gym.trainer import (
    ReferenceAnswer,
    TrainSequence,
    answer_logprobs,
    load_policy,
    load_reference_answers,
    reference_metrics,
)
from tests.trainer._tiny import small_qwen3_dir

WRITE_TOOL = {"type": "function", "function": {
    "name": "write", "description": "Write a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                   "required": ["path", "content"]}}}


def _record(op: str, reward: float, variant: str | None, session: str = "s1") -> dict[str, Any]:
    """A datagen sft/train.jsonl line of the oracle playing calc-add with ``a <op> b`` (the oracle thinks, so each
    assistant turn carries reasoning, as :mod:`polar_gym.proxy.engines.oracle` writes it)."""
    source = f"def add(a, b):\n    return a {op} b\n"
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Write calc.py with add(a, b) returning the sum."},
        {"role": "assistant", "content": "", "reasoning_content": "Step 1: write calc.py.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "write",
                                      "arguments": json.dumps({"path": "calc.py", "content": source})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "wrote calc.py"},
        {"role": "assistant", "content": "Done.", "reasoning_content": "The reference solution is complete."},
    ]
    metadata = {"oracle_variant": variant} if variant else {}
    record = DatagenRecord(instance_id="calc-add", task_id="calc-add", session_id=session, trace_index=0,
                           builder="prefix_merging", reward=reward, passed=reward >= 1.0, messages=messages,
                           tools=[WRITE_TOOL], metadata=metadata, repo="demo/calc", problem_statement="Add.",
                           sample_index=0)
    return record.model_dump(mode="json")


def _write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


def _ids(answer: ReferenceAnswer) -> list[int]:
    return [*answer.sequence.prompt_ids, *answer.sequence.response_ids]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir()))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_policy(small_qwen3_dir(tmp_path_factory.mktemp("model")))


@pytest.fixture
def fork(tmp_path: Path, tokenizer: Any) -> list[ReferenceAnswer]:
    path = _write(tmp_path / "train.jsonl", [_record("+", 1.0, "right"), _record("*", 0.0, "wrong")])
    return load_reference_answers([path], tokenizer)


def test_the_fork_is_one_trained_token_through_the_real_template(fork: list[ReferenceAnswer],
                                                                 tokenizer: Any) -> None:
    right, wrong = fork
    assert (right.name, right.reward, wrong.name, wrong.reward) == ("right", 1.0, "wrong", 0.0)
    assert right.source.endswith("train.jsonl:1") and wrong.source.endswith("train.jsonl:2")
    a, b = _ids(right), _ids(wrong)
    assert len(a) == len(b)
    differ = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    assert len(differ) == 1
    i = differ[0]
    assert (tokenizer.decode([a[i]]), tokenizer.decode([b[i]])) == (" +", " *")
    start = len(right.sequence.prompt_ids)
    assert i >= start and right.sequence.loss_mask[i - start] == 1  # the fork token is one the policy samples
    assert right.sequence.loss_mask == wrong.sequence.loss_mask
    # teacher-forced through the tools the engine hands the template: the tool's schema is in the prompt
    assert '"name": "write"' in tokenizer.decode(right.sequence.prompt_ids)


def test_duplicates_merge_and_an_unnamed_record_is_the_reference(tmp_path: Path, tokenizer: Any) -> None:
    first = _write(tmp_path / "a.jsonl", [_record("+", 1.0, "right", "s1"), _record("*", 0.0, "wrong", "s2")])
    token_line = {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "loss_mask": [1, 1], "reward": 1.0,
                  "response_logprobs": [-0.5, -0.25]}
    second = _write(tmp_path / "b.jsonl", [_record("+", 1.0, "right", "s3"), token_line, token_line,
                                           _record("*", 0.0, "wrong", "s4")])
    second.write_text(second.read_text() + "\n", encoding="utf-8")  # a blank line is not a record
    answers = load_reference_answers([first, second], tokenizer)
    assert [(a.name, a.reward) for a in answers] == [("right", 1.0), ("wrong", 0.0), ("reference", 1.0)]
    assert [a.source.rsplit("/", 1)[1] for a in answers] == ["a.jsonl:1", "a.jsonl:2", "b.jsonl:2"]
    assert answers[2].sequence.old_logprobs == []  # only the tokens are kept


def test_records_that_cannot_be_references_raise(tmp_path: Path, tokenizer: Any) -> None:
    conflict = _write(tmp_path / "conflict.jsonl", [_record("+", 1.0, "right"), _record("+", 0.0, "right")])
    with pytest.raises(ValueError, match=r"conflict.jsonl:1 and .*conflict.jsonl:2 are the same tokens with "
                                         r"different rewards \(1.0 and 0.0\)"):
        load_reference_answers([conflict], tokenizer)
    bad = {**_record("+", 1.0, "right"), "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ValueError, match=r"bad.jsonl:1 cannot be rendered faithfully: no assistant turn"):
        load_reference_answers([_write(tmp_path / "bad.jsonl", [bad])], tokenizer)
    rewardless = {**_record("+", 1.0, "right"), "reward": None}
    with pytest.raises(ValueError, match="has no reward"):
        load_reference_answers([_write(tmp_path / "none.jsonl", [rewardless])], tokenizer)
    untrained = {"prompt_ids": [1], "response_ids": [2], "loss_mask": [0], "reward": 1.0}
    with pytest.raises(ValueError, match="no trained token"):
        load_reference_answers([_write(tmp_path / "zero.jsonl", [untrained])], tokenizer)
    with pytest.raises(ValueError, match="no reference answer in"):
        load_reference_answers([_write(tmp_path / "empty.jsonl", [])], tokenizer)


def _by_hand(model: Any, seq: TrainSequence) -> float:
    ids = [*seq.prompt_ids, *seq.response_ids]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
    start = len(seq.prompt_ids)
    return sum(float(logp[start + j - 1, seq.response_ids[j]]) for j, m in enumerate(seq.loss_mask) if m)


def test_answer_logprobs_equal_a_hand_forward_and_leave_the_model_as_it_was(model: Any,
                                                                          fork: list[ReferenceAnswer]) -> None:
    short = ReferenceAnswer("short", 1.0, TrainSequence([9, 10, 11], [12, 13, 14], [1, 0, 1], reward=1.0), "x:1")
    answers = [*fork, short]  # unequal lengths: padding, and two batches at batch_size=2
    grad = [torch.full_like(p, 0.25) for p in model.parameters()]
    for p, g in zip(model.parameters(), grad, strict=True):
        p.grad = g.clone()
    model.train()
    got = answer_logprobs(model, answers, pad_id=0, batch_size=2)
    assert model.training
    assert all(p.requires_grad and torch.equal(p.grad, g) for p, g in zip(model.parameters(), grad, strict=True))
    model.eval()
    try:
        alone = answer_logprobs(model, answers, pad_id=0, batch_size=1)
        assert not model.training
        hand = [_by_hand(model, a.sequence) for a in answers]
    finally:
        model.train()
        model.zero_grad(set_to_none=True)
    assert got == pytest.approx(hand, abs=1e-3) and alone == pytest.approx(hand, abs=1e-3)
    assert all(x < 0 for x in got) and got[0] != got[1]
    # the fork differs in one token, so the two sums differ by that token's logprobs alone
    assert got[0] - got[1] == pytest.approx(hand[0] - hand[1], abs=1e-4)
    metrics = reference_metrics(fork, got[:2])
    assert 0.0 < metrics["eval/share_right"] < 1.0
    assert math.isclose(metrics["eval/p_right"], math.exp(got[0])) and metrics["eval/logp/right"] == got[0]


def _answer(name: str, reward: float, token: int) -> ReferenceAnswer:
    return ReferenceAnswer(name, reward, TrainSequence([1], [token], [1], reward=reward), f"f:{token}")


def test_metrics_are_stable_for_tiny_probabilities() -> None:
    answers = [_answer("right", 1.0, 2), _answer("wrong", 0.0, 3)]
    metrics = reference_metrics(answers, [-2000.0, -2001.0])
    assert metrics["eval/share_right"] == pytest.approx(1 / (1 + math.exp(-1)))  # ~0.731, not nan
    assert metrics["eval/p_right"] == 0.0 == metrics["eval/p_wrong"]  # underflow, but the logs keep the value
    assert (metrics["eval/logp_right"], metrics["eval/logp_wrong"]) == (-2000.0, -2001.0)
    assert all(math.isfinite(v) for v in metrics.values())
    json.dumps(metrics, allow_nan=False)
    for right, wrong in [(-1e-9, -50.0), (-50.0, -1e-9), (-0.7, -0.7), (-3000.0, -1.0)]:
        share = reference_metrics(answers, [right, wrong])["eval/share_right"]
        assert 0.0 <= share <= 1.0


def test_metrics_sum_the_variants_and_name_them_stably() -> None:
    answers = [_answer("right", 1.0, 2), _answer("right", 1.0, 3), _answer("wrong", 0.0, 4),
               _answer("reference", 0.5, 5)]
    metrics = reference_metrics(answers, [math.log(0.2), math.log(0.3), math.log(0.1), math.log(0.15)])
    assert metrics["eval/p_right"] == pytest.approx(0.5) and metrics["eval/p_wrong"] == pytest.approx(0.25)
    assert metrics["eval/share_right"] == pytest.approx(0.5 / 0.75)
    assert sorted(k for k in metrics if k.startswith("eval/logp/")) == [
        "eval/logp/reference", "eval/logp/right-1", "eval/logp/right-2", "eval/logp/wrong"]
    assert metrics["eval/logp/right-2"] == math.log(0.3)
    # a lower bar for "right" moves the 0.5-reward answer to the right side
    assert reference_metrics(answers, [-1.0] * 4, right_reward=0.5)["eval/share_right"] == pytest.approx(0.75)


def test_metrics_without_a_wrong_or_a_right_answer() -> None:
    only_right = reference_metrics([_answer("right", 1.0, 2)], [-3.0])
    assert only_right["eval/share_right"] == 1.0 and only_right["eval/p_wrong"] == 0.0
    assert "eval/logp_wrong" not in only_right
    with pytest.raises(ValueError, match=r"no reference answer has reward >= 1\.0"):
        reference_metrics([_answer("wrong", 0.0, 2)], [-3.0])
    with pytest.raises(ValueError, match="2 answers but 1 logprobs"):
        reference_metrics([_answer("right", 1.0, 2), _answer("wrong", 0.0, 3)], [-1.0])
    with pytest.raises(ValueError, match="non-finite"):
        reference_metrics([_answer("right", 1.0, 2)], [float("nan")])
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        answer_logprobs(object(), [_answer("right", 1.0, 2)], pad_id=0, batch_size=0)
