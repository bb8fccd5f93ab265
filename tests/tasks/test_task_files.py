"""Issue 35, point 4: a task directory is read as an untrusted archive. Real task directories made in tmp_path with
real symlinks (absolute, relative, dangling, to a directory), real FIFOs and sparse oversized files, loaded the way
``tasks=harbor`` loads them: no link out of the task is followed, no FIFO is opened (a test that would block on the
old code is released by writing EOF into the FIFO after a bounded wait), every read is bounded, and a task's env may
not set a name the host's loader or container engine reads."""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from polar_gym.datagen.template import TaskTemplate
from polar_gym.launch import CONF_DIR, LaunchJob, build_job
from polar_gym.launch.tasks import harbor_task_requests
from polar_gym.schema import AgentSpec, BuilderSpec, EvaluatorSpec, RuntimeSpec
from polar_gym.settings import ConfigError
from polar_gym.tasks.files import MAX_FILE_BYTES, MAX_TEXT_BYTES, TaskFileError, TaskFiles
from polar_gym.tasks.harbor import find_tasks, load_task
from polar_gym.tasks.refused import TaskSet
from tests._waiting import BOUND

DATA = Path(__file__).resolve().parents[1] / "data" / "harbor"
SECRET = "the-host-secret-4d1f"


def _task(root: Path, name: str = "evil") -> Path:
    """A copy of a good test task (edit-greeting: a Dockerfile that COPYs one file) to make hostile."""
    task = root / name
    shutil.copytree(DATA / "tasks" / "edit-greeting", task)
    return task


def _secret(tmp_path: Path) -> Path:
    """A 0600 file outside every task directory (the host file a hostile task wants)."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    secret = outside / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    return secret


def _template(backend: str = "local") -> TaskTemplate:
    return TaskTemplate(agent=AgentSpec(harness="pi"), runtime=RuntimeSpec(backend=backend), builder=BuilderSpec(),
                        evaluator=EvaluatorSpec(strategy="test_on_output"))


def _requests(path: Path, backend: str = "local") -> TaskSet:
    recorded: list[list[str]] = []

    def runner(argv: list[str], timeout: float) -> tuple[int, str]:
        recorded.append(argv)
        return 0, ""

    return harbor_task_requests(_template(backend), str(path), runner=runner)


def _bounded(call: Callable[[], Any], fifo: Path) -> BaseException | None:
    """What ``call()`` raised (None if it returned), run in a thread. The old code blocked forever opening the FIFO:
    after :data:`BOUND` seconds the FIFO gets a writer that closes at once (EOF), which releases it, and the test
    fails saying so."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(BOUND)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # EOF for the blocked reader
        thread.join(BOUND)
        pytest.fail(f"loading the task blocked on the FIFO {fifo} (released after {BOUND:g} s)")
    return outcome[0]


# -- links -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_an_instruction_linked_to_a_host_file_is_refused_naming_the_task_and_the_path(tmp_path, relative) -> None:
    secret = _secret(tmp_path)
    task = _task(tmp_path / "set")
    (task / "instruction.md").unlink()
    (task / "instruction.md").symlink_to(os.path.relpath(secret, task) if relative else secret)
    with pytest.raises(TaskFileError) as caught:
        load_task(task)
    message = str(caught.value)
    assert message.startswith(f"{task}: instruction.md: is a symbolic link to ") and "leaves the task" in message
    assert SECRET not in message


def test_a_dangling_link_out_and_a_link_through_a_linked_directory_are_refused(tmp_path) -> None:
    task = _task(tmp_path / "set")
    (task / "instruction.md").unlink()
    (task / "instruction.md").symlink_to("/nonexistent-polar/instruction.md")
    with pytest.raises(TaskFileError, match=re.escape("instruction.md: is a symbolic link to "
                                                      "'/nonexistent-polar/instruction.md'")):
        load_task(task)
    _secret(tmp_path)
    (task / "instruction.md").unlink()
    (task / "docs").symlink_to(tmp_path / "outside")  # a directory link out, then a file through it
    (task / "instruction.md").symlink_to("docs/secret")
    with pytest.raises(TaskFileError, match=r"instruction\.md: is a symbolic link to 'docs/secret'"):
        load_task(task)


