"""Run a test module again as an unprivileged user (uid 65534) under Debian's /usr/bin/python3.11.

The project's venv lives under /root (0700), which that user cannot reach, and so may the checkout (a clone in a
0700 temporary folder): a private mount namespace binds a directory of ours (the venv's site-packages, or the whole
cache) and the checkout at places it can reach, read-only, for that run only; nothing is copied and the host's
mounts are untouched. Paths under the checkout (the module, ``pythonpath`` entries) are mapped to its bound copy.
The outer test skips inside the inner run (``INNER`` is set there).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from polar_gym.runtime.relay import relay_program

__all__ = ["INNER", "NOBODY", "require_outer_root_run", "rerun_with_the_local_runtime", "run_as_nobody"]

INNER = "POLAR_UNPRIVILEGED_RUN"
NOBODY = 65534
_PYTHON = "/usr/bin/python3.11"
ROOT = Path(__file__).resolve().parents[1]


def require_outer_root_run() -> None:
    """Skip unless this is the outer run, as root, with what the inner run needs (call it first)."""
    if os.environ.get(INNER):
        pytest.skip("this is the unprivileged run")
    if os.geteuid() != 0:
        pytest.skip("already running as an unprivileged user")
    for tool in ("setpriv", "unshare", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} (util-linux) is missing")
    if not os.path.exists(_PYTHON):
        pytest.skip("Debian's python3.11 is missing (apt-get install python3.11)")


def run_as_nobody(module: Path, work: Path, *, bind: tuple[Path, Path], pythonpath: list[Path],
                  env: dict[str, str] | None = None, markers: tuple[str, ...] = (), timeout: float = 600,
                  min_passed: int = 1) -> str:
    """Run ``module`` with pytest as uid 65534, ``bind = (source, target)`` and the checkout (at ``work/src``)
    read-only for that run, ``work`` (a fresh directory under /tmp) as its root and HOME; fail unless it passed at
    least ``min_passed`` tests and failed none. Returns pytest's output."""
    require_outer_root_run()
    work.chmod(0o755)
    home = work / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    marker_lines = "".join(f"    {m}: {m}\n" for m in markers)
    (work / "pytest.ini").write_text("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
                                     + (f"markers =\n{marker_lines}" if markers else "")
                                     + "filterwarnings =\n    error\n    ignore::DeprecationWarning\n"
                                     "    ignore::PendingDeprecationWarning\n")
    source, target = bind
    target.mkdir(parents=True, exist_ok=True)
    checkout = work / "src"
    checkout.mkdir()

    def reachable(path: Path) -> Path:
        return checkout / path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path

    full_env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8",
                "PYTHONPATH": ":".join(str(reachable(p)) for p in pythonpath), INNER: "1", **(env or {})}
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c",
            'mount --bind "$1" "$2" && mount -o remount,bind,ro "$2" && '
            'mount --bind "$3" "$4" && mount -o remount,bind,ro "$4" && shift 4 && '
            'exec setpriv --reuid 65534 --regid 65534 --clear-groups "$@"',
            "polar-unprivileged", str(source), str(target), str(ROOT), str(checkout),
            _PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "--noconftest", "-c", str(work / "pytest.ini"), "--rootdir", str(work),
            "--basetemp", str(home / "pt"), "-rs", str(reachable(module))]
    proc = subprocess.run(argv, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=str(work))
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed is not None and int(passed.group(1)) >= min_passed, report
    assert not re.search(r"\d+ failed", proc.stdout), report
    return proc.stdout


def rerun_with_the_local_runtime(module: Path, *, min_passed: int, timeout: float) -> str:
    """``module`` again as uid 65534 with what the local runtime needs: the venv's site-packages bound where that
    user can reach them and the relay helper copied into a cache of its own. Returns pytest's output."""
    require_outer_root_run()
    site = Path(next(p for p in sys.path if p.endswith("site-packages") and Path(p, "pydantic").is_dir()))
    work = Path(tempfile.mkdtemp(prefix="polar-unpriv-", dir="/tmp"))
    try:
        relay = Path(relay_program())
        cache = work / "cache" / relay.parent.name
        cache.mkdir(parents=True)
        shutil.copy(relay, cache / relay.name)
        for sub in [work / "cache", *(work / "cache").rglob("*")]:
            os.chown(sub, NOBODY, NOBODY)
        return run_as_nobody(module, work, bind=(site, work / "site"), pythonpath=[work / "site", ROOT],
                             env={"POLAR_CACHE": str(work / "cache")}, min_passed=min_passed, timeout=timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
