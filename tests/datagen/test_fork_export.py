"""A forked task's datagen export: with ``sft_include_failures`` the wrong demos (reward 0, with model output) join
the right ones in the SFT files, labelled with their reward, and every record names the oracle script it came from
(``metadata.oracle_variant``), which is what the trainer's reference-answer evaluation reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from polar_gym.datagen import DatagenConfig, dataset_requests, oracle_variant_of, retry_requests, write_dataset
from polar_gym.schema import SessionSpec, TaskRequest
from polar_gym.tasks.forks import TaskFork, fork_requests
from tests.datagen._datagen_kit import EXAMPLE, empty_result, session_result, template


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _forked_run() -> tuple[list[TaskRequest], list[Any]]:
    """acme__calc-1 forked (reference / wrong, round robin over 4 samples): the reference passes, the wrong one
    fails; each result carries its session's task metadata as the gateway writes it. Sample 3 is empty."""
    tasks = dataset_requests(template(num_samples=4), str(EXAMPLE), ids=["acme__calc-1"])
    tasks = fork_requests(tasks, [TaskFork(name="wrong", replace={"return a + b": "return a * b"})])
    (task,) = tasks
    results = []
    for i in range(task.num_samples):
        meta = SessionSpec.from_task(task, i).metadata.model_dump()
        right = meta["oracle_variant"] == "reference"
        results.append(session_result(task.task_id, i, reward=1.0 if right else 0.0, passed=right, task_meta=meta)
                       if i < 3 else empty_result(task.task_id, i, task_meta=meta))
    return tasks, results


def test_sft_include_failures_writes_the_wrong_demos_beside_the_right_ones_with_their_variant(tmp_path: Path) -> None:
    tasks, results = _forked_run()
    assert [oracle_variant_of(r) for r in results] == ["reference", "wrong", "reference", "wrong"]
    summary = write_dataset(tmp_path, results, tasks, DatagenConfig(sft_include_failures=True))
    train = _lines(tmp_path / "sft" / "train.jsonl")
    assert [(r["sample_index"], r["metadata"]["oracle_variant"], r["reward"], r["passed"]) for r in train] == [
        (0, "reference", 1.0, True), (2, "reference", 1.0, True), (1, "wrong", 0.0, False)]  # sample 3: empty
    assert train[2]["metadata"]["rejection_reason"] == "evaluator: not passed (reward 0)"
    assert not (tmp_path / "verifier").exists()  # keep_failures is its own switch
    assert (summary.kept, summary.kept_failures, summary.sft_records) == (2, 0, {"train": 3, "test": 0,
                                                                                "failures": 0})


def test_without_sft_include_failures_only_passing_records_and_keep_failures_is_unchanged(tmp_path: Path) -> None:
    tasks, results = _forked_run()
    write_dataset(tmp_path, results, tasks, DatagenConfig(keep_failures=True))
    train = _lines(tmp_path / "sft" / "train.jsonl")
    assert [(r["sample_index"], r["metadata"]["oracle_variant"]) for r in train] == [(0, "reference"),
                                                                                    (2, "reference")]
    failures = _lines(tmp_path / "verifier" / "failures.jsonl")
    assert [(r["sample_index"], r["metadata"]["oracle_variant"], r["passed"]) for r in failures] == [
        (1, "wrong", False)]


def test_a_record_of_a_task_without_variants_says_reference_and_a_retry_keeps_its_variant(tmp_path: Path) -> None:
    tasks = dataset_requests(template(), str(EXAMPLE), ids=["acme__slugs-3"])
    plain = session_result(tasks[0].task_id, 0, task_meta={"repo": "acme/slugs"})  # no oracle_variant at all
    forked = fork_requests(tasks, [TaskFork(name="under", replace={'"-".join': '"_".join'})])
    first = empty_result(forked[0].task_id, 1, task_meta=SessionSpec.from_task(forked[0], 1).metadata.model_dump())
    (retry,) = retry_requests([(forked[0].task_id, 1)], forked)
    again = session_result(retry.task_id, 0, task_meta=SessionSpec.from_task(retry, 0).metadata.model_dump())
    write_dataset(tmp_path, [plain, first, again], forked, DatagenConfig(sft_include_failures=True))
    train = _lines(tmp_path / "sft" / "train.jsonl")
    # the retry of sample 1 plays what sample 1 played (the variant), though it is the retry task's sample 0
    assert [(r["sample_index"], r["attempt"], r["metadata"]["oracle_variant"]) for r in train] == [
        (0, 1, "reference"), (1, 2, "under")]
    assert '"_".join' in SessionSpec.from_task(retry, 0).metadata.model_dump()["oracle"]["commands"][0]
