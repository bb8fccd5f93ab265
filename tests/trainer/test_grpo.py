"""GRPO's loop through a working fake fleet: a policy that samples from the trainer's current weights (so its
logprobs are the engine's), rewards that prefer one token, weight pushes that change what the next step samples."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from polar_gym.schema import EvalResult, SessionResult, SessionStatus, TaskRequest, Trace, Trajectory
from polar_gym.tasks import DEMO_TASKS
from polar_gym.trainer import TrainerSettings, collate, grpo_sequences, load_policy, run_grpo, trained_logprobs
from polar_gym.trainer.batch import TrainSequence
from tests.trainer._tiny import small_qwen3_dir

GOOD = 1000  # the token the reward likes


class FakeFleet:
    """A rollout server with one engine serving ``model_dir``: each session samples 4 tokens at temperature 1 and
    reports their logprobs and the policy version that sampled them; reward 1 per GOOD token sampled.
    ``update_weights`` loads the checkpoint, as the fleet call makes every engine do."""

    def __init__(self, model_dir: Path) -> None:
        self.model = load_policy(model_dir)
        self.model.eval()
        self.version: int | str = 0
        self.submitted: list[TaskRequest] = []
        self.updates: list[tuple[str, int | str]] = []
        self.generator = torch.Generator().manual_seed(0)

    async def submit(self, task: TaskRequest) -> dict[str, Any]:
        self.submitted.append(task)
        return {"created": True}

    def _session(self, task: TaskRequest, index: int) -> SessionResult:
        prompt, response, logprobs = [151644, 872, 198], [], []
        with torch.no_grad():
            for _ in range(4):
                logits = self.model(input_ids=torch.tensor([prompt + response])).logits[0, -1].float()
                logits[GOOD] += 9.0 if index % 2 else 0.0  # half the group finds the good token: reward variance
                probs = torch.softmax(logits, -1)
                token = int(torch.multinomial(probs, 1, generator=self.generator))
                response.append(token)
            seq = TrainSequence(prompt, response, [1] * 4)
            logprobs = trained_logprobs(self.model, collate([seq])).tolist()
        reward = float(response.count(GOOD))
        trace = Trace(prompt_ids=prompt, response_ids=response, loss_mask=[1] * 4, response_logprobs=logprobs,
                      metadata={"policy_versions": [self.version]})
        return SessionResult(session_id=f"{task.task_id}-{index}", task_id=task.task_id,
                             status=SessionStatus.COMPLETED, trajectory=Trajectory(session_id="s", traces=[trace]),
                             evaluation=EvalResult(reward=reward))

    async def results(self, task_ids: Iterable[str], *, timeout: float = 0, poll: float = 0
                      ) -> AsyncIterator[SessionResult]:
        for task in [t for t in self.submitted if t.task_id in set(task_ids)]:
            for i in range(task.num_samples):
                yield self._session(task, i)

    async def update_weights(self, checkpoint: str, version: int | str) -> dict[str, Any]:
        self.model = load_policy(checkpoint)
        self.model.eval()
        self.version = version
        self.updates.append((checkpoint, version))
        return {"version": version}


async def test_grpo_steps_push_versions_and_train_on_matching_logprobs(tmp_path: Path) -> None:
    model_dir = small_qwen3_dir(tmp_path)
    fleet = FakeFleet(model_dir)
    tasks = [DEMO_TASKS[name].to_request(harness="pi", model_name="policy", num_samples=4)
             for name in ("demo-calc-add", "demo-slugify")]
    settings = TrainerSettings(algorithm="grpo", model=str(model_dir), steps=3, learning_rate=1e-2)
    out = tmp_path / "run"
    last = await run_grpo(settings, tasks, fleet, out, weights=fleet, echo=lambda _: None)
    rows = [json.loads(x) for x in (out / "train_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [v for _, v in fleet.updates] == [1, 2, 3]  # one push per step, the version bumped each time
    assert [r["sampled_versions"] for r in rows] == [["0"], ["1"], ["2"]]  # each step sampled by the last push
    assert [t.task_id for t in fleet.submitted[:2]] == ["demo-calc-add-step1", "demo-slugify-step1"]
    for row in rows:  # the engine sampled with the weights the trainer holds: logprobs agree
        assert row["audit/logprob_abs_diff_max"] < 1e-4 and row["sessions"] == 8 and row["tokens"] == 32
        assert {"loss", "reward_mean", "reward_std", "seconds", "train_seconds", "push_seconds"} <= set(row)
    assert last == out / "checkpoints" / "step-3" and fleet.updates[-1][0] == str(last)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-3"]  # older steps pruned
    assert (out / "train_metrics.svg").exists()
    # every step's traces, for the audit CLI: the session's reward beside the trace's own (not written over it)
    traces = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert [t["step"] for t in traces] == [1] * 8 + [2] * 8 + [3] * 8
    assert all(t["reward"] is None and t["session_reward"] == t["response_ids"].count(GOOD) for t in traces)
    assert {t["task_id"] for t in traces} == {f"{name}-step{n}" for name in ("demo-calc-add", "demo-slugify")
                                               for n in (1, 2, 3)}


async def test_grpo_needs_a_weight_sync_unless_told_not_to_push(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="WeightSync"):
        await run_grpo(TrainerSettings(algorithm="grpo"), [], FakeFleet.__new__(FakeFleet), tmp_path)


def test_grpo_sequences_group_by_task_and_skip_unfinished_sessions() -> None:
    def result(task: str, reward: float, status: SessionStatus = SessionStatus.COMPLETED) -> SessionResult:
        trace = Trace(prompt_ids=[1], response_ids=[2], loss_mask=[1], response_logprobs=[-0.1])
        return SessionResult(session_id=f"{task}{reward}", task_id=task, status=status,
                             trajectory=Trajectory(session_id="s", traces=[trace]),
                             evaluation=EvalResult(reward=reward))

    results = [result("a", 1.0), result("a", 0.0), result("b", 1.0), result("b", 1.0),
               result("a", 1.0, SessionStatus.TIMEOUT)]
    sequences = grpo_sequences(results)
    assert [(s.group, s.reward) for s in sequences] == [("a", 1.0), ("a", 0.0), ("b", 1.0), ("b", 1.0)]
    assert sequences[0].advantage == pytest.approx(-sequences[1].advantage) and sequences[0].advantage > 0
    assert sequences[2].advantage == sequences[3].advantage == 0.0
    assert len(grpo_sequences(results, completed_only=False)) == 5


class BrokenFleet(FakeFleet):
    """Every session ends in ERROR, as when the engine is unreachable."""

    def _session(self, task: TaskRequest, index: int) -> SessionResult:
        return SessionResult(session_id=f"{task.task_id}-{index}", task_id=task.task_id, status=SessionStatus.ERROR,
                             reason="upstream_error: answered 404")


async def test_a_step_whose_sessions_all_errored_stops_the_run(tmp_path: Path) -> None:
    model_dir = small_qwen3_dir(tmp_path)
    fleet = BrokenFleet(model_dir)
    tasks = [DEMO_TASKS["demo-calc-add"].to_request(harness="pi", model_name="policy", num_samples=2)]
    with pytest.raises(RuntimeError, match="upstream_error: answered 404"):
        await run_grpo(TrainerSettings(algorithm="grpo", model=str(model_dir), steps=2), tasks, fleet,
                       tmp_path / "run", weights=fleet, echo=lambda _: None)
    assert fleet.updates == []  # nothing pushed
