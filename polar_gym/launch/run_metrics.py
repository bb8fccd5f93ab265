"""A launch's numbers in W&B / TensorBoard (``logging.wandb``, ``logging.tensorboard``): the per-session values as a
step series (step = the session's index in results.jsonl) and the run's totals as the summary, taken from the same
SessionOutcomes and totals that write results.jsonl and summary.md."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from omegaconf import OmegaConf

from polar_gym.schema import SessionResult, SessionStatus
from polar_gym.telemetry import MetricSinks

if TYPE_CHECKING:
    from polar_gym.launch.config import LaunchJob

__all__ = ["Outcome", "log_run_metrics", "run_summary", "session_values"]


class Outcome(Protocol):
    """What is read of a launch's SessionOutcome (outputs.py calls this module: no import back)."""

    @property
    def result(self) -> SessionResult: ...

    @property
    def reward(self) -> float | None: ...

    @property
    def traces(self) -> int: ...

    @property
    def completions(self) -> int: ...

    @property
    def seconds(self) -> float: ...


def session_values(outcome: Outcome) -> dict[str, Any]:
    """One session's point of the series: reward, seconds, completions, traces, its per-stage timings and its
    token fidelity (trainable / masked tokens, chains, new chains by cause: its trajectory_diagnostics)."""
    trajectory = outcome.result.trajectory
    diagnostics = trajectory.diagnostics if trajectory is not None else {}
    fidelity = {key: diagnostics.get(key) for key in ("trainable_tokens", "masked_tokens", "chains", "breaks")}
    return {"reward": outcome.reward, "seconds": outcome.seconds, "completions": outcome.completions,
            "traces": outcome.traces, "completed": outcome.result.status is SessionStatus.COMPLETED,
            "errored": outcome.result.status is SessionStatus.ERROR, "timings": dict(outcome.result.timings),
            "fidelity": fidelity}


def run_summary(totals: dict[str, Any]) -> dict[str, Any]:
    """The run's totals (outputs' totals: sessions, completed, errored, mean reward, errors by cause, traces,
    completions, failed model calls, fidelity's token counts, wall seconds)."""
    keys = ("sessions", "completed", "errored", "mean_reward", "errors_by_cause", "failed_model_calls", "traces",
            "completions", "wall_seconds", "fidelity")
    return {key: totals.get(key) for key in keys}


def _config(job: LaunchJob) -> dict[str, Any]:
    config = OmegaConf.to_container(OmegaConf.create(job.resolved_config))
    plain = config if isinstance(config, dict) else {}
    return {**{str(k): v for k, v in plain.items()}, "launch_id": job.launch_id, "out_dir": str(job.out_dir)}


def log_run_metrics(job: LaunchJob, outcomes: Sequence[Outcome], totals: dict[str, Any]) -> None:
    """Send the run's series and totals to the configured sinks (nothing when none is configured)."""
    if not job.logging.enabled:
        return
    with MetricSinks.open(job.logging, job.out_dir, config=_config(job), job_type="rollout") as sinks:
        for index, outcome in enumerate(outcomes):
            sinks.log(index, {"session": session_values(outcome)})
        sinks.summary({"run": run_summary(totals)})
