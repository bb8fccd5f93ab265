"""The ``logging`` / ``telemetry`` keys through Hydra and the launch's validation: shorthands accepted, unknown keys
and bad values refused with their key, a missing package named with the extra, the gateway's flags and a Slurm
gateway job's argv carrying the same settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

import polar_gym.telemetry.sinks as sinks_module
from polar_gym.fleet.settings import InferenceSettings
from polar_gym.gateway.cli import config_from_args, parse_args
from polar_gym.launch import CONF_DIR, ConfigError, build_job
from polar_gym.launch.jobs import GatewayJobSettings, gateway_argv
from polar_gym.telemetry import LoggingSettings, TelemetrySettings, TensorboardSettings, WandbSettings, traces_url


def composed(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_everything_is_off_by_default(tmp_path: Path) -> None:
    job = build_job(composed(f"out_dir={tmp_path}"))
    assert job.logging == LoggingSettings() and not job.logging.enabled
    assert not job.telemetry.enabled and job.telemetry.otlp_endpoint is None


@pytest.mark.parametrize(("override", "wandb"), [
    ("logging.wandb=true", WandbSettings(enabled=True)),
    ("logging.wandb=online", WandbSettings(enabled=True, mode="online")),
    ("logging.wandb=offline", WandbSettings(enabled=True, mode="offline")),
    ("logging.wandb.enabled=true", WandbSettings(enabled=True)),
])
def test_wandb_shorthands(tmp_path: Path, override: str, wandb: WandbSettings) -> None:
    assert build_job(composed(override, f"out_dir={tmp_path}")).logging.wandb == wandb


def test_tensorboard_shorthands_and_the_launch_names_its_spans(tmp_path: Path) -> None:
    job = build_job(composed("logging.tensorboard=true", f"out_dir={tmp_path}"))
    assert job.logging.tensorboard == TensorboardSettings(enabled=True)
    job = build_job(composed(f"logging.tensorboard={tmp_path / 'tb'}", "telemetry.otlp_endpoint=http://c:4318",
                             "telemetry.file=spans.jsonl", f"out_dir={tmp_path}"))
    assert job.logging.tensorboard == TensorboardSettings(enabled=True, dir=str(tmp_path / "tb"))
    assert job.telemetry.otlp_endpoint == "http://c:4318"
    assert job.telemetry.file == str(Path("spans.jsonl").resolve())  # absolute: a gateway job runs elsewhere
    assert job.telemetry.resource == {"polar_gym.out_dir": str(tmp_path.resolve()),
                                      "polar_gym.launch_id": job.launch_id}


@pytest.mark.parametrize(("override", "key"), [
    ("+logging.wandb.bogus=1", "logging.wandb.bogus"),
    ("+logging.extra=1", "logging.extra"),
    ("+telemetry.bogus=1", "telemetry.bogus"),
    ("logging.wandb=maybe", "logging.wandb"),
    ("logging.wandb.mode=sometimes", "logging.wandb.mode"),
    ("telemetry.otlp_endpoint=collector:4318", "telemetry.otlp_endpoint"),
    ("telemetry.export_timeout_seconds=0", "telemetry.export_timeout_seconds"),
])
def test_bad_keys_and_values_are_refused_by_name(tmp_path: Path, override: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_job(composed(override, f"out_dir={tmp_path}"))
    assert err.value.keys == [key]


def test_a_missing_package_is_a_config_error_naming_the_extra(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sinks_module, "_installed", lambda module: not module.startswith(("wandb", "opentelemetry")))
    with pytest.raises(ConfigError) as err:
        build_job(composed("logging.wandb=true", "logging.tensorboard=true", "telemetry.otlp_endpoint=http://c:1",
                           f"out_dir={tmp_path}"))
    assert err.value.keys == ["logging.wandb", "telemetry", "telemetry.otlp_endpoint"]
    assert "pip install 'polar_gym[metrics]'" in str(err.value)
    with pytest.raises(ConfigError, match=r"polar_gym\[metrics\]"):
        sinks_module.MetricSinks.open(LoggingSettings(wandb=WandbSettings(enabled=True)), tmp_path)


def test_traces_url() -> None:
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert traces_url("https://c/otel/v1/traces") == "https://c/otel/v1/traces"


def test_the_gateway_flags_and_a_slurm_gateway_job_carry_the_telemetry(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)  # the flag's default
    telemetry = TelemetrySettings(otlp_endpoint="http://c:4318", file=str(tmp_path / "s.jsonl"),
                                  export_timeout_seconds=2.0, resource={"polar_gym.launch_id": "abc"})
    argv = gateway_argv(InferenceSettings(), GatewayJobSettings(), [], server_url="http://s:1", workdir=tmp_path,
                        heartbeat=1.0, telemetry=telemetry)
    assert config_from_args(parse_args([*argv, "--port", "1"])).telemetry == telemetry
    plain = gateway_argv(InferenceSettings(), GatewayJobSettings(), [], server_url="http://s:1", workdir=tmp_path,
                         heartbeat=1.0, telemetry=TelemetrySettings())
    assert not any(a.startswith("--telemetry") or a == "--otlp-endpoint" for a in plain)
    assert config_from_args(parse_args([*plain, "--port", "1"])).telemetry is None
    with pytest.raises(ConfigError) as err:
        config_from_args(parse_args(["--otlp-endpoint", "nope", "--port", "1"]))
    assert err.value.keys == ["--otlp-endpoint"]
    with pytest.raises(ConfigError) as err:
        config_from_args(parse_args(["--telemetry-file", "x", "--telemetry-resource", "novalue", "--port", "1"]))
    assert err.value.keys == ["--telemetry-resource"]


def test_conf_defaults_are_the_models_defaults() -> None:
    """conf/config.yaml lists every key (so each overrides without `+`) with the models' defaults: one source."""
    cfg = composed()
    assert LoggingSettings.model_validate(OmegaConf.to_container(cfg.logging)) == LoggingSettings()
    assert TelemetrySettings.model_validate(OmegaConf.to_container(cfg.telemetry)) == TelemetrySettings()
    assert set(cfg.logging.wandb) == set(WandbSettings.model_fields)
    assert set(cfg.logging.tensorboard) == set(TensorboardSettings.model_fields)
    assert set(cfg.telemetry) == set(TelemetrySettings.model_fields)