def test_links_that_stay_inside_the_task_are_followed(tmp_path) -> None:
    task = _task(tmp_path / "set")
    (task / "docs").mkdir()
    (task / "docs" / "prompt.md").write_text("Say hello.\n")
    (task / "instruction.md").unlink()
    (task / "instruction.md").symlink_to("docs/prompt.md")
    (task / "environment" / "greeting.txt").rename(task / "environment" / "real.txt")
    (task / "environment" / "greeting.txt").symlink_to("real.txt")
    loaded = load_task(task)
    assert loaded.instruction == "Say hello.\n"
    request = loaded.to_request(harness="pi", model_name="m", runtime=RuntimeSpec(), builder=BuilderSpec(),
                                evaluator=loaded.evaluator(), num_samples=1, timeout_seconds=60)
    assert any(a.dst == "/app/greeting.txt" for a in request.runtime.prepare)


@pytest.mark.parametrize("directory", ["tests", "solution", "environment"])
def test_a_task_directory_linked_out_of_the_task_is_refused(tmp_path, directory) -> None:
    """``tests -> /some/host/dir``: the old code packed the files it found there into the request."""
    task = _task(tmp_path / "set")
    outside = tmp_path / "outside" / directory
    shutil.copytree(task / directory, outside)
    (outside / "loot.txt").write_text(SECRET)
    shutil.rmtree(task / directory)
    (task / directory).symlink_to(outside)
    with pytest.raises(ConfigError) as caught:
        _requests(task.parent, backend="docker" if directory == "environment" else "local")
    assert f"{task}: {directory}: is a symbolic link to " in str(caught.value) and SECRET not in str(caught.value)


def test_a_copy_source_out_of_the_build_context_is_refused_as_a_task_file(tmp_path) -> None:
    secret = _secret(tmp_path)
    task = _task(tmp_path / "set")
    (task / "environment" / "greeting.txt").unlink()
    (task / "environment" / "greeting.txt").symlink_to(secret)
    with pytest.raises(ConfigError, match=re.escape(f"{task}: environment/greeting.txt: is a symbolic link to "
                                                    f"'{secret}', which leaves the build context")):
        _requests(task.parent)
    dockerfile = task / "environment" / "Dockerfile"
    dockerfile.write_text("WORKDIR /app\nCOPY ../solution/solve.sh /app/x\n")  # inside the task, not the context
    with pytest.raises(ConfigError, match=re.escape("environment/../solution/solve.sh: leaves the build context")):
        _requests(task.parent)


# -- FIFOs, devices, sizes ---------------------------------------------------------------------------------------

def test_a_fifo_as_instruction_is_refused_without_opening_it(tmp_path) -> None:
    task = _task(tmp_path / "set")
    (task / "instruction.md").unlink()
    os.mkfifo(task / "instruction.md")
    error = _bounded(lambda: load_task(task), task / "instruction.md")
    assert isinstance(error, TaskFileError) and str(error) == (
        f"{task}: instruction.md: is a FIFO; a task's files are read only when they are regular files"), error


@pytest.mark.parametrize("where", ["source", "inside a copied directory"])
def test_a_fifo_as_a_copy_source_is_refused_and_launch_does_not_hang(tmp_path, where) -> None:
    task = _task(tmp_path / "set")
    context = task / "environment"
    if where == "source":
        (context / "greeting.txt").unlink()
        fifo = context / "greeting.txt"
    else:
        (context / "tree").mkdir()
        fifo = context / "tree" / "pipe"
        (context / "Dockerfile").write_text("WORKDIR /app\nCOPY tree /app/tree\n")
    os.mkfifo(fifo)
    error = _bounded(lambda: _requests(task.parent), fifo)
    assert isinstance(error, ConfigError) and "is a FIFO" in str(error), error
    assert str(fifo.relative_to(task)) in str(error)


def test_a_fifo_in_the_environment_is_refused_before_podman_builds_it(tmp_path) -> None:
    task = _task(tmp_path / "set")
    fifo = task / "environment" / "pipe"
    os.mkfifo(fifo)
    error = _bounded(lambda: _requests(task.parent, backend="docker"), fifo)
    assert isinstance(error, ConfigError) and "environment/pipe: is a FIFO" in str(error), error


