"""Forked tasks (polar_gym.tasks.forks): a task carries alternative oracle scripts beside its reference, from a
fork in the launch config (any task source: demo, dataset rows, Harbor) or from a Harbor task's ``solution-<name>/``
directories; sample i of the task plays ``[reference, *variants][i % n]`` and its metadata names the script."""

from __future__ import annotations

import base64
import gzip
import importlib
import io
import json
import shlex
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from pydantic import ValidationError

from polar_gym.datagen import dataset_requests
from polar_gym.datagen.template import TaskTemplate
from polar_gym.launch import CONF_DIR, build_job, run
from polar_gym.launch.tasks import demo_requests, harbor_requests
from polar_gym.schema import (
    AgentSpec,
    BuilderSpec,
    EvaluatorSpec,
    OracleScript,
    RuntimeSpec,
    SessionSpec,
    TaskMetadata,
    TaskRequest,
)
from polar_gym.settings import ConfigError
from polar_gym.tasks.forks import TaskFork, fork_requests, oracle_scripts
from polar_gym.tasks.harbor import scan_tasks

HARBOR = Path(__file__).resolve().parents[1] / "data" / "harbor" / "tasks"
WRONG_ADD = TaskFork(name="wrong", tasks=["demo-calc-add"], replace={"return a + b": "return a * b"})
#: the other demo the docs fork: the slug joined by underscores (the reference writes "-".join, shell-quoted)
UNDERSCORE = TaskFork(name="underscore", tasks=["demo-slugify"], replace=[{"old": '"-".join', "new": '"_".join'}])


def _template(num_samples: int = 4, backend: str = "local") -> TaskTemplate:
    return TaskTemplate(agent=AgentSpec(harness="pi"), runtime=RuntimeSpec(backend=backend), builder=BuilderSpec(),
                        evaluator=EvaluatorSpec(strategy="test_on_output"), num_samples=num_samples)


def _played(request: TaskRequest) -> list[tuple[str, str]]:
    """(oracle_variant, the first command) of each session of the request, as the server expands it."""
    out = []
    for i in range(request.num_samples):
        meta = SessionSpec.from_task(request, i).metadata.model_dump()
        assert "oracle_variants" not in meta or meta["oracle_variants"] is None  # a session carries its script only
        out.append((meta["oracle_variant"], meta["oracle"]["commands"][0]))
    return out


