"""report.html from constructed runs: every figure and number is there, strings from the run are inert, an empty
run and a run where every session errored still render, and ``python -m polar_gym.report`` rebuilds the page from
a run's files with the launch's fidelity numbers."""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import polar_gym.report as report_pkg
from polar_gym import causes, plots
from polar_gym.merge.fidelity import Fidelity, run_fidelity
from polar_gym.plots import line_panels
from polar_gym.report import RunData, SessionRow, build_report, figures, files, load_run, model, render
from polar_gym.report.__main__ import main
from polar_gym.report.figures import FIGURES
from polar_gym.report.files import fidelity_of_diagnostics, fidelity_of_files
from polar_gym.report.model import HarnessFailureRow
from polar_gym.report.render import CSP
from polar_gym.schema import Trace, Trajectory
from tests.report._synthetic import HOSTILE, row, synthetic_rows, trace_line, write_run

ROOT = Path(__file__).resolve().parents[2]


def figure_ids(page: str) -> list[str]:
    return re.findall(r'<figure id="fig-([a-z-]+)"><svg', page)


def test_a_run_renders_every_figure_and_its_key_numbers() -> None:
    sessions = [SessionRow.from_row(r) for r in (row("a", "t1"), row("b", "t2", status="ERROR", reward=None,
                                                                     cause="upstream_unreachable",
                                                                     reason="upstream_unreachable: down"))]
    page = build_report(RunData("launch", sessions, Fidelity(sessions=2, traces=1, trainable_tokens=7,
                                                              breaks={"drift": 3})))
    assert figure_ids(page) == [f for f in FIGURES if f != "training"]
    assert '<div class="card " data-key="sessions"><div class="value">2</div>' in page
    assert 'data-key="errors by cause"><div class="value">1 upstream_unreachable</div>' in page
    assert '<span class="infra">upstream_unreachable</span></td><td class=num>1</td><td>infrastructure' in page
    assert "new chains by cause: drift 3" in page and "<td>drift breaks</td><td class=num>3</td>" in page
    assert f'content="{CSP}"' in page and "<script" not in page.lower()
    assert "http://" not in page.replace("http://www.w3.org/", "")  # nothing to fetch: only SVG namespaces


def hostile_run() -> RunData:
    line = row("s<1>", HOSTILE, status="ERROR", reward=None, cause=HOSTILE, reason=HOSTILE)
    return RunData(HOSTILE, [SessionRow.from_row(line)], Fidelity(sessions=1, breaks={HOSTILE: 1}),
                   config_text=f"harness:\n  config: {HOSTILE}\n", out_dir=HOSTILE,
                   harness_failures=[HarnessFailureRow("s<1>", HOSTILE, 0, HOSTILE, HOSTILE, 3, HOSTILE * 3)])


def test_strings_from_the_run_are_escaped_everywhere() -> None:
    page = build_report(hostile_run())
    assert "<script" not in page.lower() and "<img" not in page.lower() and "onerror=alert" not in page.replace(
        "onerror=alert(1)&gt;", "")
    assert page.count("</svg>") == page.count("<svg")  # the run's "</svg>" closed no figure
    assert "\x1b" not in page and "\x00" not in page and "\x07" not in page
    assert html.escape("<script>window.__pwned = 1</script>") in page  # shown, as text
    assert "harness-failures" in page and "s&lt;1&gt;" in page


def test_the_hostile_page_runs_nothing_in_a_browser(tmp_path: Path) -> None:
    from tests._browser import open_page

    path = tmp_path / "report.html"
    path.write_text(build_report(hostile_run()))
    with open_page(path.as_uri()) as opened:
        assert opened.page.evaluate("window.__pwned") is None
        assert opened.page.locator("img").count() == 0 and opened.page.locator("script").count() == 0
        assert HOSTILE[:20] in opened.page.locator("#harness-failures pre").first.inner_text()
        assert opened.problems == []


def test_an_empty_run_and_a_run_where_everything_errored_render() -> None:
    empty = build_report(RunData("launch", [], Fidelity()))
    assert "no sessions" in empty and "no scored sessions" in empty and figure_ids(empty)
    assert 'data-key="mean reward"><div class="value">-</div>' in empty
    errored = [SessionRow.from_row(row(str(i), "t", status="ERROR", reward=None, cause="init_failed"))
               for i in range(3)]
    page = build_report(RunData("launch", errored, Fidelity(sessions=3)))
    assert "Reward distribution (0 scored of 3 sessions)" in page
    assert 'data-key="errors by cause"><div class="value">3 init_failed</div>' in page


def test_the_training_figure_shows_the_curves() -> None:
    rows = [{"step": 1, "loss": 2.0, "reward_mean": 0.5}, {"step": 2, "loss": 1.0, "reward_mean": 0.75}]
    page = build_report(RunData("GRPO", [], Fidelity(), train_rows=rows, train_keys=["reward_mean", "loss"]))
    assert "training" in figure_ids(page) and ">reward_mean<" in page and ">loss<" in page
    assert line_panels(rows, ["loss"]).startswith("<svg") and "no values to plot yet" in line_panels([], ["loss"])


