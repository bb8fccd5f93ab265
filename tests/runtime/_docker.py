"""The docker backend in the runtime conformance suite, configured for podman on this machine.

Podman 4.3 here runs as root and rootless (tests/unprivileged runs this suite as a user), with ``--runtime runc``
(crun fails on this host's cgroups) and explicit ulimits (REFERENCE.md, "Sandboxes on this machine"), which the
backend now probes itself; ``--pull never`` because nothing can be pulled. The image is the busybox test image from
:mod:`polar_gym.runtime.testimage`, imported on first use. When any of that is missing, the docker parameters skip
with the reason, found once per test session by a real ``run --rm``.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from polar_gym.runtime.base import GatewayEndpoint
from polar_gym.runtime.docker import LABEL, DockerRuntime
from polar_gym.runtime.podman_host import host_defaults
from polar_gym.runtime.testimage import TEST_IMAGE, ensure_test_image
from polar_gym.schema import RuntimeSpec
from tests.runtime._runtime_kit import Backend

__all__ = ["PODMAN_CLI", "PODMAN_RUN_ARGS", "direct_run_args", "docker_backend", "leftover_containers", "make_docker",
           "podman_options",
           "unavailable_reason"]

PODMAN_CLI = ["podman", "--runtime", "runc"]
#: no --ulimit here: the backend probes the limits this host needs itself (polar_gym.runtime.podman_host)
PODMAN_RUN_ARGS = ["--pull", "never"]
#: what the helper's own probe runs (outside the backend) add to reach a started container
_TRIAL_ULIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]


def podman_options() -> dict[str, Any]:
    return {"cli": list(PODMAN_CLI), "run_args": list(PODMAN_RUN_ARGS)}


def direct_run_args() -> list[str]:
    """For a test's own ``podman run`` (not through the backend): the probed limits, then the helper's."""
    return [*host_defaults(tuple(PODMAN_CLI)).run_args, *PODMAN_RUN_ARGS]


@functools.cache
def unavailable_reason() -> str | None:
    """Why the docker backend cannot be tested here, or None when a container really runs."""
    missing = [tool for tool in ("podman", "runc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (apt-get install podman runc, or bash scripts/setup.sh)"
    try:
        ensure_test_image(PODMAN_CLI)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        return f"cannot build the busybox test image: {exc}"
    trial = subprocess.run([*PODMAN_CLI, "run", "--rm", *_TRIAL_ULIMITS, *PODMAN_RUN_ARGS, "--network", "none",
                            TEST_IMAGE, "true"],
                           capture_output=True, text=True, timeout=120)
    if trial.returncode != 0:
        return f"podman cannot run a container: {trial.stderr.strip()[-500:]}"
    return None


def require_podman() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def make_docker(spec: RuntimeSpec, session_dir: Path, gateway: GatewayEndpoint | None = None) -> DockerRuntime:
    """A DockerRuntime on podman with the test image unless the spec names another one."""
    if spec.image is None:
        spec = spec.model_copy(update={"image": TEST_IMAGE})
    return DockerRuntime(spec, session_dir, gateway=gateway, options=podman_options())


def leftover_containers(marker: str | None = None) -> list[str]:
    """Containers carrying our label (and, given a marker, the marker in their environment or session label)."""
    ids = subprocess.run([*PODMAN_CLI, "ps", "-a", "-q", "--filter", f"label={LABEL}"], capture_output=True,
                         text=True, check=True).stdout.split()
    if not ids:
        return []
    described = subprocess.run([*PODMAN_CLI, "inspect", "--format", "{{.Name}} {{.Config.Labels}} {{.Config.Env}}",
                                *ids], capture_output=True, text=True).stdout.splitlines()
    return [line for line in described if marker is None or marker in line]


def docker_backend() -> Backend:
    """The conformance suite's entry point (tests/runtime/conftest.py)."""
    require_podman()
    # rootless podman on cgroup v1 cannot enforce --memory / --pids-limit: those tests skip, saying so
    return Backend("docker", make_docker, image=TEST_IMAGE, leftovers=leftover_containers,
                   limits=host_defaults(tuple(PODMAN_CLI)).limits)
