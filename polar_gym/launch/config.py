"""From a composed Hydra config to a validated job: the TaskRequests to run, the inference settings and the launcher.

Every key of every group is checked before anything starts, and every problem names its Hydra key
(``harness.config.bogus: extra inputs are not permitted``): each section against its model (AgentSpec, RuntimeSpec,
BuilderSpec, EvaluatorSpec, InferenceSettings, DatagenConfig, TrainerSettings), every name against its registry,
``logging`` / ``telemetry`` against their settings (and whether their packages are installed), each plug-in's own
config against the model it declares (:mod:`polar_gym.launch.checks`), and the ``launcher`` and
``tasks`` plug points (``_target_`` through one loader) against their settings model or signature.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, Field, ValidationError

from polar_gym.datagen.export import DatagenConfig
from polar_gym.datagen.template import RunShape, TaskTemplate
from polar_gym.fleet.settings import InferenceSettings
from polar_gym.launch.checks import (
    builder_problems,
    evaluator_problems,
    harness_problems,
    runtime_problems,
    target_problems,
)
from polar_gym.launch.relaunch import HandOver, RelaunchSettings, Relay
from polar_gym.proxy.settings import check_upstreams_given, read_oracle_script
from polar_gym.registry import BUILDERS, ENGINES, EVALUATORS, HARNESSES, RUNTIMES, Registry, RegistryError, load_dotted
from polar_gym.schema import AgentSpec, BuilderSpec, EvaluatorSpec, RuntimeSpec, TaskRequest
from polar_gym.settings import ConfigError, Problem, validate
from polar_gym.tasks.forks import TaskFork, fork_requests, played_instead
from polar_gym.tasks.refused import RefusedTask, TaskSet
from polar_gym.telemetry import LoggingSettings, TelemetrySettings, missing_packages
from polar_gym.trainer.settings import TrainerSettings

__all__ = [
    "TOP_LEVEL_KEYS",
    "ConfigError",
    "InferenceSettings",
    "LaunchJob",
    "Launcher",
    "RunSettings",
    "TaskTemplate",
    "build_job",
    "build_launcher",
    "load_target",
    "section",
]

#: the keys of a composed config (``hydra`` is Hydra's own)
TOP_LEVEL_KEYS = frozenset({"harness", "builder", "runtime", "evaluator", "inference", "tasks", "launcher",
                            "num_samples", "timeout_seconds", "out_dir", "datagen", "trainer", "logging",
                            "telemetry", "resume", "state_dir", "forks", "relaunch", "hydra"})


class RunSettings(RunShape):
    """The top-level keys of a run."""

    out_dir: str = Field(description="where the run's files go: trajectories.jsonl, results.jsonl, summary.md, "
                         "config.yaml, capture/, gateway/ (default: outputs/DATE/TIME)")
    resume: bool = Field(default=False, description="resume the earlier run in out_dir (its tasks come back from its "
                         "rollout store, the unfinished ones run); without it a folder holding an earlier run is "
                         "refused, so a rerun never returns old results as new ones")
    state_dir: str | None = Field(default=None, description="where the rollout server keeps its store, "
                                  "server.sqlite (null: out_dir); a local disk when out_dir is on a shared one")
    forks: list[TaskFork] = Field(default_factory=list, description="alternative oracle solutions added to tasks "
                                  "(polar_gym.tasks.forks): each {name, tasks, replace: [{old, new}]} or {name, "
                                  "tasks, commands, final_answer}; sample i plays [reference, *forks][i % n]")


class Launcher(Protocol):
    """What a ``launcher._target_`` builds: runs a job, answers the exit code."""

    def launch(self, job: LaunchJob) -> int: ...


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
    #: the ``launcher`` group's launcher, built from its validated settings
    launcher: Launcher | None = None
    #: ``+trainer=sft|grpo``: train instead of only rolling out (polar_gym.launch.training)
    trainer: TrainerSettings | None = None
    #: ``logging.wandb`` / ``logging.tensorboard``: where run and training metrics go besides the run's files
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    #: ``telemetry``: the gateways' OpenTelemetry spans (resource attributes name this launch)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    #: this launch's id (W&B config, the spans' polar_gym.launch_id)
    launch_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    #: ``resume=true``: the earlier run in out_dir may be resumed (polar_gym.launch.earlier_run)
    resume: bool = False
    #: ``state_dir``: where the rollout server's store goes (None: out_dir)
    state_dir: Path | None = None
    #: the tasks the task source refused (never dispatched): each is reported as an ERROR session, ``invalid_task``
    refused: list[RefusedTask] = field(default_factory=list)
    #: ``relaunch``: handing over to a successor Slurm job before this one's time limit
    relaunch: RelaunchSettings = field(default_factory=RelaunchSettings)
    #: the run's relay, once the launch found a Slurm job with a time limit (None: no hand-over)
    relay: Relay | None = None
    #: set when the run handed over: the successor job finishes it
    handover: HandOver | None = None

    @property
    def store(self) -> Path:
        """The rollout server's SQLite store: ``server.sqlite`` in state_dir, else in out_dir."""
        return (self.state_dir or self.out_dir) / "server.sqlite"


