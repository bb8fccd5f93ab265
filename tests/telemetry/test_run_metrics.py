"""The launch's run metrics in-process: finish() on made-up outcomes (one completed with reward, one whose model
calls never reached an upstream) sends per-session points and the run's totals to TensorBoard; with nothing
configured it writes nothing."""

from __future__ import annotations

import io
import json
from pathlib import Path

from hydra import compose, initialize_config_dir
from rich.console import Console

from polar_gym.launch import CONF_DIR, LaunchJob, build_job
from polar_gym.launch.outputs import SessionOutcome, finish
from polar_gym.schema import EvalResult, SessionResult, SessionSpec, SessionStatus
from tests.telemetry._readers import tensorboard_scalars


def _job(tmp_path: Path, *overrides: str) -> LaunchJob:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return build_job(compose("config", overrides=[*overrides, "tasks.ids=[demo-calc-add]", "num_samples=2",
                                                      f"out_dir={tmp_path}"]))


def _outcomes(job: LaunchJob) -> list[SessionOutcome]:
    specs = [SessionSpec.from_task(job.requests[0], i) for i in range(2)]
    ok = SessionResult(session_id=specs[0].session_id, task_id=specs[0].task_id, status=SessionStatus.COMPLETED,
                       evaluation=EvalResult(reward=0.5), timings={"run": 2.0, "total": 3.0})
    broken = SessionResult(session_id=specs[1].session_id, task_id=specs[1].task_id, status=SessionStatus.ERROR,
                           reason="upstream_unreachable: no answer", timings={"run": 0.5},
                           metadata={"artifacts": {"error_cause": "upstream_unreachable"}})
    return [SessionOutcome(specs[0], ok, 3, 3.0), SessionOutcome(specs[1], broken, 1, 0.7)]


def test_finish_sends_the_sessions_and_totals_to_tensorboard(tmp_path: Path) -> None:
    job = _job(tmp_path, "logging.tensorboard=true")
    code = finish(Console(file=io.StringIO()), job, _outcomes(job), wall=4.0)
    assert code == 3  # the infrastructure failed: the metrics change nothing of that
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["session/reward"] == [(0, 0.5)]  # the unscored session has no reward point
    assert scalars["session/completions"] == [(i, r["completions"]) for i, r in enumerate(rows)]
    assert scalars["session/timings/run"] == [(0, 2.0), (1, 0.5)]
    assert scalars["session/errored"] == [(0, 0.0), (1, 1.0)]
    assert scalars["run/sessions"] == [(0, 2.0)] and scalars["run/mean_reward"] == [(0, 0.5)]
    assert scalars["run/errors_by_cause/upstream_unreachable"] == [(0, 1.0)]
    assert scalars["run/wall_seconds"] == [(0, 4.0)] and scalars["run/completions"] == [(0, 4.0)]


def test_nothing_configured_writes_nothing(tmp_path: Path) -> None:
    job = _job(tmp_path)
    finish(Console(file=io.StringIO()), job, _outcomes(job), wall=4.0)
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "wandb").exists()
