"""Issue 35: a finished run's folder is its owner's only (every file holding prompts or completions 0600, its
directories 0700: trajectories.jsonl and server.sqlite were 0644), the rollout store goes to ``state_dir`` when
given, and a second launch into the folder is refused (break 7: it returned the old sessions as new ones) unless
``resume=true``, which says what it resumed. Real launches: pi in bubblewrap, the oracle engine."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from polar_gym.assets import tokenizer_dir

ROOT = Path(__file__).resolve().parents[2]
TASK = "tasks.ids=[demo-calc-add]"


def _launch(*overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "polar_gym.launch", TASK, "launcher.progress=false", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})


def _others_can_reach(path: Path, top: Path) -> bool:
    """Whether a user other than the owner (group or world) can read ``path``: its own read bit and the search bit
    of every directory from ``top`` down to it."""
    if path.stat().st_mode & 0o044 == 0:
        return False
    return all(parent.stat().st_mode & 0o011 for parent in path.parents if parent.is_relative_to(top))


def _sandbox_files(path: Path) -> bool:
    """A sandbox's own files (gateway/SESSION/ATTEMPT/sandbox/...): the agent made them, with its modes."""
    parts = path.parts
    return "sandbox" in parts and "gateway" in parts[:parts.index("sandbox")]


@pytest.mark.slow
def test_a_run_folder_is_private_and_a_second_launch_into_it_is_refused_unless_resumed(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")
    out, state = tmp_path / "run", tmp_path / "local-disk" / "state"
    first = _launch(f"out_dir={out}", f"state_dir={state}")
    assert first.returncode == 0, first.stderr[-3000:]

    # the store went to state_dir; every file the run wrote is the owner's only
    assert (state / "server.sqlite").is_file() and not (out / "server.sqlite").exists()
    for name in ("trajectories.jsonl", "results.jsonl", "calls.jsonl", "summary.md", "report.html", "config.yaml",
                 "server.json"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600, name
    paths = [p for root in (out, state) for p in [root, *root.rglob("*")] if not p.is_symlink()]
    assert {p.name for p in paths} >= {"records.jsonl", "tokens.bin", "result.json", "harness.stderr"}
    ours = [p for p in paths if not _sandbox_files(p)]
    assert [f"{stat.filemode(p.stat().st_mode)} {p}" for p in ours if p.stat().st_mode & 0o077] == []
    assert [p for p in paths if p.is_file() and _others_can_reach(p, tmp_path)] == []

    # the same folder again, asked for something else: refused before anything starts, the folder untouched
    config, results = (out / "config.yaml").read_text(), (out / "results.jsonl").read_text()
    again = _launch(f"out_dir={out}", f"state_dir={state}", "num_samples=2", "+builder=per_request")
    assert again.returncode == 2
    assert again.stderr == (f"polar_gym.launch: configuration error: out_dir: {out} holds an earlier run "
                            "(server.sqlite with 1 task(s), results.jsonl, trajectories.jsonl, summary.md); pick "
                            "another out_dir, or add resume=true to resume it\n")
    assert (out / "config.yaml").read_text() == config and (out / "results.jsonl").read_text() == results

    # resumed as asked: the session comes from the store and the console says so
    resumed = _launch(f"out_dir={out}", f"state_dir={state}", "resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (f"resume=true: 1 of 1 task(s) come from the earlier run's store ({state / 'server.sqlite'}): "
            "1 session(s) finished there, 0 to run; 0 new task(s)") in resumed.stderr
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["session_id"] for r in rows] == [json.loads(results.splitlines()[0])["session_id"]]
