"""Offline data generation through the real launch (rollout server, gateway, pi in bubblewrap, oracle engine):
a dataset fanned out with n samples, rejection sampling by the evaluator, one retry of empty generations, and the
SFT export with a repository-grouped split."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polar_gym.assets import tokenizer_dir

ROOT = Path(__file__).resolve().parents[2]

ROWS = [
    {"instance_id": "acme__calc-1", "repo": "acme/calc", "demo": "demo-calc-add"},
    {"instance_id": "acme__slug-2", "repo": "acme/slugs", "demo": "demo-slugify"},
    # the policy answers without doing the work: the evaluator fails it
    {"instance_id": "globex__noop-3", "repo": "globex/noop", "instruction": "create done.txt",
     "test_command": "test -f done.txt", "oracle": {"commands": [], "final_answer": "I will not do it."}},
    # the sandbox set-up fails before the harness runs: no generation at all, retried once, still empty
    {"instance_id": "initech__broken-4", "repo": "initech/broken", "instruction": "create done.txt",
     "setup": "exit 3", "test_command": "test -f done.txt"},
]


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_datagen_run_keeps_passing_trajectories_retries_empty_ones_once_and_splits_by_repo(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")
    dataset = tmp_path / "tasks.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "polar_gym.launch", "+datagen=sft", "tasks=dataset",
                           f"tasks.path={dataset}", "num_samples=2", "datagen.keep_failures=true",
                           "datagen.test_fraction=0.5", "launcher.progress=false", f"out_dir={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "retrying 2 empty generation(s) once" in proc.stderr

    results = _lines(out / "results.jsonl")
    by_task: dict[str, list[str]] = {}
    for r in results:
        by_task.setdefault(str(r["task_id"]), []).append(str(r["status"]))
    assert sorted(by_task) == ["acme__calc-1", "acme__slug-2", "globex__noop-3", "initech__broken-4",
                               "initech__broken-4--retry"]
    assert by_task["initech__broken-4"] == ["ERROR", "ERROR"] and by_task["initech__broken-4--retry"] == ["ERROR"] * 2

    summary = json.loads((out / "datagen" / "datagen_summary.json").read_text())
    assert {k: summary[k] for k in ("tasks", "sessions", "samples", "retried", "empty", "passed", "failed", "kept",
                                    "kept_failures")} == {
        "tasks": 4, "sessions": 10, "samples": 8, "retried": 2, "empty": 2, "passed": 4, "failed": 2, "kept": 4,
        "kept_failures": 2}
    train, test = _lines(out / "datagen" / "sft" / "train.jsonl"), _lines(out / "datagen" / "sft" / "test.jsonl")
    assert len(train) + len(test) == 4  # one prefix-merged trace per passing session
    train_repos, test_repos = {r["repo"] for r in train}, {r["repo"] for r in test}
    assert train_repos | test_repos == {"acme/calc", "acme/slugs"} and not train_repos & test_repos
    assert set(summary["repos"]["train"]).isdisjoint(summary["repos"]["test"])
    for record in train + test:
        assert record["passed"] is True and record["reward"] == 1.0
        messages = record["messages"]
        assert messages[0]["role"] in ("system", "user") and messages[-1]["role"] == "assistant"  # type: ignore[index]
        assert any(m.get("tool_calls") for m in messages)  # type: ignore[union-attr]
    failures = _lines(out / "datagen" / "verifier" / "failures.jsonl")
    assert len(failures) == 2 and all(f["instance_id"] == "globex__noop-3" and f["passed"] is False
                                      for f in failures)
