"""A forked task through the real launch (rollout server, gateway, pi in bubblewrap, oracle engine, the demo's
tests): demo-calc-add with a wrong variant (``return a * b`` for ``return a + b``, one token apart), four samples
alternating reference / wrong. The evaluator gives the reference 1 and the wrong one 0, and with
``datagen.sft_include_failures`` both land in sft/train.jsonl, each record naming its oracle variant."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from polar_gym.assets import tokenizer_dir

ROOT = Path(__file__).resolve().parents[2]
#: the command line of docs/datagen.md's "Forking a task" (Hydra cannot quote a mapping's keys: replace is a list)
FORK = 'forks=[{name: wrong, replace: [{old: "return a + b", new: "return a * b"}]}]'


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_forked_demo_gives_the_reference_reward_1_the_wrong_variant_0_and_sft_records_of_both(
        tmp_path: Path) -> None:
    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "polar_gym.launch", "+datagen=sft", "tasks.ids=[demo-calc-add]",
                           "num_samples=4", FORK, "datagen.sft_include_failures=true", "launcher.progress=false",
                           f"out_dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]

    played = {}
    for result in _lines(out / "results.jsonl"):
        meta = result["metadata"]
        assert result["status"] == "COMPLETED"
        script = meta["task_metadata"]["oracle"]["commands"][0]
        variant = meta["task_metadata"]["oracle_variant"]
        assert ("return a * b" in script) == (variant == "wrong")
        played[meta["sample_index"]] = (variant, result["evaluation"]["reward"])
    assert played == {0: ("reference", 1.0), 1: ("wrong", 0.0), 2: ("reference", 1.0), 3: ("wrong", 0.0)}

    train = _lines(out / "datagen" / "sft" / "train.jsonl")
    by_sample = {r["sample_index"]: r for r in train}
    assert sorted(by_sample) == [0, 1, 2, 3] and len(train) == 4  # one prefix-merged trace per session
    for index, (variant, reward) in played.items():
        record = by_sample[index]
        assert record["metadata"]["oracle_variant"] == variant
        assert (record["reward"], record["passed"]) == (reward, reward == 1.0)
        calls = json.dumps(record["messages"])
        assert ("return a * b" in calls) == (variant == "wrong") and ("return a + b" in calls) == (
            variant == "reference")
