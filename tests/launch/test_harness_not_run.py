"""A harness whose CLI is not there is an infrastructure failure of the run, not a reward 0 (issue 35, break 8: exit
127 with zero model calls was COMPLETED, reward 0, and the launch exited 0). Through the real launch, gateway and
local sandbox."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_harness_cli_that_is_not_installed_ends_error_and_the_launch_exits_3(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is needed: run `bash scripts/setup.sh`")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "polar_gym.launch", "+harness=shell",
                           '+harness.config.command="polar-not-installed-cli --go"', "tasks.ids=[demo-calc-add]",
                           f"out_dir={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 3, proc.stderr[-4000:]
    (result,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert result["status"] == "ERROR" and result["error_cause"] == "harness_not_run"
    assert result["evaluation"] is None and result["metadata"]["harness"]["exit_code"] == 127
    assert result["reason"].startswith("harness_not_run: the harness command exited 127 before any model call")
    console = " ".join(proc.stderr.split() + proc.stdout.split())
    assert "harness_not_run: 1 session(s)" in console and "polar-not-installed-cli: not found" in console
    assert "sessions failed for infrastructure reasons (harness_not_run)" in console
