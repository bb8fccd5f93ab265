"""The launch default (``python -m polar_gym.launch``: pi on the oracle) runs token_in: with drift on, each session is
one chain and its records say token_in, and the run writes what tests/launch/test_launch.py's check_two_demo_run
expects of a launch; ``inference.prompt_mode=chat`` keeps whole renders, where drift breaks, and the breaks show by
cause in the console, summary.md and report.html."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.journal import read_session
from tests.launch.test_launch import check_two_demo_run

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def launch(out: Path, *overrides: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                 subprocess.CompletedProcess[str]]:
    """(results, capture records, the process) of a launch on two demo tasks with the oracle drifting every second
    call; its fidelity line (summary.md and the console) says what results.jsonl says."""
    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")
    proc = subprocess.run([sys.executable, "-m", "polar_gym.launch", "tasks.ids=[demo-calc-add,demo-slugify]",
                           "inference.drift_every=2", f"out_dir={out}", *overrides], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "COLUMNS": "160"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert all(r["status"] == "COMPLETED" for r in results), results
    records = [r.model_dump() for path in sorted((out / "capture").glob("*/attempts/*"))
               for r in read_session(path)]
    assert len(records) == sum(r["completions"] for r in results)
    breaks: dict[str, int] = {}
    for r in results:
        for cause, n in r["trajectory_diagnostics"]["breaks"].items():
            breaks[cause] = breaks.get(cause, 0) + n
    modes = {m: sum(r["prompt_mode"] == m for r in records) for m in {r["prompt_mode"] for r in records}}
    trainable = sum(r["trajectory_diagnostics"]["trainable_tokens"] for r in results)
    expected = (f"fidelity: {trainable} trainable", f"in {sum(r['traces'] for r in results)} traces",
                "new chains by cause: " + (", ".join(f"{c} {n}" for c, n in sorted(breaks.items(),
                                                                                 key=lambda x: -x[1])) or "none"),
                "contiguity ok", "prompt mode " + ", ".join(f"{m} {n}" for m, n in modes.items()))
    summary, console = (out / "summary.md").read_text(), " ".join((proc.stdout + proc.stderr).split())
    for part in expected:
        assert part in summary and part in console, (part, summary, console[-3000:])
    return results, records, proc


def test_the_launch_default_is_token_in_and_drift_breaks_no_chain(tmp_path):
    results, records, proc = launch(tmp_path / "run")
    check_two_demo_run(tmp_path / "run", proc)
    assert {r["prompt_mode"] for r in records} == {"token_in"}
    assert [r["traces"] for r in results] == [1, 1]
    assert all(r["trajectory_diagnostics"]["breaks"] == {} for r in results)
    assert sum(r["completions"] for r in results) >= 4  # so calls drifted (every second one)


def test_prompt_mode_chat_keeps_whole_renders_where_drift_breaks_chains(tmp_path):
    out = tmp_path / "run"
    results, records, proc = launch(out, "inference.prompt_mode=chat")
    assert {r["prompt_mode"] for r in records} == {"chat"}
    drift = sum(r["trajectory_diagnostics"]["breaks"].get("drift", 0) for r in results)
    assert drift >= 1 and sum(r["traces"] for r in results) > len(results)  # more chains than conversations
    # the breaks by cause, in the console and summary.md (launch() checks both) and in report.html
    line = f"new chains by cause: drift {drift};"
    report = (out / "report.html").read_text()
    assert line in report and f"<td>drift breaks</td><td class=num>{drift}</td>" in report
    console = " ".join(proc.stderr.split())
    assert f"report: {out / 'report.html'}" in console and f"traces: python -m polar_gym.view {out}" in console
