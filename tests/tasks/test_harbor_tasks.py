"""Harbor task directories: task.toml into our model, the Dockerfile subset the local sandbox replays (and what it
refuses), the runtime each backend gets, the image build commands (a recording runner), the oracle's one command."""

from __future__ import annotations

import base64
import importlib
import re
from pathlib import Path

import pytest

from polar_gym.datagen.template import TaskTemplate
from polar_gym.launch.tasks import harbor_requests, harbor_task_requests
from polar_gym.schema import AgentSpec, BuilderSpec, EvaluatorSpec, RuntimeSpec
from polar_gym.settings import ConfigError
from polar_gym.tasks.dockerfile import UnsupportedDockerfile, local_environment, parse_dockerfile
from polar_gym.tasks.harbor import HARBOR_LINKS, HarborTaskConfig, find_tasks, load_task, solution_command
from polar_gym.tasks.harbor_images import ensure_image, image_build_argv

DATA = Path(__file__).resolve().parents[1] / "data" / "harbor"


# -- task.toml ---------------------------------------------------------------------------------------------------

def test_task_toml_is_read_into_our_model_keeping_harbors_other_keys() -> None:
    config = HarborTaskConfig.from_toml((DATA / "tasks" / "fix-median" / "task.toml").read_text())
    assert config.schema_version == "1.0"  # the older `version` key, renamed as Harbor does
    assert (config.verifier.timeout_sec, config.verifier.env, config.agent.timeout_sec) == (120.0, {
        "MEDIAN_CASES": "5"}, 600.0)
    assert (config.environment.cpus, config.environment.memory_mb, config.environment.build_timeout_sec) == (
        1, 2048, 600.0)
    assert config.metadata["difficulty"] == "easy"
    newer = HarborTaskConfig.from_toml('schema_version = "1.4"\n[environment]\nnetwork_mode = "no-network"\n'
                                       'gpus = 0\n[verifier]\ntimeout_sec = 5\n')
    assert newer.schema_version == "1.4" and newer.environment.model_extra == {"network_mode": "no-network",
                                                                                 "gpus": 0}


@pytest.mark.parametrize(("toml", "files", "message"), [
    ("version = [", None, "task.toml does not parse"),
    ("[verifier]\ntimeout_sec = -1\n", None, "task.toml does not parse"),
    ("[[steps]]\nname = 'a'\n", None, "multi-step"),
    ("[environment]\nos = 'windows'\n", None, "only linux"),
    ("", ["instruction.md"], "missing tests/test.sh, solution/solve.sh"),
    ("", ["instruction.md", "environment/docker-compose.yaml"], "multi-container environments are not supported"),
])
def test_broken_task_dirs_are_config_errors_naming_the_problem(tmp_path, toml, files, message) -> None:
    task = tmp_path / "t"
    task.mkdir()
    (task / "task.toml").write_text(toml)
    for name in files if files is not None else ["instruction.md", "tests/test.sh", "solution/solve.sh"]:
        (task / name).parent.mkdir(parents=True, exist_ok=True)
        (task / name).write_text("x")
    with pytest.raises(ConfigError, match=re.escape(message)):
        find_tasks(task)


def test_a_dir_of_tasks_a_single_task_and_ids() -> None:
    assert [t.task_id for t in find_tasks(DATA / "tasks")] == ["count-words", "edit-greeting", "fix-median"]
    assert [t.task_id for t in find_tasks(DATA / "tasks" / "edit-greeting")] == ["edit-greeting"]
    assert [t.task_id for t in find_tasks(DATA / "tasks", ["fix-median", "edit-greeting"])] == [
        "fix-median", "edit-greeting"]
    with pytest.raises(ConfigError, match=r"unknown task\(s\) \['nope'\]"):
        find_tasks(DATA / "tasks", ["nope"])
    with pytest.raises(ConfigError, match="not a directory"):
        find_tasks(DATA / "missing")


# -- the Dockerfile subset ---------------------------------------------------------------------------------------

def test_dockerfile_instructions_are_parsed_with_continuations_comments_and_flags() -> None:
    text = "# c\nFROM python:3.12 AS base\nRUN echo a \\\n  # inside\n  && echo b\nCOPY --chown=1:1 a b\n"
    assert [(i.keyword, i.args, i.flags, i.line) for i in parse_dockerfile(text)] == [
        ("FROM", "python:3.12 AS base", (), 2), ("RUN", "echo a && echo b", (), 3),
        ("COPY", "a b", ("--chown=1:1",), 6)]


