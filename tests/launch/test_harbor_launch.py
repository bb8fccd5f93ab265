"""Issue 17's third "done when": ``python -m polar_gym.launch tasks=harbor tasks.path=...`` runs Harbor-format tasks
to reward 1.0 with the oracle playing solution/solve.sh and to reward 0 with a wrong solution, through real harness
CLIs on the local sandbox, and on runtime=docker with the task's Dockerfile built into the session image by podman.
pi, the default harness, runs the same tasks solved and with no solution (reward 0) in docs/harbor.md's blocks
(tests/docs/test_doc_commands.py checks each task's reward): here codex, and opencode, whose config once rejected
every path outside its workdir (the oracle's /solution) and scored 0."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from polar_gym.assets import tokenizer_dir
from polar_gym.datagen.template import TaskTemplate
from polar_gym.launch import CONF_DIR, ConfigError, build_job
from polar_gym.launch.tasks import harbor_task_requests
from polar_gym.schema import AgentSpec, BuilderSpec, EvaluatorSpec, RuntimeSpec
from tests._offline_images import image_with_pi

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "harbor"


def _launch(*overrides: str, out: Path, expect: int = 0) -> subprocess.CompletedProcess[str]:
    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")
    done = subprocess.run([sys.executable, "-m", "polar_gym.launch", "tasks=harbor", "launcher.progress=false",
                           *overrides, f"out_dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "COLUMNS": "160"})
    assert done.returncode == expect, (done.stdout + done.stderr)[-4000:]
    return done


def _rewards(out: Path) -> dict[str, tuple[str, float, str]]:
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {r["task_id"]: (r["status"], r["evaluation"]["reward"], r["evaluation"]["details"]["reward_file"])
            for r in rows}


def _all_tasks(tmp_path: Path) -> Path:
    """The three tasks and the wrong-solution variant in one directory (links to the test data)."""
    root = tmp_path / "harbor-tasks"
    root.mkdir()
    for task in [*(DATA / "tasks").iterdir(), *(DATA / "wrong").iterdir()]:
        (root / task.name).symlink_to(task)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("harness", ["codex", "opencode"])
def test_the_oracle_solves_harbor_tasks_and_a_wrong_solution_scores_zero(tmp_path, harness) -> None:
    out = tmp_path / "run"
    done = _launch(f"+harness={harness}", f"tasks.path={_all_tasks(tmp_path)}", out=out)
    assert _rewards(out) == {
        "count-words": ("COMPLETED", 1.0, "reward.json"),
        "edit-greeting": ("COMPLETED", 1.0, "reward.txt"),
        "fix-median": ("COMPLETED", 1.0, "reward.txt"),
        "fix-median-wrong-solution": ("COMPLETED", 0.0, "reward.txt"),
    }
    assert "4/4 completed" in done.stderr and "is ignored on runtime=local" in done.stdout + done.stderr
    # the solution went through the harness's shell tool: the oracle's sampled tool call is in each capture
    records = sorted((out / "capture").glob("*/attempts/*/records.jsonl"))
    assert len(records) == 4 and all("/solution/solve.sh" in r.read_text() for r in records)


def _compose(*overrides: str) -> object:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return build_job(compose("config", overrides=["tasks=harbor", "out_dir=/tmp/unused", *overrides]))


def test_an_environment_the_sandbox_cannot_reproduce_stops_launch_naming_the_runtime_it_needs() -> None:
    with pytest.raises(ConfigError) as caught:
        _compose(f"tasks.path={DATA / 'image'}")
    message = str(caught.value)
    assert "needs runtime=docker or runtime=apptainer" in message and "RUN installs software (apt-get)" in message
    with pytest.raises(ConfigError, match=r"tasks\.solution"):
        _compose(f"tasks.path={DATA / 'tasks'}", "tasks.solution=maybe")


def _podman_image(tag: str) -> str | None:
    """Why the docker tests cannot run here, or None."""
    if shutil.which("podman") is None or shutil.which("runc") is None:
        return "podman and runc are needed for runtime=docker (bash scripts/setup.sh installs them)"
    found = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", tag], capture_output=True,
                           text=True, timeout=60)
    return None if found.returncode == 0 else f"{tag} is not here"


@pytest.mark.slow
def test_on_docker_the_dockerfile_becomes_the_session_image(tmp_path) -> None:
    """The task's Dockerfile, FROM an offline-built image with pi (no registry is reachable here), built by podman.
    It skipped on a fresh machine while it waited for the pi-only image, which another file's test builds."""
    base = image_with_pi()
    root = tmp_path / "tasks"
    for name, where in (("fix-median", "tasks"), ("fix-median-wrong-solution", "wrong")):
        shutil.copytree(DATA / where / name, root / name)
        dockerfile = root / name / "environment" / "Dockerfile"
        dockerfile.write_text(dockerfile.read_text().replace("FROM python:3.12-slim", f"FROM {base}"))
    out = tmp_path / "run"
    env_cli = {k: v for k, v in os.environ.items() if k != "POLAR_DOCKER_CLI"}
    done = subprocess.run([sys.executable, "-m", "polar_gym.launch", "tasks=harbor", "runtime=docker",
                           "launcher.progress=false", f"tasks.path={root}", f"out_dir={out}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env={**env_cli, "COLUMNS": "160"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert _rewards(out) == {"fix-median": ("COMPLETED", 1.0, "reward.txt"),
                             "fix-median-wrong-solution": ("COMPLETED", 0.0, "reward.txt")}
    config = (out / "config.yaml").read_text()
    assert "backend: docker" in config
    images = subprocess.run(["podman", "images", "--format", "{{.Repository}}"], capture_output=True, text=True,
                            timeout=60).stdout.split()
    assert "localhost/polar-harbor/fix-median" in images


@pytest.mark.slow
def test_on_docker_a_registry_base_image_builds_where_a_registry_is_reachable() -> None:
    """needs-jq's Dockerfile installs jq FROM debian:bookworm-slim: it needs that image from a registry. Only the
    build is checked (a session would also need the harness CLI in the image)."""
    reason = _podman_image("docker.io/library/debian:bookworm-slim")
    if reason is not None:
        pytest.skip(f"{reason} and no registry is reachable from this machine (only PyPI, Debian and npm "
                    "mirrors): the build command itself is tested with a recording runner in tests/tasks")
    template = TaskTemplate(agent=AgentSpec(harness="pi"), runtime=RuntimeSpec(backend="docker"),
                            builder=BuilderSpec(), evaluator=EvaluatorSpec())
    (request,) = harbor_task_requests(template, str(DATA / "image")).requests
    assert request.runtime.image is not None and _podman_image(request.runtime.image) is None
