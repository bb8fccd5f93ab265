"""Every config key is validated when ``launch`` starts, before any session, and a mistyped one is named by its
Hydra key; the conf/ YAML defaults equal the settings models' (one source); conf/README.md's key reference is the
one generated from the models; the CLIs turn a ConfigError into their usual exit naming the flag."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from pydantic import BaseModel

from polar_gym.datagen.export import DatagenConfig
from polar_gym.fleet.settings import InferenceSettings
from polar_gym.gateway.config import GatewayPools
from polar_gym.launch import CONF_DIR, ConfigError, build_job, run
from polar_gym.launch.config import RunSettings
from polar_gym.launch.local import LocalLauncherSettings
from polar_gym.launch.reference import README, check
from polar_gym.launch.relaunch import RelaunchSettings
from polar_gym.launch.submitit_launcher import SlurmLauncherSettings
from polar_gym.schema import AgentSpec, BuilderSpec, EvaluatorSpec, RuntimeSpec
from polar_gym.trainer.settings import TrainerSettings

ROOT = Path(__file__).resolve().parents[2]


def composed(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


#: one mistyped key under every config group (and the top level), and the key the error must name
MISTYPED = [
    (["+harness.config.bogus=1"], "harness.config.bogus"),
    (["+harness=codex", "+harness.config.skils={a: b}"], "harness.config.skils"),
    (["+harness.bogus=1"], "harness.bogus"),
    (["+builder.config.bogus=1"], "builder.config.bogus"),
    (["+builder.bogus=1"], "builder.bogus"),
    (["+evaluator.config.bogus=1"], "evaluator.config.bogus"),
    (["evaluator=session_completed", "+evaluator.config.bogus=1"], "evaluator.config.bogus"),
    (["+evaluator.config.timeout=soon"], "evaluator.config.timeout"),
    (["+evaluator.bogus=1"], "evaluator.bogus"),
    (["+runtime.options.bogus=1"], "runtime.options.bogus"),
    (["+runtime.bogus=1"], "runtime.bogus"),
    (["+inference.bogus=1"], "inference.bogus"),
    (["inference.upstream_timeout=-1"], "inference.upstream_timeout"),
    (["+launcher.bogus=1"], "launcher.bogus"),
    (["launcher.run_slots=0"], "launcher.run_slots"),
    (["launcher=slurm", "+launcher.gateway.bogus=1"], "launcher.gateway.bogus"),
    (["launcher=slurm", "+launcher.inference_jobs.bogus=1"], "launcher.inference_jobs.bogus"),
    (["+tasks.bogus=1"], "tasks.bogus"),
    (["tasks=dataset", "tasks.path=x.jsonl", "+tasks.bogus=1"], "tasks.bogus"),
    (["+datagen=sft", "+datagen.bogus=1"], "datagen.bogus"),
    (["+trainer=grpo", "+trainer.bogus=1"], "trainer.bogus"),
    (["+bogus=1"], "bogus"),
    (["num_samples=0"], "num_samples"),
]


@pytest.mark.parametrize(("overrides", "key"), MISTYPED, ids=[key for _, key in MISTYPED])
def test_a_mistyped_key_under_any_group_stops_launch_before_any_session(tmp_path: Path, overrides: list[str],
                                                                       key: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        build_job(composed(f"out_dir={out}", *overrides))
    assert key in info.value.keys, info.value
    assert run(composed(f"out_dir={out}", *overrides)) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and f"{key}: " in err, err
    assert not out.exists()  # nothing started: no session dir, no server.sqlite


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        build_job(composed("+harness.config.bogus=1", "+inference.bogus=2", "launcher.run_slots=0"))
    assert info.value.keys == ["harness.config.bogus", "inference.bogus", "launcher.run_slots"]
    assert str(info.value).startswith("invalid config:\n  harness.config.bogus: extra inputs are not permitted")


def test_python_m_polar_gym_launch_names_the_key_and_starts_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "polar_gym.launch", "+harness.config.bogus=1", f"out_dir={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "harness.config.bogus: extra inputs are not permitted" in proc.stderr
    assert not out.exists() and not (out / "server.sqlite").exists()


def test_keys_a_task_fills_in_may_be_missing_but_given_ones_must_be_right() -> None:
    """The demo task brings test_on_output's command; swebench_harness's instance comes with a SWE-bench row."""
    assert build_job(composed("+evaluator.config.timeout=7")).requests[0].evaluator.config.model_dump()["timeout"] == 7
    assert build_job(composed("evaluator=swebench_harness")).requests
    assert build_job(composed("+harness=shell", "+harness.config.command='echo hi'")).requests


# -- one source of defaults ----------------------------------------------------------------------------------------

def _agent(data: dict[str, Any]) -> dict[str, Any]:
    return {"harness": data.pop("name"), **data}


#: conf file (or glob) -> its model, how its keys map onto the model, and the keys it sets on purpose
CONF_MODELS: list[tuple[str, type[BaseModel], Any, set[str]]] = [
    ("inference/oracle.yaml", InferenceSettings, None, set()),
    # token_in said outright (issue 41: a launch's mode is its config's, never a cache's)
    ("inference/vllm.yaml", InferenceSettings, None, {"engine", "upstreams", "max_tokens_cap", "prompt_mode"}),
    ("inference/sglang.yaml", InferenceSettings, None, {"engine", "upstreams", "max_tokens_cap", "prompt_mode"}),
    ("inference/openai.yaml", InferenceSettings, None, {"engine", "upstreams", "max_tokens_cap"}),
    ("launcher/local.yaml", LocalLauncherSettings, None, set()),
    ("launcher/slurm.yaml", SlurmLauncherSettings, None, set()),
    ("datagen/sft.yaml", DatagenConfig, None, set()),
    ("trainer/sft.yaml", TrainerSettings, None, set()),
    ("trainer/grpo.yaml", TrainerSettings, None, {"algorithm"}),
    ("runtime/local.yaml", RuntimeSpec, None, set()),
    ("runtime/docker.yaml", RuntimeSpec, None, {"backend", "image"}),
    ("runtime/apptainer.yaml", RuntimeSpec, None, {"backend", "image"}),
    ("evaluator/session_completed.yaml", EvaluatorSpec, None, set()),
    ("evaluator/test_on_output.yaml", EvaluatorSpec, None, {"strategy"}),
    ("evaluator/swebench_harness.yaml", EvaluatorSpec, None, {"strategy", "refresh_runtime"}),
    ("evaluator/harbor.yaml", EvaluatorSpec, None, {"strategy"}),
    ("evaluator/rubric.yaml", EvaluatorSpec, None, {"strategy"}),
    ("builder/prefix_merging.yaml", BuilderSpec, None, set()),
    ("builder/per_request.yaml", BuilderSpec, None, {"strategy"}),
    *[(f"harness/{p.name}", AgentSpec, _agent, {"harness"}) for p in sorted((CONF_DIR / "harness").glob("*.yaml"))],
]


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: data}


def _defaults(model: type[BaseModel]) -> dict[str, Any]:
    required = {n for n, f in model.model_fields.items() if f.is_required()}
    filler = {n: "-" for n in required}
    return {k: v for k, v in _flat(model.model_validate(filler).model_dump(mode="json")).items()
            if k.split(".")[0] not in required}


def test_every_conf_file_of_a_model_has_its_keys_and_the_models_defaults() -> None:
    assert {f"{p.parent.name}/{p.name}" for p in CONF_DIR.glob("*/*.yaml")} - {c for c, *_ in CONF_MODELS} == \
        {"tasks/demo.yaml", "tasks/dataset.yaml", "tasks/harbor.yaml"}  # task sources: checked by their signature
    for conf, model, mapping, on_purpose in CONF_MODELS:
        data = yaml.safe_load((CONF_DIR / conf).read_text()) or {}
        data.pop("_target_", None)
        data = mapping(data) if mapping else data
        model.model_validate(data)  # every key is a field
        assert set(data) == set(model.model_fields), conf  # every field is there (overridable without +)
        expected, given = _defaults(model), _flat(model.model_validate(data).model_dump(mode="json"))
        differ = {k for k in expected if given.get(k) != expected[k]}
        assert {k.split(".")[0] for k in differ} <= on_purpose, (conf, {k: (given.get(k), expected[k])
                                                                          for k in differ})


def test_the_embedded_defaults_and_run_keys_are_the_models() -> None:
    cfg = yaml.safe_load((CONF_DIR / "config.yaml").read_text())
    run_defaults = RunSettings.model_fields
    assert cfg["num_samples"] == run_defaults["num_samples"].default
    assert cfg["timeout_seconds"] == run_defaults["timeout_seconds"].default
    assert cfg["builder"] == BuilderSpec().model_dump()
    assert cfg["relaunch"] == RelaunchSettings().model_dump()
    assert cfg["harness"]["model_name"] == AgentSpec.model_fields["model_name"].default
    tasks = yaml.safe_load((CONF_DIR / "tasks" / "demo.yaml").read_text())
    assert tasks == {"_target_": "polar_gym.launch.tasks:demo_requests", "ids": None}


def test_run_slots_has_one_default_everywhere() -> None:
    default = GatewayPools().run_slots
    assert LocalLauncherSettings().run_slots == SlurmLauncherSettings().gateway.run_slots == default
    assert composed().launcher.run_slots == default
    from polar_gym.gateway.cli import config_from_args, parse_args

    assert config_from_args(parse_args([])).run_slots == default


def test_conf_readme_holds_the_generated_reference() -> None:
    assert check(), "conf/README.md is out of date: run `python -m polar_gym.launch.reference --write`"
    text = README.read_text()
    for key in ("`harness.config.side_model`", "`inference.preflight`", "`launcher.run_slots` | `8`",
                "`launcher.gateway.run_slots` | `8`", "`evaluator.config.command`", "`builder.config.on_rerender`",
                "`tasks.path`", "`datagen.min_reward`", "`num_samples`"):
        assert key in text, key


# -- the CLIs ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "flag"), [
    (["polar_gym.gateway", "--engine", "vllm"], "--upstream: engine 'vllm' needs at least one upstream URL"),
    (["polar_gym.gateway", "--run-slots", "0"], "--run-slots: input should be greater than or equal to 1"),
    (["polar_gym.gateway", "--runtime-option", "nokey"], "--runtime-option: wants KEY=VALUE"),
    (["polar_gym.proxy", "--upstream-timeout", "0"], "--upstream-timeout: input should be greater than 0"),
    (["polar_gym.env", "serve", "--max-tokens-cap", "0"], "--max-tokens-cap: input should be greater than"),
    (["polar_gym.env", "serve", "--run-slots", "0"], "--run-slots: input should be greater than or equal to 1"),
    (["polar_gym.env", "serve", "--engine", "vllm"], "--upstream: engine 'vllm' needs at least one upstream URL"),
])
def test_the_clis_exit_2_naming_the_flag(tmp_path: Path, argv: list[str], flag: str) -> None:
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and flag in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "polar_gym-gateway").exists()


def test_config_error_renders_and_renames_its_keys() -> None:
    one = ConfigError("needs an upstream", key="upstreams")
    assert str(one) == "upstreams: needs an upstream" and one.keys == ["upstreams"]
    assert str(one.under("inference")) == "inference.upstreams: needs an upstream"
    assert str(one.renamed(lambda k: "--upstream")) == "--upstream: needs an upstream"
    many = ConfigError("", problems=[("a", "x"), ("b.c", "y")], title="invalid config")
    assert str(many) == "invalid config:\n  a: x\n  b.c: y"
    assert str(ConfigError("plain")) == "plain"