def test_the_test_tasks_replay_in_the_sandbox_with_the_base_image_ignored() -> None:
    env = local_environment((DATA / "tasks" / "fix-median" / "environment" / "Dockerfile").read_text(),
                            DATA / "tasks" / "fix-median" / "environment")
    assert env.workdir == "/app" and env.env == {"PYTHONDONTWRITEBYTECODE": "1"}
    assert [(a.type, a.dst) for a in env.prepare] == [("upload_file", "/app/stats.py"), ("exec", None)]
    assert env.prepare[1].command == ("export PYTHONDONTWRITEBYTECODE=1; mkdir -p /app && cd /app && "
                                      'python3 -c "import stats" && mkdir -p notes')
    assert len(env.warnings) == 1 and "python:3.12-slim" in env.warnings[0]


def test_copy_follows_dockers_rules_for_files_dirs_and_trailing_slashes(tmp_path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "sub" / "x.txt").write_text("x")
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "run.sh").chmod(0o755)
    (tmp_path / "blob.bin").write_bytes(b"\xff\x00\xfe")
    dockerfile = ("WORKDIR /srv\nCOPY d /srv/tree\nCOPY run.sh bin/\nCOPY run.sh renamed.sh\n"
                  'COPY ["blob.bin", "run.sh", "many/"]\n')
    env = local_environment(dockerfile, tmp_path)
    assert env.workdir == "/srv"
    summary = [(a.type, a.dst or a.command) for a in env.prepare]
    assert summary[:2] == [("upload_file", "/srv/tree/sub/x.txt"), ("upload_file", "/srv/bin/run.sh")]
    assert ("exec", "chmod +x /srv/bin/run.sh") in summary and ("upload_file", "/srv/renamed.sh") in summary
    blob = next(a.command for a in env.prepare if a.type == "exec" and "base64 -d" in str(a.command))
    assert base64.b64encode(b"\xff\x00\xfe").decode() in str(blob) and str(blob).endswith("> /srv/many/blob.bin")


@pytest.mark.parametrize(("dockerfile", "reason"), [
    ("FROM debian\nRUN apt-get update && apt-get install -y jq\nWORKDIR /app\n", "installs software (apt-get)"),
    ("WORKDIR /app\nRUN pip install requests\n", "installs software (pip)"),
    ("WORKDIR /app\nRUN frobnicate --all\n", "uses frobnicate, which this host does not have"),
    ("WORKDIR /app\nCOPY --from=ghcr.io/astral-sh/uv:0.9.7 /uv /usr/local/bin/uv\n", "copies from another image"),
    ("WORKDIR /app\nCOPY a.txt /etc/a.txt\n", "outside the WORKDIR /app"),
    ("WORKDIR /app\nCOPY *.txt .\n", "wildcard"),
    ("WORKDIR /app\nUSER nobody\n", "USER is not reproduced"),
    ("WORKDIR /app\nADD https://example.com/x.tgz .\n", "ADD is not reproduced"),
    ("WORKDIR /app\nRUN --mount=type=cache,target=/root/.cache true\n", "mounts or network flags"),
    ("WORKDIR /\n", "WORKDIR / cannot be"),
])
def test_what_the_sandbox_cannot_reproduce_is_named(tmp_path, dockerfile, reason) -> None:
    (tmp_path / "a.txt").write_text("a")
    with pytest.raises(UnsupportedDockerfile, match=re.escape(reason)):
        local_environment(dockerfile, tmp_path, which=lambda p: None if p == "frobnicate" else f"/usr/bin/{p}")


# -- the runtime, the evaluator, the oracle ----------------------------------------------------------------------

def _template(backend: str = "local", evaluator: EvaluatorSpec | None = None) -> TaskTemplate:
    return TaskTemplate(agent=AgentSpec(harness="pi"), runtime=RuntimeSpec(backend=backend), builder=BuilderSpec(),
                        evaluator=evaluator or EvaluatorSpec(strategy="test_on_output"))


