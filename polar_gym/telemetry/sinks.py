"""Metric sinks: the places researchers look (W&B, TensorBoard) fed from the numbers the run already writes.

:class:`MetricSinks` fans ``log(step, values)`` (a step series) and ``summary(values)`` (a run's totals) out to
every configured sink. Values may nest (``{"session": {"timings": {"run": 1.2}}}`` is the scalar
``session/timings/run``); what is not a finite number is left out. A sink that fails is reported once and dropped:
metrics are a view of the run, never a reason for it to fail. The packages are imported only when a sink is
configured (the ``metrics`` extra).
"""

from __future__ import annotations

import importlib.util
import logging
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from polar_gym.settings import ConfigError, Problem
from polar_gym.telemetry.settings import LoggingSettings, TelemetrySettings, TensorboardSettings, WandbSettings

__all__ = ["EXTRA", "MetricSinks", "Sink", "TensorboardSink", "WandbSink", "missing_packages", "scalars"]

log = logging.getLogger("polar_gym.telemetry")

#: the pip extra that brings every metrics package
EXTRA = "pip install 'polar_gym[metrics]'"


def missing_packages(logging_settings: LoggingSettings | None, telemetry: TelemetrySettings | None) -> list[Problem]:
    """One problem per configured sink whose package is not installed (checked before a launch starts)."""
    wanted: list[tuple[str, str]] = []
    if logging_settings is not None and logging_settings.wandb.enabled:
        wanted.append(("logging.wandb", "wandb"))
    if logging_settings is not None and logging_settings.tensorboard.enabled:
        wanted.append(("logging.tensorboard", "tensorboardX"))
    if telemetry is not None and telemetry.enabled:
        wanted.append(("telemetry", "opentelemetry.sdk"))
        if telemetry.otlp_endpoint:
            wanted.append(("telemetry.otlp_endpoint", "opentelemetry.exporter.otlp.proto.http"))
    return [(key, f"needs the {module.split('.')[0]} package: {EXTRA}") for key, module in wanted
            if not _installed(module)]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def scalars(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Pure: nested mappings flattened to ``a/b/c`` keys; finite numbers only (bools count as 0/1)."""
    out: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(scalars(value, name))
        elif isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, int | float) and math.isfinite(value):
            out[name] = float(value)
    return out


class Sink(Protocol):
    """One destination of metrics."""

    name: str
    #: where a user finds what the sink wrote (one line for the console)
    where: str

    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def summary(self, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class WandbSink:
    """A W&B run (offline by default: no network, no login). Its console output is silenced."""

    name = "wandb"

    def __init__(self, settings: WandbSettings, out_dir: Path, *, run_name: str, config: Mapping[str, Any] | None,
                 job_type: str) -> None:
        import wandb

        folder = Path(settings.dir) if settings.dir else out_dir
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=settings.project, entity=settings.entity, name=settings.name or run_name,
                              group=settings.group, tags=settings.tags or None, dir=str(folder), mode=settings.mode,
                              job_type=job_type, config=dict(config or {}),
                              settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
        run_dir = Path(self.run.dir).parent
        self.where = (f"W&B offline run {run_dir} (`wandb sync {run_dir}` uploads it)" if settings.mode == "offline"
                      else f"W&B run {self.run.url or run_dir}")

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def summary(self, values: Mapping[str, float]) -> None:
        self.run.summary.update(dict(values))

    def close(self) -> None:
        import wandb

        self.run.finish()
        if wandb.run is None:  # W&B's service writes the run's log in the background: stopping it completes the log
            wandb.teardown()  # now (not at exit); left alone while another run of this process is live


class TensorboardSink:
    """TensorBoard event files (tensorboardX): every value a scalar; a summary is written at step 0."""

    name = "tensorboard"

    def __init__(self, settings: TensorboardSettings, out_dir: Path) -> None:
        from tensorboardX import SummaryWriter

        self.dir = Path(settings.dir) if settings.dir else out_dir / "tensorboard"
        self.writer = SummaryWriter(logdir=str(self.dir))
        self.where = f"TensorBoard event files in {self.dir} (`tensorboard --logdir {self.dir}`)"

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)

    def summary(self, values: Mapping[str, float]) -> None:
        self.log(0, values)

    def close(self) -> None:
        self.writer.close()


class MetricSinks:
    """Every configured sink behind one ``log`` / ``summary`` / ``close`` (a context manager)."""

    def __init__(self, sinks: list[Sink] | None = None) -> None:
        self.sinks: list[Sink] = list(sinks or [])

    @classmethod
    def open(cls, settings: LoggingSettings | None, out_dir: Path, *, run_name: str | None = None,
             config: Mapping[str, Any] | None = None, job_type: str = "rollout") -> MetricSinks:
        """The sinks ``settings`` enables. A missing package is a ConfigError naming the extra; a sink that cannot
        start (W&B's service, a full disk) is reported and left out."""
        if settings is None or not settings.enabled:
            return cls()
        problems = missing_packages(settings, None)
        if problems:
            raise ConfigError("", problems=problems, title="metrics packages missing")
        sinks: list[Sink] = []
        if settings.tensorboard.enabled:
            try:
                sinks.append(TensorboardSink(settings.tensorboard, out_dir))
            except Exception as exc:
                log.warning("TensorBoard logging is off for this run: %s: %s", exc.__class__.__name__, exc)
        if settings.wandb.enabled:
            try:
                sinks.append(WandbSink(settings.wandb, out_dir, run_name=run_name or out_dir.name, config=config,
                                       job_type=job_type))
            except Exception as exc:
                log.warning("W&B logging is off for this run: %s: %s", exc.__class__.__name__, exc)
        return cls(sinks)

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        """One point of the step series (nested values flattened; non-numbers left out)."""
        flat = scalars(values)
        if flat:
            self._each(lambda sink: sink.log(step, flat))

    def summary(self, values: Mapping[str, Any]) -> None:
        """The run's totals."""
        flat = scalars(values)
        if flat:
            self._each(lambda sink: sink.summary(flat))

    def close(self) -> None:
        """Close every sink (W&B finishes its run) and say where each one's files are."""
        self._each(lambda sink: sink.close())
        for sink in self.sinks:
            log.info("metrics: %s", sink.where)
        self.sinks.clear()

    def _each(self, call: Any) -> None:
        for sink in list(self._live()):
            try:
                call(sink)
            except Exception as exc:  # a view of the run must never end it
                log.warning("%s logging failed and is off for the rest of this run: %s: %s", sink.name,
                            exc.__class__.__name__, exc)
                self.sinks.remove(sink)

    def _live(self) -> Iterator[Sink]:
        yield from self.sinks

    def __enter__(self) -> MetricSinks:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