def composed(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


# -- round robin -----------------------------------------------------------------------------------------------------

def test_a_fork_makes_samples_alternate_between_the_reference_and_the_variant() -> None:
    requests = demo_requests(_template(), ids=["demo-calc-add", "demo-slugify", "demo-inventory"])
    forked = fork_requests(requests, [WRONG_ADD, UNDERSCORE])
    assert [r.task_id for r in forked] == [r.task_id for r in requests]
    add, slug, inventory = (_played(r) for r in forked)
    assert [name for name, _ in add] == ["reference", "wrong", "reference", "wrong"]
    assert all("return a + b" in cmd and "return a * b" not in cmd for name, cmd in add if name == "reference")
    assert all("return a * b" in cmd and "return a + b" not in cmd for name, cmd in add if name == "wrong")
    assert [name for name, _ in slug] == ["reference", "underscore"] * 2
    assert '"_".join' in slug[1][1] and '"-".join' not in slug[1][1]
    assert [name for name, _ in inventory] == ["reference"] * 4  # not named by a fork: unchanged
    assert forked[2] == requests[2]
    # the variant keeps the reference's final answer and every command but the changed one
    wrong = forked[0].metadata.oracle_variants
    assert wrong is not None and len(wrong) == 1
    reference = OracleScript.model_validate(requests[0].metadata.model_dump()["oracle"])
    assert wrong[0].final_answer == reference.final_answer and wrong[0].commands[1:] == reference.commands[1:]
    assert requests[0].metadata.oracle_variants is None  # pure: the input is not changed


def test_several_variants_play_in_order_and_explicit_commands_work() -> None:
    (request,) = demo_requests(_template(num_samples=6), ids=["demo-calc-add"])
    forks = [WRONG_ADD, TaskFork(name="noop", tasks=["demo-calc-add"], commands=["true"], final_answer="Nothing.")]
    (forked,) = fork_requests([request], forks)
    assert [name for name, _ in _played(forked)] == ["reference", "wrong", "noop"] * 2
    assert [s.name for s in oracle_scripts(forked.metadata)] == ["reference", "wrong", "noop"]
    spec = SessionSpec.from_task(forked, 5)
    assert spec.metadata.model_dump()["oracle"] == {"commands": ["true"], "reads": [], "final_answer": "Nothing.",
                                                    "name": "noop", "reasoning": "brief"}  # thinks briefly
    assert SessionSpec.model_validate_json(spec.model_dump_json()) == spec  # what the server stores reads back
    assert TaskRequest.model_validate_json(forked.model_dump_json()) == forked


def test_a_task_without_variants_still_names_its_script() -> None:
    (request,) = demo_requests(_template(num_samples=1), ids=["demo-stack-module"])
    meta = SessionSpec.from_task(request, 0).metadata
    assert meta.model_dump()["oracle_variant"] == "reference" and meta.model_dump()["oracle"] == \
        request.metadata.model_dump()["oracle"]
    bare = TaskRequest(task_id="t", instruction="x", agent=AgentSpec(harness="pi"))
    assert SessionSpec.from_task(bare, 3).metadata == bare.metadata  # no oracle script: nothing added


# -- errors ----------------------------------------------------------------------------------------------------------

def _problems(requests: list[TaskRequest], forks: list[TaskFork]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        fork_requests(requests, forks)
    return info.value.problems


def test_fork_errors_name_the_task_the_fork_and_the_problem_all_at_once() -> None:
    requests = demo_requests(_template())
    problems = _problems(requests, [
        TaskFork(name="wrong", tasks=["demo-calc-add", "demo-nope"], replace={"return a + b": "return a * b"}),
        TaskFork(name="absent", tasks=["demo-slugify"], replace={"no such text": "x"}),
        TaskFork(name="same", tasks=["demo-calc-add"], replace={"return a + b": "return a + b"}),
        TaskFork(name="wrong", tasks=["demo-inventory"], commands=["true"]),
    ])
    text = "\n".join(f"{k}: {m}" for k, m in problems)
    assert "forks.0.tasks: fork 'wrong': unknown task id(s) demo-nope; known: demo-calc-add, demo-slugify" in text
    assert ("forks.1: task demo-slugify: fork 'absent': 'no such text' does not occur in the reference solution"
            in text)
    assert "forks.2: task demo-calc-add: fork 'same' leaves the reference solution unchanged" in text
    assert "forks.3.name: 'wrong' names two forks" in text


def test_a_fork_without_tasks_applies_to_every_task_and_says_so_when_one_lacks_the_text() -> None:
    requests = demo_requests(_template(), ids=["demo-calc-add", "demo-slugify"])
    (problem,) = _problems(requests, [TaskFork(name="wrong", replace={"return a + b": "return a * b"})])
    assert problem[0] == "forks.0" and "task demo-slugify" in problem[1] and "list the ones it is for in tasks" \
        in problem[1]
    (forked,) = fork_requests(requests[:1], [TaskFork(name="wrong", replace={"return a + b": "return a * b"})])
    assert [n for n, _ in _played(forked)] == ["reference", "wrong"] * 2


def test_too_few_samples_a_taken_name_and_a_task_without_a_script_are_errors() -> None:
    (two,) = demo_requests(_template(num_samples=1), ids=["demo-calc-add"])
    (problem,) = _problems([two], [WRONG_ADD])
    assert problem[0] == "num_samples" and "2 oracle scripts (reference, wrong) but num_samples=1" in problem[1]
    (forked,) = fork_requests(demo_requests(_template(), ids=["demo-calc-add"]), [WRONG_ADD])
    (taken,) = _problems([forked], [WRONG_ADD])
    assert taken[0] == "forks.0.name" and "already has an oracle script named 'wrong'" in taken[1]
    bare = TaskRequest(task_id="t", instruction="x", num_samples=2, agent=AgentSpec(harness="pi"))
    assert _problems([bare], [TaskFork(name="w", tasks=["t"], commands=["true"])]) == [
        ("forks.0.tasks", "fork 'w': task t has no oracle script to fork")]
    assert _problems([bare], [TaskFork(name="w", commands=["true"])]) == [
        ("forks.0", "fork 'w': no task has an oracle script to fork")]
    assert fork_requests([bare], [TaskFork(name="w", tasks=["gone"], commands=["x"])], refused={"gone"}) == [bare]


@pytest.mark.parametrize(("fork", "message"), [
    ({"name": "reference", "commands": ["x"]}, "names the task's own solution"),
    ({"name": "../up", "commands": ["x"]}, "should match pattern"),
    ({"name": "w"}, "give either replace"),
    ({"name": "w", "commands": ["x"], "replace": {"a": "b"}}, "not both"),
    ({"name": "w", "replace": {}}, "at least one"),
    ({"name": "w", "replace": [{"old": "", "new": "x"}]}, "at least 1 character"),
    ({"name": "w", "tasks": [], "commands": ["x"]}, "empty list"),
    ({"name": "w", "commands": ["x"], "bogus": 1}, "Extra inputs"),
])
def test_a_fork_that_cannot_mean_anything_does_not_validate(fork: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TaskFork.model_validate(fork)


def test_task_metadata_refuses_variants_without_a_reference_or_with_a_repeated_name() -> None:
    with pytest.raises(ValidationError, match="need the reference script"):
        TaskMetadata(oracle_variants=[OracleScript(name="w")])
    with pytest.raises(ValidationError, match="names repeat: reference"):
        TaskMetadata(oracle={"commands": ["a"]}, oracle_variants=[OracleScript(commands=["b"])])


# -- through the launch config ---------------------------------------------------------------------------------------

CLI_FORK = 'forks=[{name: wrong, tasks: [demo-calc-add], replace: [{old: "return a + b", new: "return a * b"}]}]'


def test_the_launch_forks_demo_and_dataset_tasks_from_the_command_line(tmp_path: Path) -> None:
    job = build_job(composed(f"out_dir={tmp_path / 'run'}", "tasks.ids=[demo-calc-add,demo-slugify]",
                             "num_samples=2", CLI_FORK))
    assert [[v.name for v in r.metadata.oracle_variants or []] for r in job.requests] == [["wrong"], []]
    # the README's line: no tasks list, one task in the run
    job = build_job(composed(f"out_dir={tmp_path / 'run'}", "tasks.ids=[demo-calc-add]", "num_samples=4",
                             'forks=[{name: wrong, replace: [{old: "return a + b", new: "return a * b"}]}]'))
    assert [n for n, _ in _played(job.requests[0])] == ["reference", "wrong"] * 2
    # a dataset row naming a demo: the row's task id, the demo's script, forked the same way
    dataset = tmp_path / "tasks.jsonl"
    dataset.write_text(json.dumps({"instance_id": "acme__calc-1", "repo": "acme/calc", "demo": "demo-calc-add"})
                       + "\n" + json.dumps({"instance_id": "acme__slug-2", "repo": "acme/slugs",
                                            "demo": "demo-slugify"}) + "\n")
    forks = ('forks=[{name: wrong, tasks: [acme__calc-1], replace: [{old: "return a + b", new: "return a * b"}]}, '
             """{name: under, tasks: [acme__slug-2], replace: [{old: '"-".join', new: '"_".join'}]}]""")
    job = build_job(composed(f"out_dir={tmp_path / 'run'}", "tasks=dataset", f"tasks.path={dataset}",
                             "num_samples=2", forks))
    assert [[n for n, _ in _played(r)] for r in job.requests] == [["reference", "wrong"], ["reference", "under"]]
    assert dataset_requests(_template(), str(dataset))[0].metadata.oracle_variants is None  # the source is as it was


def test_a_configured_oracle_script_is_played_by_every_session_instead_of_the_tasks_own(tmp_path: Path) -> None:
    """inference.oracle_script is "played instead of each task's reference solution": demo and Harbor tasks carry
    their own script, which the oracle plays before the one its gateway was started with, so the launch puts the
    configured one in every request (a fork's variants too)."""
    script = tmp_path / "slow.json"
    script.write_text(json.dumps({"commands": ["sleep 12"], "final_answer": "done"}))
    job = build_job(composed(f"out_dir={tmp_path / 'run'}", "tasks.ids=[demo-calc-add,demo-slugify]", "num_samples=2",
                             CLI_FORK, f"inference.oracle_script={script}"))
    assert [_played(r) for r in job.requests] == [[("reference", "sleep 12")] * 2] * 2
    plain = build_job(composed(f"out_dir={tmp_path / 'run'}", "tasks.ids=[demo-calc-add]"))
    assert _played(plain.requests[0])[0][1] != "sleep 12"  # without it, the task's own
    (tmp_path / "bad.json").write_text('{"commands": "sleep 12"}')
    with pytest.raises(ConfigError, match=r"inference\.oracle_script"):
        build_job(composed(f"out_dir={tmp_path / 'run'}", f"inference.oracle_script={tmp_path / 'bad.json'}"))


def test_a_fork_that_does_not_apply_stops_the_launch_with_exit_2(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    bad = 'forks=[{name: wrong, tasks: [demo-nope], replace: [{old: "a", new: "b"}]}]'
    assert run(composed(f"out_dir={out}", "tasks.ids=[demo-calc-add]", "num_samples=2", bad)) == 2
    err = capsys.readouterr().err
    assert "forks.0.tasks: fork 'wrong': unknown task id(s) demo-nope; known: demo-calc-add" in err
    assert run(composed(f"out_dir={out}", "forks=[{name: reference, commands: [x]}]")) == 2
    assert "forks.0: 'reference' names the task's own solution" in capsys.readouterr().err
    assert not out.exists()


# -- Harbor: solution-<name>/ directories ----------------------------------------------------------------------------

def _harbor_task(tmp_path: Path, name: str = "edit-greeting") -> Path:
    task = tmp_path / "tasks" / name
    shutil.copytree(HARBOR / "edit-greeting", task)
    return task


def _solve_sh(command: str) -> str:
    """solve.sh as the oracle's one command carries it (the base64 tarball unpacked)."""
    encoded = command.split("printf %s ", 1)[1].split(" ", 1)[0]
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(base64.b64decode(encoded)))) as tar:
        member = tar.extractfile("solve.sh")
        assert member is not None
        return member.read().decode()


def test_a_harbor_tasks_solution_dirs_become_variants_played_round_robin(tmp_path: Path) -> None:
    task = _harbor_task(tmp_path)
    (task / "solution-wrong").mkdir()
    (task / "solution-wrong" / "solve.sh").write_text('#!/bin/bash\necho "Hello, World!" > /app/greeting.txt\n')
    (task / "solution-partial").mkdir()
    (task / "solution-partial" / "solve.sh").write_text("#!/bin/bash\ntrue\n")
    (request,) = harbor_requests(_template(num_samples=3), str(task.parent)).requests
    played = _played(request)
    assert [n for n, _ in played] == ["reference", "partial", "wrong"]  # the directories in name order
    assert "Hello, Harbor!" in _solve_sh(played[0][1]) and "Hello, World!" in _solve_sh(played[2][1])
    assert _solve_sh(played[1][1]) == "#!/bin/bash\ntrue\n"
    (none,) = harbor_requests(_template(), str(task.parent), solution="none").requests
    assert none.metadata.oracle_variants is None  # solution=none plays nothing, variants neither
    # a fork applies over a Harbor task's own variants, after them
    (forked,) = fork_requests([request.model_copy(update={"num_samples": 4})],
                              [TaskFork(name="extra", commands=["true"])])
    assert [n for n, _ in _played(forked)] == [
        "reference", "partial", "wrong", "extra"]


@pytest.mark.parametrize(("make", "message"), [
    (lambda t, o: (t / "solution-a b").mkdir(), r"'solution-a b': an alternative solution directory is"),
    (lambda t, o: (t / "solution-reference").mkdir(), "not 'reference'"),
    (lambda t, o: (t / "solution-x").write_text("x"), "solution-x: an alternative solution must be a directory"),
    (lambda t, o: (t / "solution-x").mkdir(), "missing solution-x/solve.sh"),
    (lambda t, o: (t / "solution-x").symlink_to(o), "solution-x: is a symbolic link"),
    (lambda t, o: ((t / "solution-x").mkdir(), (t / "solution-x" / "solve.sh").symlink_to(o / "solve.sh")),
     "solution-x/solve.sh: is a symbolic link"),
])
def test_a_hostile_or_broken_variant_dir_refuses_the_task_naming_it(tmp_path: Path,
                                                                    make: Callable[[Path, Path], object],
                                                                    message: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "solve.sh").write_text("#!/bin/bash\ncat /etc/shadow\n")
    task = _harbor_task(tmp_path)
    _harbor_task(tmp_path, "good")
    make(task, outside)
    tasks, refused = scan_tasks(task.parent)
    assert [t.task_id for t in tasks] == ["good"]
    assert [r.task_id for r in refused] == ["edit-greeting"] and message in refused[0].problem, refused


def test_exports() -> None:
    mod = importlib.import_module("polar_gym.tasks.forks")
    assert mod.__all__ and all(hasattr(mod, name) for name in mod.__all__)


# -- the docs' examples ----------------------------------------------------------------------------------------------

def _docs_section() -> str:
    text = (Path(__file__).resolve().parents[2] / "docs" / "datagen.md").read_text()
    return text.split("## Forking a task", 1)[1].split("\n## ", 1)[0]


def _blocks(section: str, lang: str) -> list[str]:
    return [part.split("\n```", 1)[0] for part in section.split(f"```{lang}\n")[1:]]


def test_the_docs_fork_commands_parse_through_hydra_and_fork_their_task(tmp_path: Path) -> None:
    commands = _blocks(_docs_section(), "bash")
    assert len(commands) == 2
    played = []
    for command in commands:
        argv = shlex.split(command.replace("\\\n", " "))
        assert argv[:3] == ["python", "-m", "polar_gym.launch"]
        overrides = [a if not a.startswith("out_dir=") else f"out_dir={tmp_path / 'run'}" for a in argv[3:]]
        job = build_job(composed(*overrides))
        assert job.datagen is not None and job.datagen.sft_include_failures
        (request,) = job.requests
        played.append([name for name, _ in _played(request)])
    assert played == [["reference", "wrong"] * 2, ["reference", "underscore"] * 2]


def test_the_docs_yaml_forks_apply_to_the_demo_tasks() -> None:
    (block,) = _blocks(_docs_section(), "yaml")
    forks = [TaskFork.model_validate(f) for f in yaml.safe_load(block)["forks"]]
    forked = fork_requests(demo_requests(_template(num_samples=2), ids=["demo-calc-add", "demo-slugify"]), forks)
    add, slug = (SessionSpec.from_task(r, 1).metadata.model_dump()["oracle"]["commands"][0] for r in forked)
    assert "return a * b" in add and '"_".join' in slug and '"-".join' not in slug
