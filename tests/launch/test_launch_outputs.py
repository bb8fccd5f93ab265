"""One real launch (pi on the oracle engine, two demo tasks, two samples each) with every optional output switched
on, each output checked by its own test with its own reader: W&B offline and TensorBoard (issue 15), OpenTelemetry
spans at a real OTLP/HTTP receiver and in the span file (issue 15), report.html in real headless Chromium, and the
files that hold admin tokens (issue 11). The checks only read what the launch wrote, so they share it: a launch per
check cost about 7 s of CPU each on CI's two busy cores."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from polar_gym.report.figures import FIGURES
from tests._browser import open_page
from tests.launch.test_token_files import _files_containing, _private
from tests.telemetry._readers import (
    SpanRow,
    file_spans,
    otlp_receiver,
    tensorboard_scalars,
    wandb_history,
    wandb_run_dir,
    wandb_summary,
)
from tests.telemetry.test_launch_spans import check_spans, launch, results_of

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Launched:
    out: Path
    proc: subprocess.CompletedProcess[str]
    received: list[SpanRow]  # what the OTLP receiver got
    span_file: Path
    receiver_requests: int


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Launched:
    root = tmp_path_factory.mktemp("outputs")
    out = root / "run"
    out.mkdir()
    (out / "server.json").write_text("{}")  # left over from an earlier run, world-readable
    (out / "server.json").chmod(0o644)
    with otlp_receiver() as receiver:
        proc = launch("num_samples=2", "tasks.ids=[demo-calc-add,demo-slugify]", "logging.wandb.enabled=true",
                      "logging.wandb.mode=offline", "logging.tensorboard.enabled=true",
                      f"telemetry.otlp_endpoint={receiver.url}", f"telemetry.file={root / 'spans.jsonl'}", out=out)
        assert proc.returncode == 0, proc.stderr[-4000:]
        received = list(receiver.spans)  # the launch flushed before it exited
    return Launched(out, proc, received, root / "spans.jsonl", receiver.requests)


def test_the_sessions_and_totals_go_to_wandb_offline_and_tensorboard(launched: Launched) -> None:
    out, proc = launched.out, launched.proc
    assert "wandb:" not in proc.stdout + proc.stderr  # W&B's console chatter is silenced
    run_dir = wandb_run_dir(out)
    assert f"metrics: W&B offline run {run_dir} (`wandb sync {run_dir}` uploads it)" in proc.stdout
    assert f"metrics: TensorBoard event files in {out / 'tensorboard'}" in proc.stdout
    results = results_of(out)
    rewards = [r["evaluation"]["reward"] for r in results]
    mean = sum(rewards) / len(rewards)

    history = wandb_history(run_dir)
    assert [row["_step"] for row in history] == list(range(len(results)))
    assert [row["session/reward"] for row in history] == rewards
    assert [row["session/completions"] for row in history] == [r["completions"] for r in results]
    assert [row["session/traces"] for row in history] == [r["traces"] for r in results]
    assert [row["session/seconds"] for row in history] == pytest.approx([r["seconds"] for r in results], abs=1e-3)
    assert [row["session/timings/run"] for row in history] == [r["timings"]["run"] for r in results]
    assert [row["session/fidelity/trainable_tokens"] for row in history] == [
        r["trajectory_diagnostics"]["trainable_tokens"] for r in results]
    summary = wandb_summary(run_dir)
    assert summary["run/sessions"] == len(results) == 4
    assert summary["run/completed"] == 4 and summary["run/errored"] == 0
    assert summary["run/mean_reward"] == pytest.approx(mean)
    assert summary["run/completions"] == sum(r["completions"] for r in results)
    assert summary["run/traces"] == sum(r["traces"] for r in results)
    trainable = sum(sum(t["loss_mask"]) for t in map(json.loads, (out / "trajectories.jsonl").read_text().splitlines()))
    assert summary["run/fidelity/trainable_tokens"] == trainable > 0

    scalars = tensorboard_scalars(out / "tensorboard")
    assert scalars["session/reward"] == [(i, pytest.approx(r)) for i, r in enumerate(rewards)]
    assert [v for _, v in scalars["session/completions"]] == [r["completions"] for r in results]
    assert scalars["run/sessions"] == [(0, 4.0)]
    assert scalars["run/mean_reward"] == [(0, pytest.approx(mean))]
    assert scalars["run/fidelity/trainable_tokens"] == [(0, trainable)]


def test_spans_reach_a_real_otlp_receiver_and_the_span_file(launched: Launched) -> None:
    assert launched.receiver_requests >= 1
    check_spans(launched.received, launched.out)
    written = file_spans(launched.span_file)
    check_spans(written, launched.out)
    assert sorted(s.span_id for s in written) == sorted(s.span_id for s in launched.received)


def test_the_report_opens_offline_with_its_plots_and_the_numbers_of_results_jsonl(launched: Launched) -> None:
    """The screenshot (test-artifacts/report.png) is the one the README shows."""
    out = launched.out
    assert f"report: {out / 'report.html'}" in launched.proc.stderr
    assert "Report: [report.html](report.html)" in (out / "summary.md").read_text()
    results = results_of(out)
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


def test_every_file_holding_an_admin_token_is_private_and_no_token_is_printed(launched: Launched) -> None:
    out, proc = launched.out, launched.proc
    server_token = json.loads((out / "server.json").read_text())["admin_token"]
    with contextlib.closing(sqlite3.connect(out / "server.sqlite")) as db:
        columns = [row[1] for row in db.execute("PRAGMA table_info(gateways)")]
        gateway_tokens = [t for (t,) in db.execute("SELECT admin_token FROM gateways")] \
            if "admin_token" in columns else []
    holders: set[Path] = set()
    for token in [server_token, *[t for t in gateway_tokens if t]]:
        assert token not in proc.stdout + proc.stderr
        holders.update(_files_containing(out, token))
    assert out / "server.json" in holders
    assert [p for p in holders if not _private(p)] == []
    # the store holds the gateways' tokens (in clear or not): private whatever its content
    assert all(_private(p) for p in out.glob("server.sqlite*")) and _private(out / "config.yaml")
