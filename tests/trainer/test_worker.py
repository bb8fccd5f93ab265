"""trainer.cpus: the trainer's torch work on one thread of its own, pinned; the rest of the process left alone."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from polar_gym.tasks import DEMO_TASKS
from polar_gym.trainer import TrainerSettings, run_grpo
from polar_gym.trainer.policy import Trainer
from polar_gym.trainer.worker import TrainerWorker, parse_cpu_list, pinned
from tests.trainer._tiny import small_qwen3_dir
from tests.trainer.test_grpo import FakeFleet


@pytest.mark.parametrize(("text", "cpus"), [("1", {1}), ("0-3", {0, 1, 2, 3}), ("0,2-3", {0, 2, 3}), ("5,5", {5})])
def test_a_cpu_list_reads_as_taskset_writes_it(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "1,,2", " 1", "1 ", "3-1", "0x1", "1;rm -rf /"])
def test_a_malformed_cpu_list_is_refused_by_the_settings_and_the_parser(text: str) -> None:
    with pytest.raises(ValueError, match="CPU"):
        parse_cpu_list(text)
    with pytest.raises(ValidationError):
        TrainerSettings(algorithm="grpo", cpus=text)


def _one_cpu() -> int:
    return min(os.sched_getaffinity(0))


async def test_the_worker_runs_on_its_cpus_on_one_thread_and_leaves_the_caller_alone() -> None:
    before = os.sched_getaffinity(0)
    cpu = _one_cpu()
    worker = TrainerWorker(str(cpu))
    try:
        seen = [await worker.run(lambda: (threading.get_native_id(), os.sched_getaffinity(0))) for _ in range(3)]
    finally:
        worker.close()
    assert {tid for tid, _ in seen} != {threading.get_native_id()} and len({tid for tid, _ in seen}) == 1
    assert all(cpus == {cpu} for _, cpus in seen)
    assert os.sched_getaffinity(0) == before


async def test_an_unpinned_worker_keeps_the_process_affinity() -> None:
    worker = TrainerWorker(None)
    try:
        assert await worker.run(os.sched_getaffinity, 0) == os.sched_getaffinity(0)
    finally:
        worker.close()


def test_a_cpu_the_machine_does_not_have_fails_before_anything_runs() -> None:
    missing = (os.cpu_count() or 1) + 4096
    with pytest.raises(ValueError, match=rf"trainer.cpus {missing} cannot be used here"):
        TrainerWorker(str(missing))
    with pytest.raises(ValueError, match="cannot be used here"), pinned(str(missing)):
        pass


def test_pinned_restores_the_threads_affinity() -> None:
    before = os.sched_getaffinity(0)
    with pinned(str(_one_cpu())):
        assert os.sched_getaffinity(0) == {_one_cpu()}
    assert os.sched_getaffinity(0) == before
    with pinned(None):
        assert os.sched_getaffinity(0) == before


async def test_a_grpo_run_with_cpus_trains_and_saves_on_the_pinned_thread(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: pinned and unpinned are the same")
    model_dir = small_qwen3_dir(tmp_path)
    fleet = FakeFleet(model_dir)
    seen: dict[str, list[set[int]]] = {"grpo_step": [], "save": []}
    for name in seen:
        original = getattr(Trainer, name)

        def recording(self: Trainer, *args: Any, _name: str = name, _original: Any = original) -> Any:
            seen[_name].append(os.sched_getaffinity(0))
            return _original(self, *args)

        monkeypatch.setattr(Trainer, name, recording)
    tasks = [DEMO_TASKS["demo-calc-add"].to_request(harness="pi", model_name="policy", num_samples=4)]
    cpu = _one_cpu()
    settings = TrainerSettings(algorithm="grpo", model=str(model_dir), steps=2, learning_rate=1e-2, cpus=str(cpu))
    before = os.sched_getaffinity(0)
    await run_grpo(settings, tasks, fleet, tmp_path / "run", weights=fleet, echo=lambda _: None)
    assert seen == {"grpo_step": [{cpu}, {cpu}], "save": [{cpu}, {cpu}]}
    assert os.sched_getaffinity(0) == before and [v for _, v in fleet.updates] == [1, 2]
