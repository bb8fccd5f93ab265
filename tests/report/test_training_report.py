"""Training runs write report.html too: SFT with its loss curve; GRPO with its curves and the sessions of every
step (each with its step, also in results.jsonl so ``python -m polar_gym.report`` rebuilds the page)."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from polar_gym.launch import CONF_DIR, run
from polar_gym.launch.training import SessionRecorder, write_training_report
from polar_gym.report import load_run
from polar_gym.schema import (
    AgentSpec,
    EvalResult,
    SessionResult,
    SessionStatus,
    TaskRequest,
    Trace,
    Trajectory,
)
from tests.trainer._tiny import small_qwen3_dir
from tests.trainer.test_sft import MESSAGES


def composed(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


class StepSource:
    """A working RolloutSource: every submitted task's sessions finish at once, the second sample errored."""

    def __init__(self) -> None:
        self.tasks: dict[str, TaskRequest] = {}

    async def submit(self, task: TaskRequest) -> dict[str, Any]:
        self.tasks[task.task_id] = task
        return {"task_id": task.task_id}

    async def results(self, task_ids: Iterable[str], **_: Any) -> AsyncIterator[SessionResult]:
        for task_id in task_ids:
            for i in range(self.tasks[task_id].num_samples):
                trace = Trace(prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[1, 1],
                              response_logprobs=[-0.5, -0.5])
                ok = i == 0
                yield SessionResult(
                    session_id=f"{task_id}-{i}", task_id=task_id,
                    status=SessionStatus.COMPLETED if ok else SessionStatus.ERROR,
                    reason=None if ok else "upstream_unreachable: down",
                    trajectory=Trajectory(session_id=f"{task_id}-{i}", traces=[trace]) if ok else None,
                    evaluation=EvalResult(reward=1.0) if ok else None, timings={"run": 1.0, "total": 1.5},
                    metadata={"sample_index": i, **({} if ok else {"artifacts": {"error_cause":
                                                                                  "upstream_unreachable"}})})


async def test_grpo_sessions_of_every_step_reach_the_report(tmp_path: Path) -> None:
    recorder = SessionRecorder(StepSource())
    for step in (1, 2):
        task = TaskRequest(task_id=f"t-step{step}", instruction="x", agent=AgentSpec(harness="pi"), num_samples=2)
        await recorder.submit(task)
        assert len([r async for r in recorder.results([task.task_id], timeout=5)]) == 2
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "train_metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward_mean": 0.5, "loss": 1.0 / s}) + "\n" for s in (1, 2)))
    path = write_training_report(tmp_path, "grpo", recorder.sessions, 3.0)
    page = path.read_text()
    assert '<figure id="fig-training"><svg' in page and "GRPO training run" in page
    assert "<thead><tr><th class=num>step</th><th>task</th>" in page
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["step"], r["error_cause"]) for r in rows] == [(1, None), (1, "upstream_unreachable"), (2, None),
                                                             (2, "upstream_unreachable")]
    rebuilt = load_run(tmp_path)
    assert [s.step for s in rebuilt.sessions] == [1, 1, 2, 2] and rebuilt.train_rows[1]["loss"] == 0.5
    assert 'data-key="errors by cause"><div class="value">2 upstream_unreachable</div>' in page


def test_an_sft_launch_writes_a_report_with_its_loss_curve(tmp_path: Path) -> None:
    data = tmp_path / "sft" / "train.jsonl"
    data.parent.mkdir()
    data.write_text(json.dumps({"messages": MESSAGES, "reward": 1.0}) + "\n")
    out = tmp_path / "run"
    assert run(composed("+trainer=sft", f"trainer.model={small_qwen3_dir(tmp_path)}", f"trainer.data=[{data}]",
                        "trainer.steps=2", "trainer.batch_size=1", f"out_dir={out}")) == 0
    page = (out / "report.html").read_text()
    assert '<figure id="fig-training"><svg' in page and "SFT training run" in page and ">loss<" in page
    assert "trainer:" in page  # the resolved config
    assert (out / "trainer" / "train_metrics.svg").read_text().startswith("<svg")


@pytest.mark.slow
def test_a_grpo_launch_reports_its_steps_sessions(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is needed: run `bash scripts/setup.sh`")
    out = tmp_path / "run"
    assert run(composed("+trainer=grpo", f"trainer.model={small_qwen3_dir(tmp_path)}", "trainer.steps=1",
                        "trainer.push_weights=false", "num_samples=2", "tasks.ids=[demo-calc-add]",
                        "launcher.progress=false", f"out_dir={out}")) == 0
    report = load_run(out)
    assert [(s.step, s.status, s.reward) for s in report.sessions] == [(1, "COMPLETED", 1.0)] * 2
    page = (out / "report.html").read_text()
    assert '<figure id="fig-training"><svg' in page and ">reward_mean<" in page
