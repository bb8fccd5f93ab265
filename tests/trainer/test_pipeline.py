"""Asynchronous GRPO (trainer.max_staleness): rounds sampled ahead of the trainer, groups trained as they complete,
stale groups dropped or kept, per-sample staleness in every row; and the pure staleness functions behind it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from polar_gym.schema import SessionResult, SessionStatus, TaskRequest, Trace, Trajectory
from polar_gym.tasks import DEMO_TASKS
from polar_gym.trainer import TrainerSettings, grpo_sequences, run_grpo
from polar_gym.trainer.staleness import mixed_version_mask, sample_age, staleness_stats, token_versions
from tests.trainer._tiny import small_qwen3_dir
from tests.trainer.test_grpo import FakeFleet


class AheadFleet(FakeFleet):
    """A fleet whose sessions are sampled when their group is submitted (by the weights the engines hold then) and
    finish when ``ready(task_id, updates)`` says so (default: at once): a slow group can be held across updates."""

    def __init__(self, model_dir: Path, ready: Callable[[str, int], bool] | None = None) -> None:
        super().__init__(model_dir)
        self.sampled: dict[str, list[SessionResult]] = {}
        self.versions_at_submit: dict[str, int | str] = {}
        self.ready = ready or (lambda _task, _updates: True)
        self.changed = asyncio.Condition()
        self.cancelled: list[str] = []

    async def submit(self, task: TaskRequest) -> dict[str, Any]:
        await super().submit(task)
        self.versions_at_submit[task.task_id] = self.version
        self.sampled[task.task_id] = [self._session(task, i) for i in range(task.num_samples)]
        return {"created": True}

    async def results(self, task_ids: Iterable[str], *, timeout: float = 0, poll: float = 0
                      ) -> AsyncIterator[SessionResult]:
        for task_id in task_ids:
            async with self.changed:
                await self.changed.wait_for(lambda t=task_id: self.ready(t, len(self.updates)))
            for result in self.sampled[task_id]:
                yield result

    async def update_weights(self, checkpoint: str, version: int | str) -> dict[str, Any]:
        reply = await super().update_weights(checkpoint, version)
        async with self.changed:
            self.changed.notify_all()
        return reply

    async def cancel(self, task_id: str) -> dict[str, Any]:
        self.cancelled.append(task_id)
        return {}


def _tasks(samples: int = 4) -> list[TaskRequest]:
    return [DEMO_TASKS[name].to_request(harness="pi", model_name="policy", num_samples=samples)
            for name in ("demo-calc-add", "demo-slugify")]


def _rows(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (out / "train_metrics.jsonl").read_text().splitlines()]
    for row in rows:  # every sampled token is trained or masked with a reason
        masked = sum(v for k, v in row.items() if k.startswith("masked_tokens/"))
        assert row["tokens/sampled"] == row["tokens/trained"] + masked, row
    return rows


async def test_staleness_one_samples_the_next_round_before_the_update_and_logs_each_samples_age(
        tmp_path: Path) -> None:
    model_dir = small_qwen3_dir(tmp_path)
    fleet = AheadFleet(model_dir)
    settings = TrainerSettings(algorithm="grpo", model=str(model_dir), steps=3, learning_rate=1e-2, max_staleness=1)
    await run_grpo(settings, _tasks(), fleet, tmp_path / "run", weights=fleet, echo=lambda _: None)
    # rounds 1 and 2 were both submitted under version 0 (before the first update); round 3 under version 1
    assert {t: v for t, v in fleet.versions_at_submit.items() if t.endswith("step2")} == {
        "demo-calc-add-step2": 0, "demo-slugify-step2": 0}
    assert fleet.versions_at_submit["demo-calc-add-step3"] == 1
    rows = _rows(tmp_path / "run")
    assert [r["staleness/per_sample"] for r in rows] == [[0] * 8, [1] * 8, [1] * 8]
    assert [r["staleness/max"] for r in rows] == [0, 1, 1] and all(r["staleness/unknown"] == 0 for r in rows)
    assert [r["sampled_versions"] for r in rows] == [["0"], ["0"], ["1"]]
    assert [r["rounds"] for r in rows] == [[1, 1], [2, 2], [3, 3]]
    assert [v for _, v in fleet.updates] == [1, 2, 3] and all(r["stale_groups_dropped"] == 0 for r in rows)
    assert len(fleet.submitted) == 6  # no round beyond the run's steps
    assert ">staleness/max<" in (tmp_path / "run" / "train_metrics.svg").read_text()  # plotted


async def test_synchronous_loop_samples_each_round_with_the_weights_it_trains(tmp_path: Path) -> None:
    model_dir = small_qwen3_dir(tmp_path)
    fleet = AheadFleet(model_dir)
    settings = TrainerSettings(algorithm="grpo", model=str(model_dir), steps=2, learning_rate=1e-2)
    await run_grpo(settings, _tasks(), fleet, tmp_path / "run", weights=fleet, echo=lambda _: None)
    assert [fleet.versions_at_submit[f"demo-calc-add-step{n}"] for n in (1, 2)] == [0, 1]
    assert [r["staleness/max"] for r in _rows(tmp_path / "run")] == [0, 0]


def _held_until(updates: int) -> Callable[[str, int], bool]:
    """calc-add's first group finishes only after ``updates`` weight updates; everything else at once."""
    return lambda task_id, done: task_id != "demo-calc-add-step1" or done >= updates


