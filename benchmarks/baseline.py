"""The baseline a benchmark compares against in the same run: an earlier revision of the project, checked out as a
git worktree whose servers run as their own processes (``python -m`` from the worktree, ``PYTHONPATH`` on it)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the main commit before results were packed and the server's event loop stopped parsing them (issue 40)
BASELINE_REV = "22cdc21"


@contextlib.contextmanager
def baseline_tree(rev: str, where: Path) -> Iterator[Path]:
    """``rev`` checked out at ``where`` (a detached worktree of this clone) for the block, removed after."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(where), rev], check=True)
    try:
        yield where
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)], check=False)
