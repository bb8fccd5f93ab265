"""From a composed Hydra config to validated wire types: the TaskRequests to run and the inference settings.

Every section is checked against its pydantic wire type (AgentSpec, RuntimeSpec, BuilderSpec, EvaluatorSpec,
TaskRequest) and every name against its registry, so a typo fails before anything starts, with the config path in
the message. Plug points (``launcher``, ``tasks``) name their code with ``_target_`` and go through one loader.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from polar_gym.datagen.export import DatagenConfig
from polar_gym.registry import BUILDERS, ENGINES, EVALUATORS, HARNESSES, RUNTIMES, Registry, RegistryError, load_dotted
from polar_gym.schema import AgentSpec, BuilderSpec, EvaluatorSpec, RuntimeSpec, TaskRequest

__all__ = [
    "ConfigError",
    "InferenceSettings",
    "LaunchJob",
    "TaskTemplate",
    "build_job",
    "load_target",
    "section",
]


class ConfigError(ValueError):
    """A launch config that does not validate; the message names the offending config path."""


class InferenceSettings(BaseModel):
    """The ``inference`` group: which engine the proxy uses and where it finds the model."""

    model_config = ConfigDict(extra="forbid")

    engine: str = "oracle"
    upstreams: list[str] = Field(default_factory=list)
    #: start without upstreams; they arrive later through the rollout server's /backends (a trainer's policy)
    await_upstreams: bool = False
    tokenizer: str | None = None
    upstream_model: str | None = None
    upstream_timeout: float = Field(default=600.0, gt=0)
    policy_version: str | int | None = None
    max_tokens_cap: int | None = Field(default=None, ge=1)
    drift_every: int = Field(default=0, ge=0)
    #: probe every upstream (GET /v1/models) before the first session; a bad one stops the launch (exit code 3)
    preflight: bool = True
    #: seconds one probe may take
    preflight_timeout: float = Field(default=10.0, gt=0)
    #: with ``await_upstreams``: how long the launch waits for its upstreams before the first session
    upstream_wait_seconds: float = Field(default=600.0, ge=0)


class TaskTemplate(BaseModel):
    """What every task of a run shares, from the harness/runtime/builder/evaluator groups; task sources fill in
    the rest. ``evaluator`` config keys override the task's own evaluator config when the strategies agree."""

    model_config = ConfigDict(extra="forbid")

    agent: AgentSpec
    runtime: RuntimeSpec
    builder: BuilderSpec
    evaluator: EvaluatorSpec
    num_samples: int = Field(default=1, ge=1)
    timeout_seconds: float = Field(default=600.0, gt=0)


@dataclass
class LaunchJob:
    """Everything a launcher needs: the validated requests, the inference settings and where results go."""

    requests: list[TaskRequest]
    inference: InferenceSettings
    out_dir: Path
    #: the resolved config as YAML, written next to the results
    resolved_config: str
    #: offline data generation (``+datagen=sft``): one retry of empty generations, then the SFT export
    datagen: DatagenConfig | None = None


def section(cfg: DictConfig, key: str) -> dict[str, Any]:
    """``cfg[key]`` as a plain resolved dict (a missing or non-mapping section is a ConfigError)."""
    if key not in cfg or not isinstance(cfg[key], DictConfig):
        raise ConfigError(f"config section {key!r} is missing or not a mapping; pick one with `{key}=NAME`")
    return OmegaConf.to_container(cfg[key], resolve=True)  # type: ignore[return-value]


def _validate(model: type[BaseModel], data: dict[str, Any], where: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = [f"  {where}.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()]
        raise ConfigError(f"invalid {where} config:\n" + "\n".join(lines)) from None


def _check_name(registry: Registry[Any], name: str, where: str) -> None:
    if name in registry.names():
        return
    if ":" in name:  # a user plug-in: it must import
        try:
            registry.get(name)
        except RegistryError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        return
    raise ConfigError(f"{where}: unknown {registry.kind} {name!r}; known: {', '.join(registry.names())} "
                      "(or a dotted path pkg.module:Name)")


def load_target(node: dict[str, Any], where: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The one loader for ``_target_`` plug points: the imported object and the node's remaining keys."""
    params = dict(node)
    target = params.pop("_target_", None)
    if not isinstance(target, str):
        raise ConfigError(f"{where}: needs a _target_ (a dotted path pkg.module:Name)")
    try:
        return load_dotted(target), params
    except RegistryError as exc:
        raise ConfigError(f"{where}._target_: {exc}") from None


def _template(cfg: DictConfig) -> TaskTemplate:
    harness = section(cfg, "harness")
    agent = _validate(AgentSpec, {"harness": harness.pop("name", None), **harness}, "harness")
    runtime = _validate(RuntimeSpec, section(cfg, "runtime"), "runtime")
    builder = _validate(BuilderSpec, section(cfg, "builder"), "builder")
    evaluator = _validate(EvaluatorSpec, section(cfg, "evaluator"), "evaluator")
    _check_name(HARNESSES, agent.harness, "harness.name")
    _check_name(RUNTIMES, runtime.backend, "runtime.backend")
    _check_name(BUILDERS, builder.strategy, "builder.strategy")
    _check_name(EVALUATORS, evaluator.strategy, "evaluator.strategy")
    return _validate(TaskTemplate, {"agent": agent, "runtime": runtime, "builder": builder, "evaluator": evaluator,
                                    "num_samples": cfg.get("num_samples", 1),
                                    "timeout_seconds": cfg.get("timeout_seconds", 600.0)}, "run")


def build_job(cfg: DictConfig) -> LaunchJob:
    """Validate a composed config and materialize its TaskRequests (through the ``tasks`` plug point)."""
    template = _template(cfg)
    inference = _validate(InferenceSettings, section(cfg, "inference"), "inference")
    _check_name(ENGINES, inference.engine, "inference.engine")
    launched = OmegaConf.select(cfg, "launcher.inference_jobs.count", default=0) or 0  # launcher=slurm starts them
    if inference.engine not in ("oracle",) and not inference.upstreams and not launched \
            and not inference.await_upstreams:
        raise ConfigError(f"inference.upstreams: engine {inference.engine!r} needs at least one upstream URL "
                          "(or launcher=slurm with launcher.inference_jobs.count, or inference.await_upstreams=true)")
    source, params = load_target(section(cfg, "tasks"), "tasks")
    try:
        requests = source(template, **params)
    except ValidationError as exc:
        raise ConfigError(f"tasks: a TaskRequest does not validate:\n{exc}") from None
    except (TypeError, KeyError, ValueError) as exc:
        raise ConfigError(f"tasks: {exc}") from None
    if not requests:
        raise ConfigError("tasks: the task source produced no tasks")
    if not all(isinstance(r, TaskRequest) for r in requests):
        raise ConfigError("tasks: the task source must return TaskRequest objects")
    out_dir = cfg.get("out_dir")
    if not out_dir:
        raise ConfigError("out_dir: must be set (a directory for the run's files)")
    datagen = None
    if cfg.get("datagen") is not None:
        datagen = _validate(DatagenConfig, section(cfg, "datagen"), "datagen")
    return LaunchJob(requests=list(requests), inference=inference, out_dir=Path(str(out_dir)),
                     resolved_config=OmegaConf.to_yaml(cfg, resolve=True), datagen=datagen)
