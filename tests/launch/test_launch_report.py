"""Drift shows where a researcher looks: a launch whose engine drifts (the oracle samples a non-canonical
tokenization every second call) with prompts rendered by the engine (``prompt_mode=chat``: in token_in mode the
proxy reuses the sampled ids and drift breaks nothing) counts the new chains by cause in the console, summary.md and
report.html, with the numbers of results.jsonl."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polar_gym.assets import tokenizer_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_drift_breaks_show_by_cause_in_the_console_summary_and_report(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "polar_gym.launch", "launcher.progress=false",
                           "inference.drift_every=2", "inference.prompt_mode=chat", f"out_dir={out}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "400"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    drift = sum(r["trajectory_diagnostics"]["breaks"].get("drift", 0) for r in results)
    assert drift > 0 and sum(r["traces"] for r in results) > len(results)  # more chains than conversations
    line = f"new chains by cause: drift {drift};"
    assert line in proc.stderr and line in (out / "summary.md").read_text()
    assert "prompt mode chat" in proc.stderr
    report = (out / "report.html").read_text()
    assert line in report and f"<td>drift breaks</td><td class=num>{drift}</td>" in report
    assert f"report: {out / 'report.html'}" in proc.stderr
