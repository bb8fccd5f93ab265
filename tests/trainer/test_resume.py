"""A GRPO run stopped and resumed (a hand-over to the next Slurm job, a job killed mid-step) goes on as if it had
never stopped: the same weights and optimizer, the steps numbered on, every group trained once, nothing sampled
twice (the fleet answers a known group id with its stored sessions, as the rollout server does)."""

from __future__ import annotations

import asyncio
import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from polar_gym.schema import SessionResult, TaskRequest
from polar_gym.trainer import TrainerSettings, load_policy, run_grpo
from polar_gym.trainer.loops import RunControl
from polar_gym.trainer.resume import STATE, kept_rows, resume_point
from tests._waiting import until
from tests.trainer._tiny import small_qwen3_dir
from tests.trainer.test_pipeline import AheadFleet, _tasks


class StoreFleet(AheadFleet):
    """A fleet that samples a group once, when first submitted, each session from a seed of its own id (so two runs
    sample alike), and answers a re-submitted group with the sessions it has (the rollout server's store)."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        self.resubmitted: list[str] = []
        self.fail_push: int | None = None

    def _session(self, task: TaskRequest, index: int) -> SessionResult:
        self.generator.manual_seed(zlib.crc32(f"{task.task_id}-{index}".encode()))
        return super()._session(task, index)

    async def submit(self, task: TaskRequest) -> dict[str, Any]:
        if task.task_id in self.sampled:
            self.resubmitted.append(task.task_id)
            return {"created": False}
        return await super().submit(task)

    async def update_weights(self, checkpoint: str, version: int | str) -> dict[str, Any]:
        if version == self.fail_push:
            raise RuntimeError("the job ended here")
        return await super().update_weights(checkpoint, version)


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "train_metrics.jsonl").read_text().splitlines()]


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in load_policy(checkpoint).state_dict().items()}


async def test_a_run_stopped_after_a_step_and_resumed_ends_with_the_weights_of_an_uninterrupted_one(
        tmp_path: Path) -> None:
    model_dir = small_qwen3_dir(tmp_path)
    settings = TrainerSettings(algorithm="grpo", model=str(model_dir), steps=4, learning_rate=1e-2,
                               shuffle_rewards=True, seed=3)
    whole = StoreFleet(model_dir)
    last = await run_grpo(settings, _tasks(), whole, tmp_path / "whole", weights=whole, echo=lambda _: None)

    fleet, out, control, said = StoreFleet(model_dir), tmp_path / "run", RunControl(), []
    first = asyncio.create_task(run_grpo(settings, _tasks(), fleet, out, weights=fleet, echo=said.append,
                                         control=control))
    await until(lambda: (out / "checkpoints" / "step-2" / STATE).exists(), what="step 2's state")
    control.stop_now()
    await first
    assert control.handed_over and control.last_step in (2, 3)  # the step under way when asked may finish
    stopped_at = control.last_step
    assert [r["step"] for r in _rows(out)] == list(range(1, stopped_at + 1))
    assert any(f"stopped after step {stopped_at} of 4" in line for line in said)

    again = StoreFleet(model_dir)  # the next job's engines hold the starting weights
    again.sampled = fleet.sampled  # ... and the store holds the groups sampled so far
    resumed = await run_grpo(settings, _tasks(), again, out, weights=again, echo=said.append, resume=True)
    assert again.updates[0] == (str(out / "checkpoints" / f"step-{stopped_at}"), stopped_at)  # pushed first
    assert any(f"resuming after step {stopped_at}" in line for line in said)
    rows, reference = _rows(out), _rows(tmp_path / "whole")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows] == [r["loss"] for r in reference]  # optimizer and reward shuffle carried on
    assert [r["sampled_versions"] for r in rows] == [["0"], ["1"], ["2"], ["3"]]
    want = _weights(last)
    for name, value in _weights(resumed).items():
        assert torch.equal(value, want[name]), name
    traces = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert [t["step"] for t in traces] == [1] * 8 + [2] * 8 + [3] * 8 + [4] * 8  # each step's traces once


async def test_a_step_cut_by_the_end_of_its_job_is_redone_from_the_step_before(tmp_path: Path) -> None:
    model_dir = small_qwen3_dir(tmp_path)
    settings = TrainerSettings(algorithm="grpo", model=str(model_dir), steps=3, learning_rate=1e-2)
    fleet, out = StoreFleet(model_dir), tmp_path / "run"
    fleet.fail_push = 2  # step 2 trained and saved its weights, then the job ended before its state
    with pytest.raises(RuntimeError, match="the job ended here"):
        await run_grpo(settings, _tasks(), fleet, out, weights=fleet, echo=lambda _: None)
    cut = out / "checkpoints" / "step-2"
    assert (cut / ".complete").exists() and not (cut / STATE).exists()
    point = resume_point(out / "checkpoints")
    assert point is not None and point.step == 1
    fleet.fail_push = None
    await run_grpo(settings, _tasks(), fleet, out, weights=fleet, echo=lambda _: None, resume=True)
    assert [r["step"] for r in _rows(out)] == [1, 2, 3]
    traces = [json.loads(x)["step"] for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert traces == [1] * 8 + [2] * 8 + [3] * 8  # step 2's traces of the cut job were dropped, then written again
    assert fleet.resubmitted == ["demo-calc-add-step2", "demo-slugify-step2"]  # its groups were not sampled again


async def test_an_asynchronous_run_hands_its_outstanding_groups_to_the_next_job(tmp_path: Path) -> None:
    model_dir = small_qwen3_dir(tmp_path)
    settings = TrainerSettings(algorithm="grpo", model=str(model_dir), steps=4, learning_rate=1e-2, max_staleness=1)
    held = {"demo-slugify-step2"}
    fleet, out, control = StoreFleet(model_dir), tmp_path / "run", RunControl()
    fleet.ready = lambda task_id, _updates: task_id not in held
    first = asyncio.create_task(run_grpo(settings, _tasks(), fleet, out, weights=fleet, echo=lambda _: None,
                                         control=control))
    await until(lambda: (out / "checkpoints" / "step-1" / STATE).exists(), what="step 1's state")
    control.stop_now()  # a step waits for groups (the held one, or round 3 not yet submitted), or has not begun
    await first
    assert control.handed_over and control.last_step in (1, 2) and not fleet.cancelled  # none cancelled on the server
    point = resume_point(out / "checkpoints")
    assert point is not None and point.step == control.last_step
    left = {g["request"]["task_id"] for g in point.loop["feed"]["groups"]}
    assert "demo-slugify-step2" in left  # sampled ahead, never trained: it goes to the next job

    held.clear()
    async with fleet.changed:
        fleet.changed.notify_all()
    await run_grpo(settings, _tasks(), fleet, out, weights=fleet, echo=lambda _: None, resume=True)
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["staleness/max"] <= 1 for r in rows)
    trained = [(json.loads(x)["step"], json.loads(x)["task_id"]) for x in
               (out / "trajectories.jsonl").read_text().splitlines()]
    groups = [task for _, task in dict.fromkeys(trained)]
    assert len(groups) == len(set(groups)) == 8  # every group trained once, none twice
    assert set(fleet.resubmitted) == left  # re-attached, not sampled again


def test_kept_rows_drop_later_steps_and_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "train_metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "loss": 0.5}\n{"step": 2}\n{"step": 3, "lo')
    assert kept_rows(path, 1) == [{"step": 0}, {"step": 1, "loss": 0.5}]
    assert [json.loads(x) for x in path.read_text().splitlines()] == [{"step": 0}, {"step": 1, "loss": 0.5}]
    assert kept_rows(tmp_path / "missing.jsonl", 3) == [] and resume_point(tmp_path / "none") is None