def test_fidelity_from_the_files_equals_the_launchs(tmp_path: Path) -> None:
    rows = [row("a", "t", breaks={"drift": 1}, traces=2), row("b", "t", traces=1),
            row("c", "t", status="ERROR", reward=None)]
    del rows[2]["trajectory_diagnostics"]  # a session that built no trajectory
    lines = [trace_line("a", 0), trace_line("a", 1, prompt_mode="chat"), trace_line("b", 0)]
    trajectories = [Trajectory(session_id=s, traces=[Trace.model_validate(
        {k: v for k, v in t.items() if k not in ("session_id", "trace_index")}) for t in lines if t["session_id"] == s],
        diagnostics=r["trajectory_diagnostics"]) for s, r in (("a", rows[0]), ("b", rows[1]))]
    expected = run_fidelity([*trajectories, None])
    assert fidelity_of_files(rows, lines) == expected
    assert expected.breaks == {"drift": 1} and expected.prompt_modes == {"token_in": 4, "chat": 2}
    assert fidelity_of_diagnostics(rows).trainable_tokens == 30  # the diagnostics alone: counts, no modes


def test_python_m_polar_gym_report_rebuilds_the_page_from_a_runs_files(tmp_path: Path) -> None:
    session_dir = tmp_path / "gateway" / "s0" / "attempt"
    (session_dir / "artifacts").mkdir(parents=True)
    (session_dir / "artifacts" / "harness.stderr").write_text("x" * 5000 + "\nTraceback: " + HOSTILE)
    rows = [row("s0", "t1", harness_status="failed", exit_code=3, session_dir=str(session_dir), reward=0.0),
            row("s1", "t1")]
    out = write_run(tmp_path / "run", rows, [trace_line("s0", 0), trace_line("s1", 0)])
    proc = subprocess.run([sys.executable, "-m", "polar_gym.report", str(out)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"report: {out / 'report.html'} (2 sessions" in proc.stdout
    page = (out / "report.html").read_text()
    assert oct(os.stat(out / "report.html").st_mode & 0o777) == "0o600"  # it holds the resolved config
    assert "Harness failures (1)" in page and "Traceback: &lt;script&gt;" in page and "exit 3" in page
    assert "name: pi" in page and "new chains by cause: none" in page and "prompt mode token_in 4" in page
    assert load_run(out).fidelity == fidelity_of_files(rows, [trace_line("s0", 0), trace_line("s1", 0)])


def test_the_report_command_options_and_a_folder_without_results(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = write_run(tmp_path / "run", [row("s0", "t1")])
    assert main([str(out), "--out", str(tmp_path / "elsewhere.html"), "--title", "nightly <eval>"]) == 0
    page = (tmp_path / "elsewhere.html").read_text()
    assert "<h1>nightly &lt;eval&gt;</h1>" in page and not (out / "report.html").exists()
    assert main([str(tmp_path / "nothing")]) == 2 and "no results.jsonl" in capsys.readouterr().err


def test_the_report_package_exports() -> None:
    for module in (report_pkg, causes, model, figures, render, files, plots):
        assert all(hasattr(module, name) for name in module.__all__), module.__name__


def test_a_thousand_sessions_stay_a_small_page(tmp_path: Path) -> None:
    out = write_run(tmp_path / "big", synthetic_rows(1000))
    run = load_run(out)
    page = build_report(run)
    assert len(run.sessions) == 1000 and html.escape("from results.jsonl's builder diagnostics") in page
    assert len(page) < 3_000_000 and figure_ids(page) == [f for f in FIGURES if f != "training"]
    assert "(first 40 tasks)" in page and "reward of each of the 50 tasks" in page


def test_big_runs_thin_the_slot_plot_keeping_peaks_and_cap_the_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    times = [float(i) for i in range(10)]
    counts = {"run": [0, 1, 5, 1, 0, 0, 2, 0, 0, 0]}
    slots, thinned = figures.thin_steps(times, counts, limit=3)
    assert slots == [0.0, 3.0, 6.0] and thinned["run"] == [5, 1, 2]
    assert figures.thin_steps(times, counts) == (times, counts)
    monkeypatch.setattr(render, "MAX_ROWS", 3)
    sessions = [SessionRow.from_row(row(f"s{i}", f"task-{i}")) for i in range(5)]
    page = build_report(RunData("launch", sessions, Fidelity(sessions=5)))
    assert page.count("the first 3 of 5 rows; every one is in results.jsonl") == 2  # tasks and sessions
    assert "<td>task-2</td>" in page and "<td>task-3</td>" not in page


def test_the_jobs_a_slurm_run_lost_are_in_the_sessions_section(tmp_path: Path) -> None:
    """jobs.json's lost jobs (launcher=slurm) show beside the causes; the other jobs do not."""
    (tmp_path / "results.jsonl").write_text("")
    (tmp_path / "jobs.json").write_text(json.dumps([
        {"job_id": "6", "name": "polar-gateway-0", "state": "lost: NODE_FAIL", "replaced_by": "9"},
        {"job_id": "7", "name": "polar-gateway-1", "state": "live"}]))
    page = build_report(load_run(tmp_path))
    assert "<td>6</td><td>polar-gateway-0</td><td>lost: NODE_FAIL</td><td>9</td>" in page
    assert "polar-gateway-1" not in page
    (tmp_path / "jobs.json").write_text("not json")
    assert load_run(tmp_path).lost_jobs == []
