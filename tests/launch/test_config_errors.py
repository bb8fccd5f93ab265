"""Issue 35, break 9: every configuration mistake exits 2 with its key named, whoever finds it: Hydra composing
(an unknown key, a missing group option, an override that does not parse, a group without a default), OmegaConf
resolving (a bad ``${...}``), a settings model or our own checks. Hydra's own report was exit 1 ("Key 'num_sampels'
is not in struct"). Real ``python -m polar_gym.launch`` processes for the exit code; the mapping in process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from pydantic import BaseModel, ConfigDict, ValidationError

from polar_gym.launch import CONF_DIR, build_job
from polar_gym.launch.config_errors import Composition, config_error

PREFIX = "polar_gym.launch: configuration error: "


def composition_error(*overrides: str) -> HydraException:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            compose("config", overrides=list(overrides))
        except HydraException as exc:
            return exc
    raise AssertionError(f"{overrides} composed")


@pytest.mark.parametrize(("override", "line"), [
    ("num_sampels=2", "num_sampels: not a config key of polar_gym.launch (a typo? a new key takes a +: "
                      "+num_sampels=...)"),
    ("runtime.colour=red", "runtime.colour: not a config key of polar_gym.launch (a typo? a new key takes a +: "
                           "+runtime.colour=...)"),
    ("runtime=dockr", "runtime: no option 'dockr' in conf/runtime; known: apptainer, docker, local"),
    ("+harness=nope", "harness: no option 'nope' in conf/harness; known: "),
    ("num_samples=[", "num_samples: the override 'num_samples=[' does not parse: "),
    ("harness=codex", "harness: Could not override 'harness'. No match in the defaults list."),
])
def test_hydra_s_composition_errors_name_the_key(override: str, line: str) -> None:
    assert str(config_error(composition_error(override))).startswith(line)


def test_a_retired_trainer_key_says_what_replaced_it() -> None:
    """``trainer.tis_cap=2`` (no +, as it was written before issue 37) names its replacement, not a typo."""
    error = str(config_error(composition_error("+trainer=grpo", "trainer.tis_cap=2.0")))
    assert error.startswith("trainer.tis_cap: trainer.tis_cap was replaced by trainer.rollout_correction and "
                            "trainer.correction_threshold: tis_cap=C is rollout_correction=token_truncate"), error


def test_an_interpolation_that_does_not_resolve_names_its_key() -> None:
    from omegaconf.errors import OmegaConfBaseException

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["out_dir=${nope}"])
    with pytest.raises(OmegaConfBaseException) as info:
        build_job(cfg)
    assert str(config_error(info.value)) == "out_dir: Interpolation key 'nope' not found"


def test_a_settings_model_s_validation_error_names_each_field() -> None:
    class Pools(BaseModel):
        model_config = ConfigDict(extra="forbid")
        run_slots: int

    with pytest.raises(ValidationError) as info:
        Pools.model_validate({"run_slots": "many", "colour": 1})
    assert str(config_error(info.value)).splitlines()[1:] == [
        "  run_slots: input should be a valid integer, unable to parse string as an integer",
        "  colour: extra inputs are not permitted"]


def test_composition_raises_hydra_errors_only_until_composed_and_restores_the_user_s_choice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    composition = Composition()
    with composition:
        assert os.environ["HYDRA_FULL_ERROR"] == "1" and not composition.done
        composition.composed()
        assert "HYDRA_FULL_ERROR" not in os.environ and composition.done
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    with composition:
        assert os.environ["HYDRA_FULL_ERROR"] == "1" and not composition.done
    assert os.environ["HYDRA_FULL_ERROR"] == "0"


@pytest.mark.parametrize(("overrides", "line"), [
    (["num_sampels=2"], "num_sampels: not a config key of polar_gym.launch"),  # the typo of the issue
    (["runtime=dockr"], "runtime: no option 'dockr' in conf/runtime"),
    (["out_dir=${nope}"], "out_dir: Interpolation key 'nope' not found"),
    (["num_samples=abc"], "num_samples: input should be a valid integer"),
])
def test_python_m_polar_gym_launch_exits_2_with_one_line_naming_the_key(tmp_path: Path, overrides: list[str],
                                                                       line: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "polar_gym.launch", *overrides, "launcher.progress=false"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith(PREFIX + line) and proc.stderr.count("\n") == 1, proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing was started, no folder made