async def test_a_group_overtaken_by_later_rounds_is_dropped_when_stale_and_replaced(tmp_path: Path) -> None:
    model_dir = small_qwen3_dir(tmp_path)
    fleet = AheadFleet(model_dir, ready=_held_until(2))
    settings = TrainerSettings(algorithm="grpo", model=str(model_dir), steps=4, learning_rate=1e-2, max_staleness=1)
    said: list[str] = []
    await run_grpo(settings, _tasks(), fleet, tmp_path / "run", weights=fleet, echo=said.append)
    rows = _rows(tmp_path / "run")
    dropped = [r for r in rows if r["stale_groups_dropped"]]
    assert len(dropped) == 1 and dropped[0]["masked_tokens/stale"] == 16  # 4 sessions x 4 sampled tokens
    assert dropped[0]["tokens/sampled"] == 16 * 3 and dropped[0]["tokens/trained"] == 16 * 2
    assert all(r["staleness/max"] <= 1 for r in rows)  # what was trained stayed within the bound
    retries = [t.task_id for t in fleet.submitted if "retry" in t.task_id]
    assert retries and retries[0].startswith("demo-calc-add-step1-retry")
    assert any("dropped 1 stale group" in line and "demo-calc-add-step1" in line for line in said)


class FailingPushFleet(AheadFleet):
    async def update_weights(self, checkpoint: str, version: int | str) -> dict[str, Any]:
        raise RuntimeError("the fleet refused the checkpoint")


async def test_a_run_that_stops_cancels_the_groups_it_sampled_ahead(tmp_path: Path) -> None:
    model_dir = small_qwen3_dir(tmp_path)
    fleet = FailingPushFleet(model_dir, ready=lambda task_id, _updates: task_id.endswith("step1"))
    settings = TrainerSettings(algorithm="grpo", model=str(model_dir), steps=3, learning_rate=1e-2, max_staleness=1)
    with pytest.raises(RuntimeError, match="refused the checkpoint"):
        await run_grpo(settings, _tasks(), fleet, tmp_path / "run", weights=fleet, echo=lambda _: None)
    assert sorted(fleet.cancelled) == ["demo-calc-add-step2", "demo-slugify-step2"]


