"""``python -m polar_gym.env conformance``: NeMo Gym's token-capture conformance suite against polar_gym's journal
transport, run in Gym's own interpreter (the Python 3.13 venv ``python -m polar_gym.assets nemo_gym`` builds) by
:mod:`polar_gym.env.nemo_conformance`. Its output (one ``passed <check>`` line per check, then the verdict) and its
exit status (0 only if every check passed) are the command's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import polar_gym

__all__ = ["conformance_argv", "conformance_command", "gym_pythonpath"]


def gym_pythonpath(existing: str | None = None) -> str:
    """PYTHONPATH for Gym's interpreter: the directory holding the ``polar_gym`` package (a clone's root or a
    site-packages), ahead of anything already set."""
    root = str(Path(polar_gym.__file__).resolve().parents[1])
    return os.pathsep.join([root, *([existing] if existing else [])])


def conformance_argv(gym_python: Path, *, transport: str | None = None, root: str | None = None) -> list[str]:
    argv = [str(gym_python), "-m", "polar_gym.env.nemo_conformance"]
    if transport:
        argv += ["--transport", transport]
    if root:
        argv += ["--root", root]
    return argv


def conformance_command(gym_python: Path, *, transport: str | None = None, root: str | None = None) -> int:
    """Run the suite (its output goes to ours); its exit status. A missing interpreter says how to build it."""
    if not gym_python.exists():
        raise FileNotFoundError(f"no NeMo Gym interpreter at {gym_python}: build it with "
                                "`python -m polar_gym.assets nemo_gym` (or `bash scripts/setup.sh --engine`)")
    env = {**os.environ, "PYTHONPATH": gym_pythonpath(os.environ.get("PYTHONPATH"))}
    env.pop("VIRTUAL_ENV", None)
    return subprocess.run(conformance_argv(gym_python, transport=transport, root=root), env=env,
                          check=False).returncode