def section(cfg: DictConfig, key: str) -> dict[str, Any]:
    """``cfg[key]`` as a plain resolved dict (a missing or non-mapping section is a ConfigError)."""
    node = cfg.get(key)
    if not isinstance(node, DictConfig):
        raise ConfigError(f"config section {key!r} is missing or not a mapping; pick one with `{key}=NAME`")
    plain = OmegaConf.to_container(node, resolve=True)
    assert isinstance(plain, dict)
    return {str(k): v for k, v in plain.items()}


def _check_name(registry: Registry[Any], name: str, where: str) -> list[Problem]:
    if name in registry.names():
        return []
    if ":" in name:  # a user plug-in: it must import
        try:
            registry.get(name)
        except RegistryError as exc:
            return [(where, str(exc))]
        return []
    return [(where, f"unknown {registry.kind} {name!r}; known: {', '.join(registry.names())} "
             "(or a dotted path pkg.module:Name)")]


def load_target(node: dict[str, Any], where: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The one loader for ``_target_`` plug points: the imported object and the node's remaining keys."""
    params = dict(node)
    target = params.pop("_target_", None)
    if not isinstance(target, str):
        raise ConfigError("needs a _target_ (a dotted path pkg.module:Name)", key=where)
    try:
        loaded: Callable[..., Any] = load_dotted(target)
    except RegistryError as exc:
        raise ConfigError(str(exc), key=f"{where}._target_") from None
    return loaded, params


def _validated(model: type[BaseModel], data: dict[str, Any], where: str, problems: list[Problem]) -> Any:
    try:
        return validate(model, data, where)
    except ConfigError as exc:
        problems += exc.problems
        return None


def _template(cfg: DictConfig, problems: list[Problem]) -> tuple[RunSettings, TaskTemplate] | None:
    harness = section(cfg, "harness")
    agent = _validated(AgentSpec, {"harness": harness.pop("name", None), **harness}, "harness", problems)
    # AgentSpec calls it harness; the group calls it name
    problems[:] = [(k.replace("harness.harness", "harness.name", 1), m) for k, m in problems]
    runtime = _validated(RuntimeSpec, section(cfg, "runtime"), "runtime", problems)
    builder = _validated(BuilderSpec, section(cfg, "builder"), "builder", problems)
    evaluator = _validated(EvaluatorSpec, section(cfg, "evaluator"), "evaluator", problems)
    plugins: list[tuple[Any, Registry[Any], str, str, Callable[[], list[Problem]]]] = [
        (agent, HARNESSES, "harness.name", agent and agent.harness, lambda: harness_problems(agent.harness,
                                                                                            agent.config)),
        (runtime, RUNTIMES, "runtime.backend", runtime and runtime.backend,
         lambda: runtime_problems(runtime.backend, runtime.options)),
        (builder, BUILDERS, "builder.strategy", builder and builder.strategy, lambda: builder_problems(builder.config)),
        (evaluator, EVALUATORS, "evaluator.strategy", evaluator and evaluator.strategy,
         lambda: evaluator_problems(evaluator.strategy, evaluator.config.model_dump())),
    ]
    for spec, registry, where, name, own_config in plugins:  # the name, then the plug-in's own config keys
        if spec is not None:
            problems += _check_name(registry, name, where) or own_config()
    run: RunSettings | None = _validated(RunSettings, {k: cfg.get(k) for k in RunSettings.model_fields if k in cfg},
                                         "", problems)
    if run is None or None in (agent, runtime, builder, evaluator):
        return None
    return run, TaskTemplate(agent=agent, runtime=runtime, builder=builder, evaluator=evaluator,
                        num_samples=run.num_samples, timeout_seconds=run.timeout_seconds)


def _inference(cfg: DictConfig, problems: list[Problem]) -> InferenceSettings | None:
    inference: InferenceSettings | None = _validated(InferenceSettings, section(cfg, "inference"), "inference",
                                                     problems)
    if inference is None:
        return None
    named = _check_name(ENGINES, inference.engine, "inference.engine")
    problems += named
    launched = OmegaConf.select(cfg, "launcher.inference_jobs.count", default=0) or 0  # launcher=slurm starts them
    try:
        check_upstreams_given(inference, more_coming=bool(launched))
    except ConfigError as exc:
        problems += [(k, m + "; or launcher=slurm with launcher.inference_jobs.count")
                     for k, m in exc.under("inference").problems]
    return inference


def build_launcher(cfg: DictConfig) -> Launcher:
    """The ``launcher`` group's launcher: its ``_target_`` built from its keys, validated against the target's
    ``settings_model`` (``cls(settings)``) or its signature (``cls(**keys)``)."""
    target, params = load_target(section(cfg, "launcher"), "launcher")
    problems = target_problems(target, params, "launcher")
    if problems:
        raise ConfigError("", problems=problems, title="invalid launcher config")
    declared = getattr(target, "settings_model", None)
    launcher: Launcher
    if isinstance(declared, type) and issubclass(declared, BaseModel):
        launcher = target(declared.model_validate(params))
    else:
        launcher = target(**params)
    return launcher


def _requests(cfg: DictConfig, template: TaskTemplate) -> TaskSet:
    source, params = load_target(section(cfg, "tasks"), "tasks")
    problems = target_problems(source, params, "tasks", skip=1)
    if problems:
        raise ConfigError("", problems=problems, title="invalid tasks config")
    try:
        made = source(template, **params)
    except ValidationError as exc:
        raise ConfigError(f"a TaskRequest does not validate:\n{exc}", key="tasks") from None
    except (TypeError, KeyError, ValueError) as exc:
        raise ConfigError(str(exc), key="tasks") from None
    tasks = made if isinstance(made, TaskSet) else TaskSet(list(made))
    if not tasks.requests:
        raise ConfigError("", problems=[("tasks", r.problem) for r in tasks.refused] or
                          [("tasks", "the task source produced no tasks")], title="no task can be used")
    if not all(isinstance(r, TaskRequest) for r in tasks.requests):
        raise ConfigError("the task source must return TaskRequest objects", key="tasks")
    return tasks


def _metrics(cfg: DictConfig, problems: list[Problem]) -> tuple[LoggingSettings | None, TelemetrySettings | None]:
    logging_settings = telemetry = None
    if cfg.get("logging") is not None:
        logging_settings = _validated(LoggingSettings, section(cfg, "logging"), "logging", problems)
    if cfg.get("telemetry") is not None:
        telemetry = _validated(TelemetrySettings, section(cfg, "telemetry"), "telemetry", problems)
    problems += missing_packages(logging_settings, telemetry)
    return logging_settings, telemetry


def _launch_telemetry(telemetry: TelemetrySettings, out_dir: Path, launch_id: str) -> TelemetrySettings:
    """The gateways' telemetry for this launch: an absolute span file (a gateway job runs elsewhere) and the
    resource attributes that name the run."""
    resource = {"polar_gym.out_dir": str(out_dir.resolve()), "polar_gym.launch_id": launch_id, **telemetry.resource}
    file = str(Path(telemetry.file).resolve()) if telemetry.file else None
    return telemetry.model_copy(update={"resource": resource, "file": file})


def build_job(cfg: DictConfig) -> LaunchJob:
    """Validate every key of a composed config, build the launcher and materialize the TaskRequests (through the
    ``tasks`` plug point); nothing is started. Raises ConfigError listing every problem found (and OmegaConf's
    error, naming the key, for an interpolation that does not resolve)."""
    OmegaConf.to_container(cfg, resolve=True)  # a bad ${...} fails here with its key, not in a later lookup
    problems: list[Problem] = [(str(k), "not a config key of polar_gym.launch (a typo, or a `+key` too many?)")
                               for k in cfg if str(k) not in TOP_LEVEL_KEYS]
    shaped = _template(cfg, problems)
    inference = _inference(cfg, problems)
    datagen = None
    if cfg.get("datagen") is not None:
        datagen = _validated(DatagenConfig, section(cfg, "datagen"), "datagen", problems)
    trainer = None
    if cfg.get("trainer") is not None:
        trainer = _validated(TrainerSettings, section(cfg, "trainer"), "trainer", problems)
    logging_settings, telemetry = _metrics(cfg, problems)
    relaunch = None
    if cfg.get("relaunch") is not None:
        relaunch = _validated(RelaunchSettings, section(cfg, "relaunch"), "relaunch", problems)
    out_dir = cfg.get("out_dir")
    if not out_dir and not any(k == "out_dir" for k, _ in problems):
        problems.append(("out_dir", "must be set (a directory for the run's files)"))
    launcher = None
    try:
        launcher = build_launcher(cfg)
    except ConfigError as exc:
        problems += exc.problems
    if problems:
        raise ConfigError("", problems=problems)
    assert shaped is not None and inference is not None
    run, template = shaped
    if run.resume and trainer is not None and trainer.algorithm != "grpo":
        raise ConfigError("an SFT run (+trainer=sft) cannot be resumed; pick a new out_dir", key="resume")
    launch_id = uuid.uuid4().hex[:12]
    tasks = _requests(cfg, template)
    if run.forks:  # whatever the source (demo, harbor, dataset): a fork that does not apply is the config's error
        tasks = TaskSet(fork_requests(tasks.requests, run.forks, refused={r.task_id for r in tasks.refused}),
                        tasks.refused)
    if inference.engine == "oracle" and inference.oracle_script:
        script = read_oracle_script(inference.oracle_script, key="inference.oracle_script")
        tasks = TaskSet(played_instead(tasks.requests, script), tasks.refused)
    return LaunchJob(requests=tasks.requests, refused=tasks.refused, inference=inference, out_dir=Path(str(out_dir)),
                     resolved_config=OmegaConf.to_yaml(cfg, resolve=True), datagen=datagen, launcher=launcher,
                     trainer=trainer, logging=logging_settings or LoggingSettings(),
                     telemetry=_launch_telemetry(telemetry or TelemetrySettings(), Path(str(out_dir)), launch_id),
                     launch_id=launch_id, resume=run.resume,
                     state_dir=Path(run.state_dir) if run.state_dir else None,
                     relaunch=relaunch or RelaunchSettings())
