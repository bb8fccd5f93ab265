"""What a GRPO run measures besides its loss (issue 36): the reference answers' exact probabilities before the first
step and after each, greedy held-out sessions that are never trained on, the shuffled-reward control, and steps
that say they did not train. Through test_grpo's fake fleet (a policy sampling from the trainer's own weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from polar_gym.schema import SessionResult, TaskRequest
from polar_gym.tasks import DEMO_TASKS
from polar_gym.trainer import TrainerSettings, load_policy, run_grpo
from polar_gym.trainer.step_eval import GREEDY_SUFFIX, greedy_request, reward_stats
from tests.trainer._tiny import small_qwen3_dir
from tests.trainer.test_grpo import GOOD, FakeFleet


def _references(path: Path) -> Path:
    """Two token-id answers to the fake fleet's prompt: the rewarded token against another one."""
    prompt = [151644, 872, 198]
    lines = [{"prompt_ids": prompt, "response_ids": [token] * 4, "loss_mask": [1] * 4, "reward": reward,
              "metadata": {"oracle_variant": name}} for name, token, reward in (("reference", GOOD, 1.0),
                                                                               ("wrong", 7, 0.0))]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "train_metrics.jsonl").read_text().splitlines()]


async def test_rows_carry_the_reference_evaluation_and_greedy_success(tmp_path: Path) -> None:
    model_dir = small_qwen3_dir(tmp_path)
    fleet = FakeFleet(model_dir)
    task = DEMO_TASKS["demo-calc-add"].to_request(harness="pi", num_samples=8)
    settings = TrainerSettings(algorithm="grpo", model=str(model_dir), steps=2, learning_rate=1e-2,
                               reference_answers=[str(_references(tmp_path / "refs.jsonl"))], greedy_samples=1)
    out = tmp_path / "run"
    await run_grpo(settings, [task], fleet, out, weights=fleet, echo=lambda _: None)
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: the starting weights, before any update
    assert rows[0]["version"] == 0 and "loss" not in rows[0]
    for row in rows:
        assert 0.0 < row["eval/share_right"] < 1.0 and row["eval/p_right"] > 0 and "eval/logp/wrong" in row
    start = load_policy(model_dir)  # step 0's numbers are the starting weights'
    with torch.no_grad():
        logits = start(input_ids=torch.tensor([[151644, 872, 198, GOOD, GOOD, GOOD]])).logits[0].float()
    logp = sum(torch.log_softmax(logits[i], -1)[GOOD].item() for i in range(2, 6))
    assert abs(rows[0]["eval/logp/reference"] - logp) < 1e-3
    for row in rows[1:]:
        assert row["sessions"] == 8 and row["eval/greedy_n"] == 1 and row["trained"] is True, row
        assert row["reward_n"] == 8 and row["reward_se"] >= 0 and row["not_trained_reasons"] == []
    greedy = [t for t in fleet.submitted if t.task_id.endswith(GREEDY_SUFFIX)]
    assert [t.task_id for t in greedy] == ["demo-calc-add-step1-greedy", "demo-calc-add-step2-greedy"]
    assert all(t.metadata.sampling is not None and t.metadata.sampling.temperature == 0.0 for t in greedy)
    assert all(t.metadata.group_id == t.task_id for t in greedy)  # a group of its own
    traces = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert not any(t["task_id"].endswith(GREEDY_SUFFIX) for t in traces)  # never trained on
    assert len(traces) == 16


class EqualRewards(FakeFleet):
    """Every session gets the same reward: no signal in any group."""

    def _session(self, task: TaskRequest, index: int) -> SessionResult:
        result = super()._session(task, index)
        assert result.evaluation is not None
        return result.model_copy(update={"evaluation": result.evaluation.model_copy(update={"reward": 1.0})})


async def test_a_step_without_signal_says_so_and_does_not_move_the_weights(tmp_path: Path) -> None:
    model_dir = small_qwen3_dir(tmp_path)
    fleet = EqualRewards(model_dir)
    task = DEMO_TASKS["demo-calc-add"].to_request(harness="pi", num_samples=4)
    said: list[str] = []
    settings = TrainerSettings(algorithm="grpo", model=str(model_dir), steps=2, learning_rate=1e-2, save_every=1)
    await run_grpo(settings, [task], fleet, tmp_path / "run", weights=fleet, echo=said.append)
    rows = _rows(tmp_path / "run")
    assert [(r["trained"], r["not_trained_reasons"], r["grad_norm"]) for r in rows] == [
        (False, ["no_signal"], 0.0)] * 2
    before, after = load_policy(model_dir), load_policy(tmp_path / "run" / "checkpoints" / "step-2")
    assert all(torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values(),
                                                 strict=True))
    assert any("no signal" in line for line in said) and said[-1].startswith("GRPO: 0 of 2 steps trained")


async def test_the_shuffled_control_trains_on_permuted_rewards_but_logs_the_real_ones(tmp_path: Path) -> None:
    model_dir = small_qwen3_dir(tmp_path)
    fleet = FakeFleet(model_dir)
    task = DEMO_TASKS["demo-calc-add"].to_request(harness="pi", num_samples=4)
    settings = TrainerSettings(algorithm="grpo", model=str(model_dir), steps=1, learning_rate=1e-2,
                               shuffle_rewards=True)
    await run_grpo(settings, [task], fleet, tmp_path / "run", weights=fleet, echo=lambda _: None)
    (row,) = _rows(tmp_path / "run")
    traces = [json.loads(x) for x in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert row["shuffled_rewards"] is True
    assert row["reward_mean"] == sum(t["session_reward"] for t in traces) / 4  # the real success, not the shuffle


def test_greedy_requests_and_reward_stats() -> None:
    task = DEMO_TASKS["demo-calc-add"].to_request(harness="pi", num_samples=8)
    greedy = greedy_request(task, 2)
    assert (greedy.task_id, greedy.num_samples) == ("demo-calc-add-greedy", 2)
    assert greedy.metadata.sampling is not None and greedy.metadata.sampling.model_dump(exclude_none=True) == {
        "temperature": 0.0}
    assert task.metadata.sampling is None  # the training request is untouched
    assert reward_stats([]) == {"reward_mean": 0.0, "reward_std": 0.0, "reward_se": 0.0, "reward_n": 0}