def test_local_requests_link_harbors_dirs_and_carry_tests_and_solution_inside() -> None:
    requests = harbor_requests(_template(), str(DATA / "tasks")).requests
    greeting = next(r for r in requests if r.task_id == "edit-greeting")
    assert greeting.runtime.workdir == "/app" and greeting.runtime.options == {"links": HARBOR_LINKS}
    assert (greeting.runtime.cpus, greeting.runtime.memory_mb) == (1, 1024)
    assert greeting.timeout_seconds == 360.0  # the agent's 300 s and the verifier's 60 s, under the run's 600
    config = greeting.evaluator.config.model_dump()
    assert greeting.evaluator.strategy == "harbor" and config["timeout"] == 60.0
    assert [(t["path"], t["executable"]) for t in config["tests"]] == [("test.sh", True)]
    (command,) = greeting.metadata.model_dump()["oracle"]["commands"]
    assert re.fullmatch(r"mkdir -p /solution && printf %s [A-Za-z0-9+/=]+ \| base64 -d \| tar -xzf - -C /solution "
                        r"&& chmod \+x /solution/solve.sh && DEBIAN_FRONTEND=noninteractive /solution/solve.sh",
                        command)
    assert command == solution_command(DATA / "tasks" / "edit-greeting" / "solution")  # the same bytes each time
    none = harbor_requests(_template(), str(DATA / "tasks"), ids=["edit-greeting"], solution="none").requests
    assert none[0].metadata.model_dump()["oracle"]["commands"] == []


def test_the_evaluator_group_overrides_the_tasks_keys_or_replaces_the_evaluator() -> None:
    harbor = EvaluatorSpec(strategy="harbor", config={"missing_reward": "error", "timeout": 5})
    (request,) = harbor_requests(_template(evaluator=harbor), str(DATA / "tasks"), ids=["fix-median"]).requests
    config = request.evaluator.config.model_dump()
    assert (config["missing_reward"], config["timeout"], config["env"]) == ("error", 5, {"MEDIAN_CASES": "5"})
    other = EvaluatorSpec(strategy="session_completed")
    (request,) = harbor_requests(_template(evaluator=other), str(DATA / "tasks"), ids=["fix-median"]).requests
    assert request.evaluator == other


def test_an_environment_the_sandbox_cannot_reproduce_says_which_runtime_it_needs() -> None:
    with pytest.raises(ConfigError, match=r"needs runtime=docker or runtime=apptainer:\nline 2: RUN installs"):
        harbor_requests(_template(), str(DATA / "image"))


class Recorder:
    """A runner that records each command line and answers from a script (the image exists or not)."""

    def __init__(self, *codes: int) -> None:
        self.calls: list[list[str]] = []
        self.codes = list(codes)

    def __call__(self, argv: list[str], timeout: float) -> tuple[int, str]:
        self.calls.append(list(argv))
        return self.codes.pop(0), "build output"


def test_on_docker_the_dockerfile_is_built_into_the_session_image_once(monkeypatch) -> None:
    monkeypatch.setenv("POLAR_DOCKER_CLI", "podman --runtime runc")
    runner = Recorder(1, 0)  # not there yet, then built
    (request,) = harbor_task_requests(_template("docker"), str(DATA / "image"), runner=runner).requests
    tag = request.runtime.image
    assert tag is not None and re.fullmatch(r"localhost/polar-harbor/needs-jq:[0-9a-f]{12}", tag)
    assert request.runtime.workdir == "/app" and request.runtime.options == {}
    inspect, build = runner.calls
    assert inspect == ["podman", "--runtime", "runc", "image", "inspect", "--format", "{{.Id}}", tag]
    assert build[:6] == ["podman", "--runtime", "runc", "build", "-t", tag]
    assert build[6] == "-f" and build[8] == str(DATA / "image" / "needs-jq" / "environment")
    again = Recorder(0)  # the image is there: nothing is built
    harbor_task_requests(_template("docker"), str(DATA / "image"), runner=again)
    assert len(again.calls) == 1
    with pytest.raises(ConfigError, match="building the task's image failed"):
        harbor_task_requests(_template("docker"), str(DATA / "image"), runner=Recorder(1, 125))


def test_the_session_dockerfile_adds_harbors_dirs_and_keeps_the_tasks_user(tmp_path) -> None:
    task = find_tasks(DATA / "image")[0]
    text = task.session_dockerfile()
    assert text.startswith((task.dockerfile).read_text().rstrip("\n"))
    assert text.endswith("USER root\nRUN mkdir -p /logs /logs/agent /logs/verifier /solution /tests && chmod 0777 "
                         "/logs /logs/agent /logs/verifier /solution /tests\n")
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM x\nUSER agent\n")
    assert image_build_argv(["docker"], "t", tmp_path, dockerfile) == ["docker", "build", "-t", "t", "-f",
                                                                        str(dockerfile), str(tmp_path)]
    written: list[str] = []

    def runner(argv: list[str], timeout: float) -> tuple[int, str]:
        if "build" in argv:
            written.append(Path(argv[argv.index("-f") + 1]).read_text())
        return (1 if "inspect" in argv else 0), ""

    ensure_image(["podman"], "t", tmp_path, "FROM x\nUSER agent\nUSER root\nRUN true\nUSER agent\n", timeout=5,
                 runner=runner)
    assert written == ["FROM x\nUSER agent\nUSER root\nRUN true\nUSER agent\n"]


