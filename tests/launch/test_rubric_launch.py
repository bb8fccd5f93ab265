"""``python -m polar_gym.launch evaluator=rubric`` with the operator's judge: the task's own tests become the
rubric's outcome, and a judge that is down ends every session ERROR with ``judge_unreachable`` (an infrastructure
cause: exit code 3), its traces kept, never a 0 in results.jsonl. A bad malformed-tool-call policy is refused
before anything runs, naming the choices. (tests/engine/test_rubric_judge_vllm.py asks a real judge.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from polar_gym.datagen.template import TaskTemplate
from polar_gym.launch.tasks import demo_requests
from polar_gym.schema import AgentSpec, BuilderSpec, EvaluatorSpec, RuntimeSpec

ROOT = Path(__file__).resolve().parents[2]


def launch(out: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "polar_gym.launch", "tasks.ids=[demo-calc-add]",
                           "launcher.progress=false", f"out_dir={out}", *overrides], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "COLUMNS": "160"})


@pytest.mark.slow
def test_a_rubric_run_whose_judge_is_down_names_the_cause_and_keeps_the_traces(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = launch(tmp_path / "run", "evaluator=rubric", "+builder.config.malformed_tool_calls=mask",
                  f"+launcher.judges.default={{url:http://127.0.0.1:{port}/v1,model:judge,timeout_seconds:5}}")
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert row["status"] == "ERROR" and row["error_cause"] == "judge_unreachable", row
    assert row["evaluation"] is None and row["traces"] >= 1
    assert f"127.0.0.1:{port}" in row["reason"]  # the judge asked was the operator's
    assert "judge_unreachable" in (tmp_path / "run" / "summary.md").read_text()


@pytest.mark.slow
def test_an_unknown_malformed_tool_call_policy_is_refused_before_anything_runs(tmp_path: Path) -> None:
    done = launch(tmp_path / "run", "+builder.config.malformed_tool_calls=drop")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "malformed_tool_calls" in done.stderr and "reward_zero_keep, mask, ignore" in done.stderr
    assert not (tmp_path / "run" / "results.jsonl").exists()


def template(evaluator: EvaluatorSpec) -> TaskTemplate:
    return TaskTemplate(agent=AgentSpec(harness="pi"), runtime=RuntimeSpec(), builder=BuilderSpec(),
                        evaluator=evaluator)


def test_the_rubric_scores_the_task_its_own_way_unless_told_otherwise() -> None:
    own = demo_requests(template(EvaluatorSpec(strategy="test_on_output")), ["demo-calc-add"])[0].evaluator
    (request,) = demo_requests(template(EvaluatorSpec(strategy="rubric")), ["demo-calc-add"])
    assert request.evaluator.strategy == "rubric"
    outcome = request.evaluator.config.model_dump()["outcome"]
    assert outcome == {"strategy": own.strategy, "config": own.config.model_dump()} and own.config.model_dump()
    chosen = {"strategy": "session_completed", "config": {}}
    (request,) = demo_requests(template(EvaluatorSpec(strategy="rubric", config={"outcome": chosen})),
                               ["demo-calc-add"])
    assert request.evaluator.config.model_dump()["outcome"] == chosen