async def test_a_stale_group_is_trained_when_configured_to_correct_it(tmp_path: Path) -> None:
    model_dir = small_qwen3_dir(tmp_path)
    fleet = AheadFleet(model_dir, ready=_held_until(2))
    settings = TrainerSettings(algorithm="grpo", model=str(model_dir), steps=3, learning_rate=1e-2, max_staleness=1,
                               stale_groups="correct")
    await run_grpo(settings, _tasks(), fleet, tmp_path / "run", weights=fleet, echo=lambda _: None)
    rows = _rows(tmp_path / "run")
    assert max(r["staleness/max"] for r in rows) == 2 and all(r["stale_groups_dropped"] == 0 for r in rows)
    assert not [t for t in fleet.submitted if "retry" in t.task_id]


def _trace(versions: list[Any], mask: list[int]) -> Trace:
    spans, start = [], 0
    for i in range(1, len(versions) + 1):  # one span per run of equal versions among trained tokens
        if i == len(versions) or versions[i] != versions[start] or mask[i] != mask[start]:
            if mask[start]:
                spans.append({"start": start, "end": i, "policy_version": versions[start], "completion_id": "c"})
            start = i
    return Trace(prompt_ids=[1], response_ids=list(range(10, 10 + len(mask))), loss_mask=mask,
                 response_logprobs=[-0.5] * len(mask), metadata={"spans": spans})


def test_token_versions_follow_the_spans_and_tool_tokens_have_none() -> None:
    trace = _trace([3, 3, None, 4, 4], [1, 1, 0, 1, 1])
    assert token_versions(5, trace.metadata) == [3, 3, None, 4, 4]
    assert token_versions(3, {"policy_versions": [7]}) == [7, 7, 7]  # no spans: the trace's one version
    assert token_versions(2, {"policy_versions": [1, 2]}) == [None, None]  # several, no spans: unknown
    hostile = {"spans": [{"start": "0", "end": 2, "policy_version": 1}, "not a span", {"start": None},
                         {"start": -5, "end": 10**12, "policy_version": 2}]}
    assert token_versions(3, hostile) == [2, 2, 2]  # malformed spans mark nothing; ranges clipped to the trace


def test_a_samples_age_is_counted_from_its_oldest_trained_token() -> None:
    age = sample_age([3, 3, None, 4, "5"], [1, 1, 0, 1, 1], trainer_version=5)
    assert (age.oldest, age.newest, age.staleness, age.known) == (3, 5, 2, True)
    assert sample_age(["stock", None], [1, 0], 4) == sample_age([None], [1], 4)
    assert not sample_age(["stock"], [1], 4).known and sample_age(["stock"], [1], 4).staleness == 0
    stats = staleness_stats([sample_age([1], [1], 3), sample_age([3], [1], 3), sample_age(["x"], [1], 3)])
    assert stats.as_row() == {"staleness/mean": 1.0, "staleness/max": 2, "staleness/min": 0,
                              "staleness/per_sample": [2, 0], "staleness/unknown": 1}


def test_mixed_version_tokens_mask_keeps_only_the_newest_versions_tokens() -> None:
    assert mixed_version_mask([3, 3, None, 4, 4], [1, 1, 0, 1, 1]) == [0, 0, 0, 1, 1]
    assert mixed_version_mask(["a", None], [1, 0]) == [1, 0]  # nothing numbered: nothing masked
    trace = _trace([3, 3, None, 4, 4], [1, 1, 0, 1, 1])
    results = [SessionResult(session_id=f"s{i}", task_id="t", status=SessionStatus.COMPLETED,
                             trajectory=Trajectory(session_id=f"s{i}", traces=[trace])) for i in range(2)]
    assert [s.loss_mask for s in grpo_sequences(results)] == [[1, 1, 0, 1, 1]] * 2
    assert [s.loss_mask for s in grpo_sequences(results, mixed_versions="mask")] == [[0, 0, 0, 1, 1]] * 2


@pytest.mark.parametrize("bad", [-1])
def test_max_staleness_is_never_negative(bad: int) -> None:
    with pytest.raises(ValueError, match="max_staleness"):
        TrainerSettings(algorithm="grpo", max_staleness=bad)