def test_a_socket_is_refused_like_a_fifo(tmp_path) -> None:
    import socket

    task = _task(tmp_path / "set")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(task / "instruction.md.sock"))
        (task / "instruction.md").unlink()
        (task / "instruction.md").symlink_to("instruction.md.sock")
        with pytest.raises(TaskFileError, match=r"instruction\.md: is a socket"):
            load_task(task)


def test_an_oversized_instruction_and_an_oversized_environment_file_are_refused(tmp_path) -> None:
    task = _task(tmp_path / "set")
    (task / "instruction.md").write_bytes(b"x" * (MAX_TEXT_BYTES + 1))
    with pytest.raises(TaskFileError, match=re.escape(f"instruction.md: is {MAX_TEXT_BYTES + 1} bytes, over the "
                                                      f"{MAX_TEXT_BYTES} a task file may have")):
        load_task(task)
    (task / "instruction.md").write_text("Say hello.\n")
    with open(task / "environment" / "data.bin", "wb") as sparse:  # no disk space: a hole
        sparse.truncate(MAX_FILE_BYTES + 1)
    with pytest.raises(ConfigError, match=re.escape(f"environment/data.bin: is {MAX_FILE_BYTES + 1} bytes")):
        _requests(task.parent, backend="docker")


def test_every_read_of_one_task_counts_against_its_total_and_walks_are_bounded(tmp_path) -> None:
    (tmp_path / "a").write_bytes(b"a" * 600)
    (tmp_path / "b").write_bytes(b"b" * 600)
    files = TaskFiles(tmp_path, max_total=1000)
    assert files.read_bytes("a") == b"a" * 600
    with pytest.raises(TaskFileError, match="over 0 MiB read"):
        files.read_bytes("b")
    with pytest.raises(TaskFileError, match="over 0 MiB read"):
        TaskFiles(tmp_path, max_total=1000).walk()  # refused from the sizes, before anything is read
    with pytest.raises(TaskFileError, match=r"^.*: /etc/passwd: is an absolute path"):
        files.locate("/etc/passwd")


# -- env ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("section", "name"), [("verifier", "LD_PRELOAD"), ("environment", "LD_AUDIT"),
                                               ("solution", "LD_LIBRARY_PATH"), ("agent", "GCONV_PATH"),
                                               ("verifier", "CONTAINERS_CONF")])
def test_a_task_env_naming_what_the_host_loader_reads_is_refused(tmp_path, section, name) -> None:
    task = _task(tmp_path / "tasks")
    toml = (task / "task.toml").read_text()
    if f"[{section}]" in toml:
        toml = toml.replace(f"[{section}]\n", f"[{section}]\nenv = {{ {name} = \"./evil.so\", OK = \"1\" }}\n")
    else:
        toml += f"\n[{section}]\nenv = {{ {name} = \"./evil.so\" }}\n"
    (task / "task.toml").write_text(toml)
    with pytest.raises(ConfigError, match=re.escape(f"{task}: [{section}] env sets {name!r}: refused")):
        find_tasks(task.parent)


def test_a_local_dockerfile_env_naming_what_the_host_loader_reads_is_refused(tmp_path) -> None:
    task = _task(tmp_path / "set")
    (task / "environment" / "Dockerfile").write_text("WORKDIR /app\nENV LD_PRELOAD=/polar/evil.so\n")
    with pytest.raises(ConfigError, match=re.escape("line 2: ENV LD_PRELOAD: a dynamic loader")):
        _requests(task.parent)


# -- a set with bad tasks ----------------------------------------------------------------------------------------

def _bad_set(tmp_path: Path) -> Path:
    root = tmp_path / "set"
    _task(root, "good")
    for name in ("bad-env", "bad-link"):
        _task(root, name)
    (root / "bad-env" / "task.toml").write_text('[verifier]\nenv = { LD_PRELOAD = "x.so" }\n')
    (root / "bad-link" / "instruction.md").unlink()
    (root / "bad-link" / "instruction.md").symlink_to(_secret(tmp_path))
    return root


