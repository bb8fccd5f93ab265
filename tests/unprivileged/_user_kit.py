"""The unprivileged-user tier's kit: a real login user (``polar-ci``, created when missing, with the subordinate id
range useradd gives for rootless podman) gets its own clone of this repository and, as that user with a login-like
environment (no root, no inherited variables), runs ``bash scripts/setup.sh`` into its own ``~/.cache/polar_gym``
(cold the first time: the venv from PyPI, the harness CLIs from npm, the harness image built rootless, several
minutes; warm afterwards). ``user_clone`` is session-scoped: the tier's modules share one clone and one set-up.

Needs root to create the user (skips otherwise). The user and its cache (and podman store) stay between runs (that
is what makes the second run warm); its clone is made anew each time."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["ROOT", "USER", "UserClone", "as_user", "readme_run", "readme_user_block", "user_clone", "user_env"]

ROOT = Path(__file__).resolve().parents[2]
USER = "polar-ci"
_LOGIN_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class UserClone:
    home: Path
    clone: Path
    setup_seconds: float
    setup_output: str


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("creating the test user needs root (this tier runs as root in CI)")
    for tool in ("useradd", "runuser", "git"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is missing")


def _ensure_user() -> pwd.struct_passwd:
    """The test user (idempotent: created once, kept with its cache)."""
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", USER], check=True, timeout=60)
        return pwd.getpwnam(USER)


def user_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The login-like environment of the test user (what ``su - polar-ci`` gives), plus ``env``."""
    user = pwd.getpwnam(USER)
    return {"HOME": user.pw_dir, "USER": USER, "LOGNAME": USER, "SHELL": "/bin/bash", "PATH": _LOGIN_PATH,
            "LANG": "C.UTF-8", "COLUMNS": "160", **(env or {})}


def as_user(command: str, *, cwd: Path, timeout: float, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    """``bash -c command`` as the test user with a login-like environment built from nothing, so nothing of root's
    environment (PATH, pip settings, POLAR_CACHE) leaks in."""
    login = user_env(env)
    runuser = shutil.which("runuser")
    assert runuser is not None
    argv = [runuser, "-u", USER, "--", "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in login.items()),
            "bash", "-c", command]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={"PATH": _LOGIN_PATH})


def _fresh_podman_store(user: pwd.struct_passwd) -> None:
    """A store podman 4.3 made on vfs (its rootless default here) is reset, as a new user's would be empty, so
    set-up's switch to overlay is what this tier tests; a store set-up already configured stays (warm)."""
    if shutil.which("podman") is None or (Path(user.pw_dir) / ".config" / "containers" / "storage.conf").exists():
        return
    driver = as_user("podman info --format '{{.Store.GraphDriverName}}'", cwd=Path(user.pw_dir), timeout=120)
    if driver.stdout.strip() == "vfs":
        as_user("podman system reset -f", cwd=Path(user.pw_dir), timeout=300)


@pytest.fixture(scope="session")
def user_clone() -> Iterator[UserClone]:
    """A fresh clone owned by the test user, set up by that user (the set-up's wall time measured)."""
    _require_root()
    user = _ensure_user()
    home = Path(user.pw_dir)
    _fresh_podman_store(user)
    clone = home / "polar_gym"
    shutil.rmtree(clone, ignore_errors=True)  # only the clone: the user's cache under ~/.cache stays warm
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)], check=True, timeout=300)
    subprocess.run(["chown", "-R", f"{user.pw_uid}:{user.pw_gid}", str(clone)], check=True, timeout=120)
    start = time.monotonic()
    setup = as_user("bash scripts/setup.sh", cwd=clone, timeout=2400)
    seconds = time.monotonic() - start
    output = setup.stdout + setup.stderr
    assert setup.returncode == 0, output[-6000:]
    print(f"\n[unprivileged] set-up as {USER}: {seconds:.1f} s wall")
    yield UserClone(home, clone, seconds, output)
    _stop_podman_pause_process(user)


def _stop_podman_pause_process(user: pwd.struct_passwd) -> None:
    """Rootless podman (set-up builds the docker backend's test image when the user has a subuid range, which
    useradd gives) leaves its per-user pause process running; stop it, by the pid podman wrote, if it is the user's."""
    pid_file = Path(f"/tmp/podman-run-{user.pw_uid}/libpod/tmp/pause.pid")
    try:
        pid = int(pid_file.read_text().strip())
        if os.stat(f"/proc/{pid}").st_uid == user.pw_uid:
            os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        pass




def readme_user_block() -> list[str]:
    """The command lines of the README's "Without root" walkthrough, as written there."""
    section = (ROOT / "README.md").read_text().split("### Without root", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "the README's Without root section has no bash code block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def readme_run(user_clone: UserClone, line: str, *, timeout: float = 1200) -> Path:
    """Run one README line verbatim as the user in its clone; the run folder it made (outputs/DATE/TIME, the
    newest with results.jsonl). Fails with the output's end when the line does not exit 0."""
    outputs = user_clone.clone / "outputs"
    before = {p.parent for p in outputs.glob("*/*/results.jsonl")}
    proc = as_user(line, cwd=user_clone.clone, timeout=timeout)
    assert proc.returncode == 0, (line, proc.stdout[-3000:], proc.stderr[-4000:])
    made = sorted({p.parent for p in outputs.glob("*/*/results.jsonl")} - before, key=lambda p: p.stat().st_mtime)
    assert made, f"{line!r} wrote no run folder under {outputs}"
    return made[-1]
