"""The docker backend's own host defaults (issue 16): which CLI, and the --ulimit run options podman needs, found
by probing instead of known by a test helper. Pure parts directly; the probe on the real podman when it is here."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess

import pytest

from polar_gym.runtime.docker import DockerRuntime
from polar_gym.runtime.errors import SandboxStartError
from polar_gym.runtime.podman_host import (
    HostDefaults,
    default_cli,
    host_defaults,
    probe_argv,
    probe_verdict,
    ulimit_candidates,
)
from polar_gym.runtime.testimage import TEST_IMAGE
from polar_gym.schema import RuntimeSpec
from tests.runtime._docker import PODMAN_CLI, require_podman


def test_default_cli_prefers_podman_with_runc_then_docker() -> None:
    assert default_cli(lambda n: "/x" if n in ("docker", "podman") else None) == ("podman",)
    assert default_cli(lambda n: "/x" if n == "docker" else None) == ("docker",)
    assert default_cli(lambda n: "/x" if n in ("podman", "runc") else None) == ("podman", "--runtime", "runc")
    assert default_cli(lambda n: "/x" if n == "podman" else None) == ("podman",)
    assert default_cli(lambda n: None) == ("docker",)


def test_ulimit_candidates_try_none_then_the_hosts_limits_then_safe_ones() -> None:
    cands = ulimit_candidates(20000, 96365)
    assert cands[0] == ()
    assert cands[1] == ("--ulimit", "nofile=20000:20000", "--ulimit", "nproc=20000:20000")
    assert cands[2] == ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
    assert ulimit_candidates(10**9, 10**9)[1][1] == "nofile=1048576:1048576"
    assert len(ulimit_candidates(1024, 1024)) == 2  # no duplicate candidate


def test_probe_verdicts() -> None:
    rlimit = "runc create failed: error setting rlimits for ready process: error setting rlimit type 7"
    assert probe_verdict(126, rlimit) is False
    assert probe_verdict(127, 'exec: "/polar-probe-absent": stat /polar-probe-absent: no such file') is True
    assert probe_verdict(125, "Error: cannot connect to Podman") is None
    argv = probe_argv(["podman"], ["--ulimit", "nofile=1:1"], "/tmp/empty")
    assert argv == ["podman", "run", "--rm", "--network", "none", "--ulimit", "nofile=1:1", "--rootfs", "/tmp/empty",
                    "/polar-probe-absent"]


def test_docker_gets_no_probe_and_explicit_run_args_win(tmp_path, monkeypatch) -> None:
    assert host_defaults(("docker-not-podman",)) == HostDefaults(("docker-not-podman",))
    monkeypatch.delenv("POLAR_DOCKER_RUN_ARGS", raising=False)
    given = DockerRuntime(RuntimeSpec(backend="docker", image="x"), tmp_path, options={"cli": ["podman"],
                                                                                       "run_args": ["--x"]})
    assert given.commands.run_args == ("--x",) and given._host_run_args
    limited = DockerRuntime(RuntimeSpec(backend="docker", image="x"), tmp_path,
                            options={"run_args": "--ulimit nofile=9:9"})
    assert not limited._host_run_args


@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")
def test_the_probe_finds_run_options_that_start_a_real_container() -> None:
    """On this host podman's default limits fail; the probed ones start the busybox test image."""
    require_podman()
    found = host_defaults(tuple(PODMAN_CLI))
    assert found.cli == tuple(PODMAN_CLI) and found.note == "probed"
    done = subprocess.run([*PODMAN_CLI, "run", "--rm", "--network", "none", *found.run_args, TEST_IMAGE, "true"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr



def test_a_missing_harness_image_says_how_to_build_it(tmp_path) -> None:
    """Through the backend: the default image's family is never pulled, so its absence names the build command."""
    require_podman()
    spec = RuntimeSpec(backend="docker", image="localhost/polar-gym/absent:0", network="none")
    (tmp_path / "s").mkdir()
    rt = DockerRuntime(spec, tmp_path / "s", options={"cli": PODMAN_CLI})
    with pytest.raises(SandboxStartError, match=re.escape("python -m polar_gym.apptainer build --offline")):
        asyncio.run(rt.start())
    assert rt.commands.run_args[-2:] == ("--pull", "never")  # no pull retries against a registry that is not there
