"""Issue 15: OpenTelemetry spans of a real launch (pi on the oracle engine), exported by the gateway to an OTLP/HTTP
collector and to the JSON-lines file exporter. ``check_spans`` holds what a span tree must be: one span per session
with a child span per stage, one span per model call (as many as results.jsonl counts completions) whose parent is
its session's run stage span, times nested, attributes right; tests/launch/test_launch_outputs.py applies it to a
real receiver's spans. Here: a collector that is down does not fail the launch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polar_gym.assets import tokenizer_dir
from tests._serving import free_port
from tests.telemetry._readers import SpanRow, file_spans

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def launch(*overrides: str, out: Path) -> subprocess.CompletedProcess[str]:
    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")
    return subprocess.run([sys.executable, "-m", "polar_gym.launch", "launcher.progress=false", *overrides,
                           f"out_dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "160"})


def results_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def check_spans(spans: list[SpanRow], out: Path) -> None:
    """The span tree of every session of the run in ``out`` against its results.jsonl and trajectories.jsonl."""
    results = results_of(out)
    sessions = {s.attributes["polar_gym.session_id"]: s for s in spans if s.name == "session"}
    assert sorted(sessions) == sorted(r["session_id"] for r in results)
    calls = [s for s in spans if s.attributes.get("gen_ai.operation.name") == "chat"]
    assert len(calls) == sum(r["completions"] for r in results) > 0  # one span per model call
    traced = {c["completion_id"] for line in (out / "trajectories.jsonl").read_text().splitlines()
              for c in json.loads(line)["metadata"]["spans"]}
    assert {c.attributes["polar_gym.completion_id"] for c in calls} == traced
    assert all(s.resource["service.name"] == "polar_gym-gateway" for s in spans)
    assert {s.resource["polar_gym.out_dir"] for s in spans} == {str(out.resolve())}
    assert len({s.resource["polar_gym.launch_id"] for s in spans}) == 1
    for result in results:
        root = sessions[result["session_id"]]
        assert root.parent_id is None
        assert root.attributes["polar_gym.task_id"] == result["task_id"]
        assert root.attributes["polar_gym.harness"] == result["harness"] == "pi"
        assert root.attributes["polar_gym.status"] == result["status"] == "COMPLETED"
        assert root.attributes["polar_gym.reward"] == result["evaluation"]["reward"] == 1.0
        assert "polar_gym.cause" not in root.attributes
        stages = {s.name: s for s in spans if s.parent_id == root.span_id}
        assert set(stages) == {"queued", "init", "ready", "run", "postrun"}
        for stage in stages.values():
            assert stage.trace_id == root.trace_id
            assert root.start <= stage.start <= stage.end <= root.end
        assert stages["queued"].end <= stages["init"].start <= stages["init"].end <= stages["run"].start
        assert stages["run"].end <= stages["postrun"].start
        inner = {s.name: s for s in spans if s.parent_id == stages["postrun"].span_id}
        assert set(inner) == {"build", "evaluate"}
        assert all(stages["postrun"].start <= s.start <= s.end <= stages["postrun"].end for s in inner.values())
        run = stages["run"]
        mine = [c for c in calls if c.attributes["polar_gym.session_id"] == result["session_id"]]
        assert len(mine) == result["completions"]
        assert {c.parent_id for c in mine} == {run.span_id}
        for call in mine:
            assert call.trace_id == root.trace_id
            assert run.start <= call.start <= call.end <= run.end
            a = call.attributes
            assert a["gen_ai.request.model"] == "policy" and a["polar_gym.engine"] == "oracle"
            assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] > 0
            assert a["polar_gym.status"] == "ok" and call.status == "UNSET"
            assert a["polar_gym.route"].startswith("/") and a["polar_gym.provider"]
            assert a["gen_ai.response.finish_reasons"] in (["stop"], ["tool_calls"], ("stop",), ("tool_calls",))


def test_a_collector_that_is_down_does_not_fail_the_launch(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = launch("tasks.ids=[demo-calc-add]", f"telemetry.otlp_endpoint=http://127.0.0.1:{free_port()}",
                  "telemetry.export_timeout_seconds=1", f"telemetry.file={tmp_path / 'spans.jsonl'}", out=out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert results_of(out)[0]["status"] == "COMPLETED"
    check_spans(file_spans(tmp_path / "spans.jsonl"), out)  # the other exporter still got every span
