"""A real launch's report.html in real headless Chromium: it opens from a file:// URL with no console error and no
request leaving the machine, every plot is drawn (its <svg> has a size on the page), and the key numbers are the
ones in results.jsonl. The screenshot (test-artifacts/report.png) is the one the README shows."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.report.figures import FIGURES
from tests._browser import open_page

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_launchs_report_opens_offline_with_its_plots_and_the_numbers_of_results_jsonl(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "polar_gym.launch", "launcher.progress=false", "num_samples=2",
                           f"out_dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"report: {out / 'report.html'}" in proc.stderr
    assert "Report: [report.html](report.html)" in (out / "summary.md").read_text()
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    rewards = [r["evaluation"]["reward"] for r in results if r["evaluation"]]
    expected = {"sessions": str(len(results)), "completed": str(sum(r["status"] == "COMPLETED" for r in results)),
                "errors by cause": "none", "mean reward": f"{sum(rewards) / len(rewards):.3f}",
                "traces": str(sum(r["traces"] for r in results)),
                "trainable tokens": str(sum(r["trajectory_diagnostics"]["trainable_tokens"] for r in results)),
                "contiguity": "ok"}
    with open_page((out / "report.html").as_uri()) as opened:
        page = opened.page
        for name in FIGURES[:-1]:  # all but the training curves (no training here)
            box = page.locator(f"#fig-{name} > svg").bounding_box()
            assert box is not None and box["width"] > 200 and box["height"] > 100, (name, box)
        shown = {key: page.locator(f'.card[data-key="{key}"] .value').inner_text() for key in expected}
        assert shown == expected
        assert page.locator("#session-table tbody tr").count() == len(results)
        assert page.locator("#fidelity-line").inner_text().startswith(f"fidelity: {expected['trainable tokens']} ")
        page.locator("#config summary").click()
        assert "harness:" in page.locator("#config pre").inner_text()
        opened.screenshot("report")
        assert opened.problems == []
