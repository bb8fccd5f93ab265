"""MetricSinks with the real W&B (offline) and TensorBoard writers, read back; nested values flattened, what is not
a number left out; a sink that fails is dropped with a warning and the others go on."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path

import pytest

from polar_gym.telemetry import LoggingSettings, MetricSinks, TensorboardSettings, WandbSettings, scalars
from tests.telemetry._readers import tensorboard_scalars, wandb_history, wandb_run_dir, wandb_summary


def test_scalars_flattens_and_keeps_finite_numbers_only() -> None:
    values = {"run": {"sessions": 2, "mean_reward": None, "ok": True, "fidelity": {"breaks": {"drift": 3}}},
              "name": "x", "nan": math.nan, "list": [1], "loss": 0.5}
    assert scalars(values) == {"run/sessions": 2.0, "run/ok": 1.0, "run/fidelity/breaks/drift": 3.0, "loss": 0.5}


def test_nothing_configured_is_no_sink(tmp_path: Path) -> None:
    with MetricSinks.open(LoggingSettings(), tmp_path) as sinks:
        assert sinks.sinks == []
        sinks.log(0, {"a": 1})
    assert list(tmp_path.iterdir()) == []


def test_wandb_offline_and_tensorboard_get_the_series_and_the_summary(tmp_path: Path) -> None:
    settings = LoggingSettings(wandb=WandbSettings(enabled=True, project="unit", tags=["t"]),
                               tensorboard=TensorboardSettings(enabled=True))
    with MetricSinks.open(settings, tmp_path, run_name="unit-run", config={"lr": 0.1}) as sinks:
        assert [s.name for s in sinks.sinks] == ["tensorboard", "wandb"]
        for step in range(3):
            sinks.log(step, {"train": {"loss": 1.0 / (step + 1), "note": "text"}})
        sinks.summary({"run": {"sessions": 3}})
    history = wandb_history(wandb_run_dir(tmp_path))
    assert [(h["_step"], h["train/loss"]) for h in history] == [(0, 1.0), (1, 0.5), (2, 1 / 3)]
    assert all("train/note" not in h for h in history)
    assert wandb_summary(wandb_run_dir(tmp_path))["run/sessions"] == 3
    tb = tensorboard_scalars(tmp_path / "tensorboard")
    assert tb["train/loss"] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert tb["run/sessions"] == [(0, 3.0)]


class _Recording:
    name = "recording"
    where = "in memory"

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.logged.append((step, dict(values)))

    def summary(self, values: Mapping[str, float]) -> None:
        self.logged.append((-1, dict(values)))

    def close(self) -> None:
        self.closed = True


class _Broken(_Recording):
    name = "broken"

    def log(self, step: int, values: Mapping[str, float]) -> None:
        raise ConnectionError("the service went away")


def test_a_failing_sink_is_dropped_with_a_warning_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    good, broken = _Recording(), _Broken()
    sinks = MetricSinks([broken, good])
    with caplog.at_level(logging.INFO, logger="polar_gym.telemetry"):
        sinks.log(1, {"a": 1})
        sinks.log(2, {"a": 2})
        sinks.summary({"b": 3})
        sinks.close()
    assert good.logged == [(1, {"a": 1.0}), (2, {"a": 2.0}), (-1, {"b": 3.0})] and good.closed
    assert [r.getMessage() for r in caplog.records] == [
        "broken logging failed and is off for the rest of this run: ConnectionError: the service went away",
        "metrics: in memory"]


def test_a_sink_that_cannot_start_is_left_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    settings = LoggingSettings(tensorboard=TensorboardSettings(enabled=True, dir=str(blocker / "tb")))
    with caplog.at_level(logging.WARNING, logger="polar_gym.telemetry"):
        sinks = MetricSinks.open(settings, tmp_path)
    assert sinks.sinks == []
    assert "TensorBoard logging is off for this run" in caplog.text
