"""The ``logging`` and ``telemetry`` settings of a launch (Hydra nodes ``logging.wandb``, ``logging.tensorboard``,
``telemetry``). Each accepts a shorthand on the command line, so ``logging.wandb=true``, ``logging.wandb=online``,
``logging.tensorboard=true`` or ``logging.tensorboard=DIR`` work as well as the full keys; unknown keys are refused
like everywhere else."""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["LoggingSettings", "TelemetrySettings", "TensorboardSettings", "WandbSettings", "traces_url"]


class WandbSettings(BaseModel):
    """Weights & Biases logging (off by default). Offline mode needs no network and no login: the run folder goes
    under ``dir`` (``wandb sync DIR/wandb/offline-run-*`` uploads it later)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=False, description="log run and training metrics to W&B (shorthand: "
                          "`logging.wandb=true`, `logging.wandb=offline|online`)")
    mode: Literal["offline", "online"] = Field(default="offline", description="offline (no network, no login; "
                                               "`wandb sync` uploads later) or online")
    project: str = Field(default="polar_gym", description="the W&B project")
    entity: str | None = Field(default=None, description="the W&B entity (null: the account's default)")
    name: str | None = Field(default=None, description="the run's name (null: the out_dir's name)")
    group: str | None = Field(default=None, description="the run's group (null: none)")
    tags: list[str] = Field(default_factory=list, description="the run's tags")
    dir: str | None = Field(default=None, description="where the W&B run folder goes (null: out_dir; W&B adds "
                            "wandb/)")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if isinstance(data, bool):
            return {"enabled": data}
        if isinstance(data, str) and data in ("offline", "online"):
            return {"enabled": True, "mode": data}
        if isinstance(data, str) and data.lower() in ("true", "false"):
            return {"enabled": data.lower() == "true"}
        if isinstance(data, str):
            raise ValueError(f"wants true, false, offline, online or a mapping of keys, got {data!r}")
        return data


class TensorboardSettings(BaseModel):
    """TensorBoard event files (tensorboardX), off by default."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=False, description="write TensorBoard event files of run and training metrics "
                          "(shorthand: `logging.tensorboard=true` or `logging.tensorboard=DIR`)")
    dir: str | None = Field(default=None, description="the event files' directory (null: out_dir/tensorboard)")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if isinstance(data, bool):
            return {"enabled": data}
        if isinstance(data, str):
            if data.lower() in ("true", "false"):
                return {"enabled": data.lower() == "true"}
            return {"enabled": True, "dir": data}
        return data


class LoggingSettings(BaseModel):
    """Where run and training metrics go besides results.jsonl and train_metrics.jsonl."""

    model_config = ConfigDict(extra="forbid")

    wandb: WandbSettings = Field(default_factory=WandbSettings)
    tensorboard: TensorboardSettings = Field(default_factory=TensorboardSettings)

    @property
    def enabled(self) -> bool:
        return self.wandb.enabled or self.tensorboard.enabled


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector: its base URL gets ``/v1/traces`` (as OTEL_EXPORTER_OTLP_ENDPOINT
    does); a URL that already names a path is used as it is."""
    path = urlsplit(endpoint).path
    return endpoint if path.strip("/") else endpoint.rstrip("/") + "/v1/traces"


class TelemetrySettings(BaseModel):
    """OpenTelemetry spans of the gateway: one per session, one per stage, one per model call, exported when a
    session finishes (a background batch: a collector that is down never slows or fails a session)."""

    model_config = ConfigDict(extra="forbid")

    otlp_endpoint: str | None = Field(default=None, description="an OTLP/HTTP collector, e.g. "
                                      "http://127.0.0.1:4318 (/v1/traces is appended to a bare URL); null: none")
    file: str | None = Field(default=None, description="also write every span as one JSON line to this file "
                             "(offline runs, tests); null: none")
    service_name: str = Field(default="polar_gym-gateway", description="the spans' service.name")
    export_timeout_seconds: float = Field(default=5.0, gt=0, description="how long one export to the collector "
                                          "may take (retries included) before its batch is dropped")
    resource: dict[str, str] = Field(default_factory=dict, description="extra resource attributes (the launch "
                                     "adds polar_gym.out_dir and polar_gym.launch_id)")

    @field_validator("otlp_endpoint")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and urlsplit(value).scheme not in ("http", "https"):
            raise ValueError(f"wants an http(s) URL of an OTLP/HTTP collector, got {value!r}")
        return value

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_endpoint or self.file)