def test_apptainer_takes_a_prebuilt_image_only(tmp_path) -> None:
    with pytest.raises(ConfigError, match="runtime=apptainer runs a task's prebuilt image"):
        harbor_requests(_template("apptainer"), str(DATA / "tasks"), ids=["edit-greeting"])
    task = tmp_path / "prebuilt"
    for name in ("instruction.md", "tests/test.sh", "solution/solve.sh"):
        (task / name).parent.mkdir(parents=True, exist_ok=True)
        (task / name).write_text("x")
    (task / "task.toml").write_text('[environment]\ndocker_image = "ghcr.io/acme/env:1"\nworkdir = "/work"\n')
    (request,) = harbor_requests(_template("apptainer"), str(task)).requests
    assert (request.runtime.image, request.runtime.workdir) == ("docker://ghcr.io/acme/env:1", "/work")
    with pytest.raises(ConfigError, match="needs runtime=docker or runtime=apptainer"):
        harbor_requests(_template("local"), str(task))



def test_dockerfile_edges_parent_workdirs_legacy_env_ignored_instructions_and_empty_dirs(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    dockerfile = ("FROM scratch\nLABEL a=b\nWORKDIR /srv\nWORKDIR app\nENV MODE fast mode\nCOPY empty /srv/app/e\n"
                  'EXPOSE 80\nCMD ["sleep", "infinity"]\nRUN ["touch", "x"]\nRUN echo done \\')
    env = local_environment(dockerfile, tmp_path)
    assert env.workdir == "/srv/app" and env.env == {"MODE": "fast mode"}
    assert [a.command for a in env.prepare] == [
        "export MODE='fast mode'; mkdir -p /srv/app/e",
        "export MODE='fast mode'; mkdir -p /srv/app && cd /srv/app && touch x",
        "export MODE='fast mode'; mkdir -p /srv/app && cd /srv/app && echo done"]
    with pytest.raises(UnsupportedDockerfile) as caught:
        local_environment("WORKDIR /other\nCOPY only\nCOPY missing.txt .\nWORKDIR /srv\nCOPY missing.txt .\n",
                          tmp_path)
    assert str(caught.value).splitlines() == [
        "line 1: WORKDIR /other lies outside the final WORKDIR /srv", "line 2: COPY needs a source and a destination",
        "line 3: COPY to /other, outside the WORKDIR /srv",
        "line 5: COPY missing.txt: no such file in the build context"]


def test_a_task_needs_its_files_and_an_image_backend_needs_an_environment(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"not a Harbor task \(no task.toml\)"):
        load_task(tmp_path)
    for name in ("instruction.md", "tests/test.sh", "solution/solve.sh"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    (tmp_path / "task.toml").write_text("")
    with pytest.raises(ConfigError, match="no environment/Dockerfile and no"):
        harbor_requests(_template("docker"), str(tmp_path), build_images=False)
    with pytest.raises(ValueError, match=r"tasks\.solution must be reference or none"):
        harbor_requests(_template(), str(DATA / "tasks"), solution="maybe")


def test_the_harness_config_of_the_run_reaches_every_task() -> None:
    template = _template().model_copy(update={"agent": AgentSpec(harness="codex", config={"reasoning": "low"})})
    (request,) = harbor_requests(template, str(DATA / "tasks"), ids=["edit-greeting"]).requests
    assert request.agent == AgentSpec(harness="codex", config={"reasoning": "low"})


@pytest.mark.parametrize("module", ["polar_gym.tasks", "polar_gym.tasks.harbor", "polar_gym.tasks.dockerfile",
                                    "polar_gym.tasks.harbor_images", "polar_gym.evaluate.harbor",
                                    "polar_gym.launch.tasks"])
def test_exports(module: str) -> None:
    mod = importlib.import_module(module)
    assert mod.__all__ and all(hasattr(mod, name) for name in mod.__all__)
