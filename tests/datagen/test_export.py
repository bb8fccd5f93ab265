"""write_dataset: the released SFT shape, the repository split on disk, failures for verifier data, the summary."""

from __future__ import annotations

import json

import pytest

from polar_gym.datagen import DatagenConfig, dataset_requests, pass_at_k, retry_requests, write_dataset
from tests.datagen._datagen_kit import EXAMPLE, empty_result, session_result, template

RELEASED = {"instance_id", "repo", "problem_statement", "base_commit", "version", "messages"}


def run():
    """Every example task sampled twice; acme__calc-1 sample 1 empty then retried into a pass."""
    tasks = dataset_requests(template(), str(EXAMPLE))
    results = []
    for task in tasks:
        meta = task.metadata.model_dump()
        results.append(session_result(task.task_id, 0, task_meta=meta))
        results.append(session_result(task.task_id, 1, reward=0.0, passed=False, task_meta=meta))
    results[1] = empty_result("acme__calc-1", 1, task_meta=tasks[0].metadata.model_dump())
    (retry,) = retry_requests([("acme__calc-1", 1)], tasks)
    results.append(session_result(retry.task_id, 0, task_meta=retry.metadata.model_dump()))
    return tasks, results


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_write_dataset_writes_the_released_shape_split_by_repository(tmp_path):
    tasks, results = run()
    summary = write_dataset(tmp_path, results, tasks, {"test_fraction": 0.3, "seed": 3})
    train, test = lines(tmp_path / "sft" / "train.jsonl"), lines(tmp_path / "sft" / "test.jsonl")
    assert train and test and not (tmp_path / "verifier").exists()
    assert {r["repo"] for r in train}.isdisjoint({r["repo"] for r in test})
    for record in train + test:
        assert RELEASED <= set(record) and record["passed"] is True and record["reward"] == 1.0
        assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
        call = record["messages"][2]["tool_calls"][0]
        assert call["function"]["name"] == "bash" and record["messages"][3]["tool_call_id"] == call["id"]
        assert record["messages"][-1] == {"role": "assistant", "content": "Fixed calc.py."}
        assert record["tools"][0]["function"]["name"] == "bash"
        task = next(t for t in tasks if t.task_id == record["instance_id"])
        assert record["problem_statement"] == task.instruction
        assert record["repo"] == task.metadata.model_dump()["repo"]
    # 6 sample-0 passes + the retried sample of acme__calc-1
    assert len(train) + len(test) == 7 == summary.kept
    retried = [r for r in train + test if r["attempt"] == 2]
    assert [(r["instance_id"], r["sample_index"]) for r in retried] == [("acme__calc-1", 1)]
    assert json.loads((tmp_path / "datagen_summary.json").read_text()) == summary.model_dump(mode="json")


def test_the_summary_counts_the_run(tmp_path):
    tasks, results = run()
    summary = write_dataset(tmp_path, results, tasks, DatagenConfig(test_fraction=0.3, seed=3))
    assert (summary.tasks, summary.sessions, summary.samples, summary.retried) == (6, 13, 12, 1)
    assert (summary.passed, summary.failed, summary.empty) == (7, 5, 0)
    assert summary.acceptance_rate == pytest.approx(7 / 12)
    assert summary.instances["train"] + summary.instances["test"] == 6
    assert set(summary.repos["train"]) | set(summary.repos["test"]) == {
        "acme/calc", "globex/mathkit", "acme/slugs", "initech/parser", "umbrella/shop"}
    assert summary.per_repo["umbrella/shop"] == {"tasks": 2, "attempts": 4, "accepted": 2, "acceptance_rate": 0.5}
    assert summary.per_task["acme__calc-1"]["pass@1"] == 1.0
    assert summary.per_task["acme__slugs-3"] == {"repo": "acme/slugs", "samples": 2, "passed": 1, "empty": 0,
                                                 "pass@1": 0.5, "pass@2": 1.0}


def test_keep_failures_writes_labelled_failures_for_verifier_data(tmp_path):
    tasks, results = run()
    results.append(empty_result("initech__parser-12", 2))  # empty: never verifier data
    summary = write_dataset(tmp_path, results, tasks, DatagenConfig(keep_failures=True))
    failures = lines(tmp_path / "verifier" / "failures.jsonl")
    assert len(failures) == 5 == summary.kept_failures and summary.empty == 1
    assert all(f["passed"] is False and f["reward"] == 0.0 for f in failures)
    assert {f["metadata"]["rejection_reason"] for f in failures} == {"evaluator: not passed (reward 0)"}
    assert all(RELEASED <= set(f) for f in failures)


def test_nothing_accepted_still_writes_empty_files(tmp_path):
    tasks = dataset_requests(template(), str(EXAMPLE), limit=1)
    summary = write_dataset(tmp_path, [empty_result(tasks[0].task_id, 0, kind="error")], tasks)
    assert (tmp_path / "sft" / "train.jsonl").read_text() == "" == (tmp_path / "sft" / "test.jsonl").read_text()
    assert (summary.kept, summary.empty, summary.acceptance_rate) == (0, 1, 0.0)


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)
