"""Training runs write report.html too: SFT with its loss curve; GRPO with its curves (95 % bands where the rows
give them), a banner when steps did not train, and the sessions of every step (each with its step, also in
results.jsonl so ``python -m polar_gym.report`` rebuilds the page). A GRPO launch's report through a real engine
is checked by tests/trainer/test_launch_trainer.py's engine-tier run."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from polar_gym.launch import CONF_DIR, run
from polar_gym.launch.training import SessionRecorder, write_training_report
from polar_gym.plots import arm_panels, band
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


def _metrics(out: Path, rows: list[dict[str, Any]]) -> None:
    (out / "trainer").mkdir(parents=True, exist_ok=True)
    (out / "trainer" / "train_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _fills(svg: str) -> int:
    """Shaded bands in a figure (matplotlib writes fill_between as a path of that opacity)."""
    return svg.count("fill-opacity: 0.18")


def test_a_grpo_run_whose_steps_did_not_train_says_so_at_the_top(tmp_path: Path) -> None:
    """The issue's run: three steps of reward 1.000 everywhere. The page says it trained on nothing."""
    _metrics(tmp_path, [{"step": s, "reward_mean": 1.0, "reward_se": 0.0, "loss": 0.0, "trained": False,
                         "not_trained_reasons": ["no_signal", "not_policy_sampled"]} for s in (1, 2, 3)])
    page = write_training_report(tmp_path, "grpo", [], 1.0).read_text()
    banner = ('<p class="banner bad" id="not-trained">GRPO: 0 of 3 steps trained — every group&#x27;s rewards were '
              "equal (no signal); the traces were not sampled by the policy")
    assert banner in page and page.index(banner) < page.index('data-key="sessions"')  # above everything else
    _metrics(tmp_path, [{"step": 1, "reward_mean": 0.5, "trained": True, "not_trained_reasons": []}])
    assert 'id="not-trained"' not in write_training_report(tmp_path, "grpo", [], 1.0).read_text()
    _metrics(tmp_path, [{"step": 1, "reward_mean": 0.5}])  # a run older than the verdict: nothing claimed
    assert 'id="not-trained"' not in write_training_report(tmp_path, "grpo", [], 1.0).read_text()


def test_the_training_curves_have_bands_where_the_rows_give_them(tmp_path: Path) -> None:
    rows = [{"step": s, "reward_mean": 0.25 * s, "reward_se": 0.1, "eval/share_right": 0.5 + 0.1 * s,
             "eval/p_right": 0.4 + 0.05 * s, "eval/greedy_success": s / 4, "eval/greedy_success_lo": s / 8,
             "eval/greedy_success_hi": min(1.0, s / 3), "loss": 1.0 / s} for s in (1, 2, 3)]
    _metrics(tmp_path, rows)
    page = write_training_report(tmp_path, "grpo", [], 1.0).read_text()
    figure = page[page.index('<figure id="fig-training">'):]
    figure = figure[:figure.index("</figure>")]
    for key in ("reward_mean", "eval/share_right", "eval/p_right", "eval/greedy_success", "loss"):
        assert f">{key}<" in figure, key
    assert _fills(figure) == 2  # reward_mean (from reward_se) and greedy success (its _lo/_hi); the others none
    assert figure.count("(band: 95 % interval)") == 2
    assert "Shaded: a 95 % interval" in page


def test_bands_from_a_standard_error_or_an_interval() -> None:
    assert band({"reward_mean": 0.5, "reward_se": 0.1}, "reward_mean") == pytest.approx((0.304, 0.696))
    assert band({"x": 0.5, "x_se": 0.1}, "x") == pytest.approx((0.304, 0.696))
    assert band({"x": 0.5, "x_se": 0.1, "x_lo": 0.45, "x_hi": 0.9}, "x") == (0.45, 0.9)  # explicit wins
    assert band({"x": 0.5}, "x") is None and band({"x": 0.5, "x_se": None}, "x") is None
    assert band({"x": 0.5, "x_lo": 0.1}, "x") is None  # half an interval is none


def test_arms_share_the_axes_with_their_bands_and_a_legend() -> None:
    def arm(slope: float) -> list[dict[str, Any]]:
        return [{"step": s, "eval/share_right": 0.5 + slope * s, "eval/share_right_lo": 0.4 + slope * s,
                 "eval/share_right_hi": 0.6 + slope * s, "eval/p_right": 0.45 + slope * s} for s in range(4)]

    svg = arm_panels({"treatment seed 0": arm(0.1), "treatment seed 1": arm(0.08), "shuffled control": arm(0.0)},
                     ["eval/share_right", "eval/p_right", "eval/greedy_success"], "Fork: a + b vs a * b")
    assert svg.startswith("<svg") and _fills(svg) == 3  # one band per arm on share_right, none on p_right
    for name in ("treatment seed 0", "treatment seed 1", "shuffled control"):
        assert svg.count(f">{name}<") == 2  # in the legend of both panels
    assert ">eval/greedy_success<" not in svg  # no arm has it: no empty panel
    assert "no values to plot yet" in arm_panels({"a": []}, ["x"])


def test_an_asynchronous_runs_figure_shows_its_staleness_and_a_synchronous_one_does_not(tmp_path: Path) -> None:
    def figure_of(staleness: list[int]) -> str:
        _metrics(tmp_path, [{"step": s + 1, "reward_mean": 0.5, "staleness/max": v, "staleness/mean": v / 2,
                             "rollout_seconds": 3.0} for s, v in enumerate(staleness)])
        page = write_training_report(tmp_path, "grpo", [], 1.0).read_text()
        return page[page.index('<figure id="fig-training">'):page.index("</figure>", page.index("fig-training"))]

    assert ">staleness/max<" in figure_of([0, 1, 1]) and ">rollout_seconds<" in figure_of([0, 1, 1])
    assert ">staleness/max<" not in figure_of([0, 0, 0])  # max_staleness 0: nothing to show
