"""The pure parts of runtime=docker as a user: the rootless image base (mmdebstrap, fetched without root), which
limits rootless podman enforces, the container CLI's own variables kept out of a sandbox's environment, and the
download escape checks for Pythons without tarfile filters (Debian 12's 3.11.2)."""

from __future__ import annotations

import os
import tarfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from polar_gym.apptainer.offline import OfflineRecipe, ensure_base
from polar_gym.apptainer.rootless import MMDEBSTRAP_DIR, fetch_mmdebstrap, find_mmdebstrap, mmdebstrap_argv
from polar_gym.runtime.docker_commands import DockerCommands, cli_env, env_file_text
from polar_gym.runtime.docker_files import escape_check
from polar_gym.runtime.errors import SandboxError
from polar_gym.runtime.podman_host import ALL_LIMITS, enforced_limits


def test_the_rootless_base_is_mmdebstrap_in_a_user_namespace_straight_to_a_tar() -> None:
    recipe = OfflineRecipe(harnesses=("pi",), mirror="http://m.example/debian", suite="bookworm")
    argv = mmdebstrap_argv(recipe, Path("/t/rootfs.tar"), "/c/mmdebstrap")
    assert argv[:3] == ["/c/mmdebstrap", "--mode=unshare", "--variant=minbase"]
    assert argv[3] == "--include=" + ",".join(sorted(recipe.packages))
    assert argv[4:] == ["bookworm", "/t/rootfs.tar", "http://m.example/debian"]


def test_mmdebstrap_is_fetched_once_into_the_cache_without_root(tmp_path: Path) -> None:
    """apt-get download into a scratch folder, dpkg-deb -x; the program appears only when extracted whole."""
    seen: list[tuple[list[str], Path]] = []

    def runner(argv: Sequence[str], cwd: Path) -> int:
        seen.append((list(argv), cwd))
        if argv[0] == "sh":  # dpkg-deb -x DEB TREE: make the tree
            program = Path(argv[-1]) / "usr" / "bin" / "mmdebstrap"
            program.parent.mkdir(parents=True)
            program.write_text("#!/usr/bin/perl\n")
        return 0

    assert find_mmdebstrap(tmp_path, which=lambda _: None) is None
    program = fetch_mmdebstrap(tmp_path, runner)
    assert program == str(tmp_path / MMDEBSTRAP_DIR / "usr" / "bin" / "mmdebstrap")
    assert [argv[0] for argv, _ in seen] == ["apt-get", "sh"] and seen[0][0][1] == "download"
    assert seen[0][1] == Path(seen[1][0][-2])  # apt-get downloads where dpkg-deb reads
    assert find_mmdebstrap(tmp_path, which=lambda _: None) == program
    assert find_mmdebstrap(tmp_path, which=lambda _: "/usr/bin/mmdebstrap") == "/usr/bin/mmdebstrap"
    assert fetch_mmdebstrap(tmp_path, runner) == program and len(seen) == 2  # cached: nothing run again
    assert [p.name for p in tmp_path.iterdir()] == [MMDEBSTRAP_DIR]  # no scratch left


def test_a_failed_fetch_says_what_to_ask_for(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="apt-get install mmdebstrap"):
        fetch_mmdebstrap(tmp_path, lambda argv, cwd: 100)
    assert not (tmp_path / MMDEBSTRAP_DIR).exists()


def test_a_user_base_runs_mmdebstrap_then_imports_its_tar(tmp_path: Path) -> None:
    program = tmp_path / MMDEBSTRAP_DIR / "usr" / "bin" / "mmdebstrap"
    program.parent.mkdir(parents=True)
    program.write_text("")
    calls: list[list[str]] = []

    def runner(argv: Sequence[str]) -> int:
        calls.append(list(argv))
        return 0

    recipe = OfflineRecipe(harnesses=("pi",))
    # ``false`` as the engine: it knows no image, so the base is made
    assert ensure_base(recipe, ("false",), runner=runner, cache=tmp_path, rootless=True) == recipe.base_tag
    assert [c[:2] for c in calls] == [[str(program), "--mode=unshare"], ["false", "import"]]
    assert calls[1][-2:] == [calls[0][-2], recipe.base_tag]  # the tar mmdebstrap wrote is what is imported


def test_rootless_podman_on_cgroup_v1_enforces_no_limit() -> None:
    assert enforced_limits(False, "v1") == ALL_LIMITS
    assert enforced_limits(True, "v1", ["pids", "memory"]) == frozenset()
    assert enforced_limits(True, "v2", ["cpu", "pids"]) == {"max_processes"}
    assert enforced_limits(True, "v2", ["memory", "pids"]) == ALL_LIMITS


def test_the_cli_keeps_its_own_home_and_path_and_secrets_stay_off_the_command_line() -> None:
    """A sandbox's HOME=/polar/home in rootless podman's own environment made it look for its store there; a
    sandbox's values now travel in an env file only (issue 35), the CLI keeps the user's HOME and PATH."""
    env = {"HOME": "/polar/home", "POLAR_KEY": "secret", "PATH": "/opt/bin:/usr/bin"}
    own = cli_env()
    assert "POLAR_KEY" not in own
    assert own.get("HOME") == os.environ.get("HOME") and own.get("PATH") == os.environ.get("PATH")
    assert env_file_text(env) == "HOME=/polar/home\nPOLAR_KEY=secret\nPATH=/opt/bin:/usr/bin\n"
    argv = DockerCommands(cli=("podman",)).exec("c", ["true"], marker="/m", env_file="/private/env-1")
    assert "secret" not in " ".join(argv) and "HOME=/polar/home" not in argv


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, mode
    return info


def test_downloads_cannot_escape_without_tarfile_filters(tmp_path: Path) -> None:
    dest = str(tmp_path)
    kept = escape_check(_member("/top/file", mode=0o4755), dest)
    assert kept.name == "top/file" and kept.mode == 0o755  # no leading slash, no set-id bit
    assert escape_check(_member("top/link", tarfile.SYMTYPE, "file"), dest).linkname == "file"
    for bad in (_member("../out"), _member("top/l", tarfile.SYMTYPE, "/etc/passwd"),
                _member("top/l", tarfile.SYMTYPE, "../../x"), _member("top/h", tarfile.LNKTYPE, "../x")):
        with pytest.raises(SandboxError, match="outside"):
            escape_check(bad, dest)
