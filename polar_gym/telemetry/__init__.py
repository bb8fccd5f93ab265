"""Metrics where researchers look: W&B and TensorBoard sinks for run and training metrics
(:mod:`polar_gym.telemetry.sinks`), OpenTelemetry spans of sessions, stages and model calls
(:mod:`polar_gym.telemetry.spans`), and their settings (:mod:`polar_gym.telemetry.settings`). The packages behind
them (the ``metrics`` extra) are imported only when configured."""

from polar_gym.telemetry.settings import (
    LoggingSettings,
    TelemetrySettings,
    TensorboardSettings,
    WandbSettings,
    traces_url,
)
from polar_gym.telemetry.sinks import EXTRA, MetricSinks, Sink, TensorboardSink, WandbSink, missing_packages, scalars
from polar_gym.telemetry.spans import STAGE_OF_STATUS, SessionTracer, stage_intervals

__all__ = ["EXTRA", "STAGE_OF_STATUS", "LoggingSettings", "MetricSinks", "SessionTracer", "Sink",
           "TelemetrySettings", "TensorboardSettings", "TensorboardSink", "WandbSettings", "WandbSink",
           "missing_packages", "scalars", "stage_intervals", "traces_url"]
