"""runtime=docker as an unprivileged user, through rootless podman (runc, the user's subordinate ids, cgroupfs on this
host's cgroup v1, overlay storage): set-up built the harness image with no root step (its base by mmdebstrap in a
user namespace), the docker backend's conformance suite passes as the user, and the pi CLI solves the demo tasks
in that image through ``python -m polar_gym.launch runtime=docker``."""

from __future__ import annotations

import json
import pwd
import shutil

import pytest

from polar_gym.apptainer.offline import default_image
from tests.unprivileged._user_kit import USER, UserClone, as_user, readme_run, readme_user_block

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rootless_podman(user_clone: UserClone) -> UserClone:
    if shutil.which("podman") is None or shutil.which("runc") is None:
        pytest.skip("podman and runc are not installed (bash scripts/setup.sh as root installs them)")
    info = as_user("podman info --format '{{.Host.Security.Rootless}} {{.Store.GraphDriverName}}'",
                   cwd=user_clone.home, timeout=120)
    assert info.returncode == 0, info.stderr[-2000:]
    assert info.stdout.split() == ["true", "overlay"], info.stdout  # set-up moved the fresh store to overlay
    return user_clone


def test_setup_built_the_harness_image_rootless(rootless_podman: UserClone) -> None:
    out = rootless_podman.setup_output
    assert f"harness image ready: {default_image()}" in out, out[-3000:]
    exists = as_user(f"podman image exists {default_image()}", cwd=rootless_podman.home, timeout=60)
    assert exists.returncode == 0, "the harness image is not in the user's own podman store"


def test_the_docker_conformance_suite_as_an_unprivileged_user(rootless_podman: UserClone) -> None:
    """tests/runtime's conformance suite on ``docker``, run by the user: every guarantee but the cgroup limits,
    which rootless podman cannot enforce on cgroup v1 (they skip, saying so; podman_host logs it); a container
    of a SIGKILLed gateway stops on its own (its lease); and a task's env naming a library to preload or audit
    never reaches the user's podman or conmon (tests/runtime/test_hostile_env.py's docker cases)."""
    proc = as_user(".venv/bin/python -m pytest -q -p no:cacheprovider -rs -m 'not slow' "
                   "tests/runtime/test_conformance.py tests/runtime/test_hostile_env.py "
                   "tests/runtime/test_docker.py::test_a_container_outlives_no_sigkilled_gateway -k docker",
                   cwd=rootless_podman.clone, timeout=1200)
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout and " failed" not in proc.stdout, report


def test_pi_solves_the_demo_tasks_with_runtime_docker_as_the_user(rootless_podman: UserClone) -> None:
    docker_line = readme_user_block()[-1]  # the README's walkthrough, as written
    assert "runtime=docker" in docker_line
    run_dir = readme_run(rootless_podman, docker_line)
    results = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    assert len(results) == 4, results
    for r in results:
        assert (r["harness"], r["status"], r["evaluation"]["reward"]) == ("pi", "COMPLETED", 1.0), r
    assert (run_dir / "results.jsonl").stat().st_uid == pwd.getpwnam(USER).pw_uid
    left = as_user("podman ps -aq --filter label=polar_gym.session", cwd=rootless_podman.home, timeout=60)
    assert left.stdout.split() == [], "containers of the run were left behind"
