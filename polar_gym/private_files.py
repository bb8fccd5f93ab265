"""Files only their owner may read: tokens, server info, resolved configs that may hold a key, and every run file
that holds prompts or completions (trajectories, results, the store, capture journals, reports): 0600 files, 0700
directories. A user who shares a run shares it on purpose."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import IO

__all__ = ["new_private_file", "open_private", "private_dir", "write_all", "write_secret"]


def private_dir(path: Path) -> Path:
    """``path`` (and its missing parents) as a directory; the ones made here are mode 700 (not a folder that was
    there already: ``out_dir=.`` must not close the user's working directory)."""
    missing = []
    for p in (path, *path.parents):
        if p.exists():
            break
        missing.append(p)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    for made in missing:
        os.chmod(made, 0o700)  # mkdir's mode goes through the umask, and parents=True ignores it
    return path


def open_private(path: Path, mode: str = "w") -> IO[str]:
    """``path`` opened for writing text (``w`` or ``a``), mode 600 also when it existed with a wider one."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode == "a" else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, mode, encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise


def new_private_file(directory: Path, data: bytes, prefix: str = "") -> Path:
    """A new file (a fresh name, O_EXCL, mode 600) in ``directory`` holding ``data``; the caller removes it. For
    what a host tool reads once, such as a sandbox's env file."""
    fd, name = tempfile.mkstemp(prefix=prefix, dir=directory)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)
    return Path(name)


def write_all(fd: int, data: bytes) -> None:
    """Write the whole of ``data`` to ``fd`` (``os.write`` may take less than it is given)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_secret(path: Path, text: str | bytes) -> Path:
    """Write ``text`` to ``path`` readable by its owner only: mode 600 also when the file existed with a wider one,
    and atomically (a reader polling for the file never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file left behind by a crash
        f.write(text)
    os.replace(tmp, path)
    return path
