"""The tier as an unprivileged user: a real login user (``polar-ci``, created here when missing) gets its own clone
of this repository and, as that user with a login-like environment (no root, no inherited variables), runs
``bash scripts/setup.sh`` into its own ``~/.cache/polar_gym`` (cold the first time: the venv from PyPI and the
harness CLIs from npm, several minutes; warm afterwards) and then the README's main job, ``python -m
polar_gym.launch`` on its embedded default: the pi CLI on the demo tasks in the local bubblewrap sandbox, through
unprivileged user namespaces. Also the local runtime's conformance suite, as that user.

Needs root to create the user (skips otherwise). The user and its cache stay between runs (that is what makes the
second run warm); its clone is made anew each time."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

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


def as_user(command: str, *, cwd: Path, timeout: float, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    """``bash -c command`` as the test user with a login-like environment built from nothing (what
    ``su - polar-ci`` gives), so nothing of root's environment (PATH, pip settings, POLAR_CACHE) leaks in."""
    user = pwd.getpwnam(USER)
    login = {"HOME": user.pw_dir, "USER": USER, "LOGNAME": USER, "SHELL": "/bin/bash", "PATH": _LOGIN_PATH,
             "LANG": "C.UTF-8", "COLUMNS": "160", **(env or {})}
    runuser = shutil.which("runuser")
    assert runuser is not None
    argv = [runuser, "-u", USER, "--", "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in login.items()),
            "bash", "-c", command]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={"PATH": _LOGIN_PATH})


@pytest.fixture(scope="module")
def user_clone() -> Iterator[UserClone]:
    """A fresh clone owned by the test user, set up by that user (the set-up's wall time measured)."""
    _require_root()
    user = _ensure_user()
    home = Path(user.pw_dir)
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


def test_setup_and_the_main_job_as_an_unprivileged_user(user_clone: UserClone) -> None:
    out = user_clone.setup_output
    # no root step ran; the system parts were reported with what each gives
    assert f"running as {USER} (not root): no apt-get" in out, out[-3000:]
    assert "apt-get update" not in out and "bubblewrap + userns" in out
    # every cache is the user's own
    cache = user_clone.home / ".cache" / "polar_gym"
    for pattern in ("venv-*", "harness-npm-*", "relay-*/relay", "tokenizer-*"):
        assert list(cache.glob(pattern)), f"{pattern} is not under {cache}"
    assert (user_clone.clone / ".venv" / ".polar_base").read_text().startswith(str(cache))

    run_dir = user_clone.home / "runs" / "main"
    shutil.rmtree(run_dir, ignore_errors=True)
    run = as_user(f".venv/bin/python -m polar_gym.launch launcher.progress=false out_dir={run_dir}",
                  cwd=user_clone.clone, timeout=1200)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-4000:])
    results = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    assert results, "the main job ran no session"
    for r in results:
        assert r["status"] == "COMPLETED", (r["session_id"], r.get("reason"))
        assert r["evaluation"]["reward"] == 1.0, (r["session_id"], r["evaluation"])
    assert run_dir.stat().st_uid == pwd.getpwnam(USER).pw_uid


def test_the_local_sandbox_conformance_suite_as_an_unprivileged_user(user_clone: UserClone) -> None:
    """tests/runtime's conformance suite on ``local``, run by the user in its clone: the sandbox's guarantees hold
    when bwrap gets its namespaces as an unprivileged user (no root anywhere)."""
    proc = as_user(".venv/bin/python -m pytest -q -p no:cacheprovider -x -m 'not slow' "
                   "tests/runtime/test_conformance.py -k local", cwd=user_clone.clone, timeout=1200)
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout and " failed" not in proc.stdout, report