def test_every_bad_task_of_a_set_is_named_in_one_refusal_and_unasked_ones_do_not_stop_the_rest(tmp_path) -> None:
    root = _bad_set(tmp_path)
    with pytest.raises(ConfigError) as caught:
        find_tasks(root)
    message = str(caught.value)
    assert message.startswith(f"2 of the 3 Harbor tasks under {root} cannot be used:")
    assert f"{root}/bad-env: [verifier] env sets 'LD_PRELOAD'" in message
    assert f"{root}/bad-link: instruction.md: is a symbolic link" in message and "good" not in message
    assert [t.task_id for t in find_tasks(root, ["good"])] == ["good"]


def _job(root: Path, out: Path, *overrides: str) -> LaunchJob:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return build_job(compose("config", overrides=["tasks=harbor", f"out_dir={out}", f"tasks.path={root}",
                                                      *overrides]))


def test_launch_runs_the_good_tasks_of_a_set_and_carries_each_refused_one(tmp_path) -> None:
    """A bad task is the task's error, not the run's: the job runs the good one and names each refused one (it
    stopped the whole launch with exit 2 before)."""
    root = _bad_set(tmp_path)
    job = _job(root, tmp_path / "out")
    assert [r.task_id for r in job.requests] == ["good"]
    assert [t.task_id for t in job.refused] == ["bad-env", "bad-link"]
    env, link = (t.problem for t in job.refused)
    assert env.startswith(f"{root}/bad-env: [verifier] env sets 'LD_PRELOAD': refused")
    assert link.startswith(f"{root}/bad-link: instruction.md: is a symbolic link")
    assert all(SECRET not in t.problem for t in job.refused)
    # a task refused when its request is made (a runtime it cannot run on) is carried the same way
    (root / "good" / "environment" / "Dockerfile").write_text("FROM x\nRUN apt-get install -y jq\n")
    _task(root, "fine")
    job = _job(root, tmp_path / "out")
    assert [r.task_id for r in job.requests] == ["fine"]
    assert [t.task_id for t in job.refused] == ["bad-env", "bad-link", "good"]
    assert "needs runtime=docker or runtime=apptainer" in job.refused[2].problem
    # tasks.ids: an unasked bad task is not even read, an asked one is refused
    job = _job(root, tmp_path / "out", "tasks.ids=[fine,bad-link]")
    assert [r.task_id for r in job.requests] == ["fine"] and [t.task_id for t in job.refused] == ["bad-link"]


def test_launch_refuses_a_set_whose_every_task_is_refused_naming_each(tmp_path) -> None:
    root = _bad_set(tmp_path)
    shutil.rmtree(root / "good")
    with pytest.raises(ConfigError) as caught:
        _job(root, tmp_path / "out")
    message = str(caught.value)
    assert caught.value.keys == ["tasks"] and f"2 of the 2 Harbor tasks under {root} cannot be used" in message
    assert "bad-env: [verifier] env sets 'LD_PRELOAD'" in message
    assert "bad-link: instruction.md: is a symbolic link" in message and SECRET not in message
    with pytest.raises(ConfigError, match=r"bad-link: instruction\.md: is a symbolic link"):
        _job(root, tmp_path / "out", "tasks.ids=[bad-link]")


def test_the_readers_other_refusals_name_the_path(tmp_path, monkeypatch) -> None:
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x").write_text("x")
    files = TaskFiles(tmp_path)
    with pytest.raises(TaskFileError, match=r"bad\.txt: is not UTF-8 text"):
        files.read_text("bad.txt")
    with pytest.raises(TaskFileError, match="dir: is a directory, not a regular file"):
        files.read_bytes("dir")
    with pytest.raises(TaskFileError, match="nope: no such file"):
        files.read_bytes("nope")
    assert files.kind("bad.txt/below") == "missing" and files.kind("nope") == "missing"
    with pytest.raises(TaskFileError, match=r"bad\.txt: is not a directory"):
        files.walk("bad.txt")
    with pytest.raises(TaskFileError, match="nope: no such directory"):
        files.walk("nope")
    monkeypatch.setattr("polar_gym.tasks.files.MAX_TASK_ENTRIES", 2)
    with pytest.raises(TaskFileError, match=r"holds over 2 entries \(MAX_TASK_ENTRIES\)"):
        files.walk()
    devices = TaskFiles(Path("/dev"))  # a real character device, refused before it is opened
    with pytest.raises(TaskFileError, match="/dev: null: is a character device"):
        devices.read_bytes("null")
    with pytest.raises(TaskFileError, match="null: is a character device"):
        devices.kind("null")
