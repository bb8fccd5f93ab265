"""Issue 15 on a real one-node Slurm: gateways started as Slurm jobs by ``launcher=slurm`` get the launch's
telemetry settings (their command line) and write the spans of the sessions they ran, named by the launch."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.launch.test_slurm_real import _finish, _launch, _needs_tokenizer, _results
from tests.telemetry._readers import SpanRow, file_spans

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _spans_of(path: Path, sessions: int, wait: float = 120.0) -> list[SpanRow]:
    """The span file once it holds ``sessions`` session spans (a cancelled gateway job flushes as it stops)."""
    deadline = time.monotonic() + wait
    while True:
        spans = file_spans(path) if path.exists() else []
        if sum(s.name == "session" for s in spans) >= sessions or time.monotonic() > deadline:
            return spans
        time.sleep(0.5)


def test_slurm_gateway_jobs_emit_the_spans_of_their_sessions(slurm_env: dict[str, str], tmp_path: Path) -> None:
    _needs_tokenizer()
    out, span_file = tmp_path / "run", tmp_path / "spans.jsonl"
    proc = _launch(slurm_env, out, "launcher.gateways=1", "tasks.ids=[demo-calc-add,demo-slugify]",
                   f"telemetry.file={span_file}")
    _, stderr = _finish(proc, 600)
    assert proc.returncode == 0, stderr[-4000:]
    results = _results(out)
    spans = _spans_of(span_file, len(results))
    roots = {s.attributes["polar_gym.session_id"]: s for s in spans if s.name == "session"}
    assert sorted(roots) == sorted(str(r["session_id"]) for r in results)
    calls = [s for s in spans if s.attributes.get("gen_ai.operation.name") == "chat"]
    assert len(calls) == sum(int(r["completions"]) for r in results)
    runs = {s.attributes["polar_gym.session_id"]: s.span_id for s in spans if s.name == "run"}
    assert all(c.parent_id == runs[c.attributes["polar_gym.session_id"]] for c in calls)
    assert {s.resource["polar_gym.out_dir"] for s in spans} == {str(out.resolve())}
