"""Files into and out of the local sandbox's writable areas, as its host-side owner must move them: nothing the
sandbox planted (a symlink in place of a file or directory) is followed, and nothing leaves with a setuid bit."""

from __future__ import annotations

import os
import posixpath
import shutil
from pathlib import Path

from polar_gym.runtime.errors import SandboxError
from polar_gym.runtime.limits import chown_tree, copy_plain

__all__ = ["confine", "copy_in", "copy_out"]


def confine(areas: list[tuple[str, str]], inside: str, workdir: str) -> Path:
    """Map a path inside the sandbox to its host path in a writable area, refusing anything that escapes one
    (``..``, absolute paths elsewhere, symlinks pointing out of the area)."""
    path = posixpath.normpath(posixpath.join(workdir, inside))
    for prefix, host in areas:
        if path == prefix or path.startswith(prefix + "/"):
            rel = posixpath.relpath(path, prefix)
            host_root = Path(host).resolve()
            candidate = (host_root / rel).resolve() if rel != "." else host_root
            if candidate != host_root and host_root not in candidate.parents:
                raise SandboxError(f"{inside!r} leaves the sandbox's writable area {prefix}")
            return candidate
    raise SandboxError(f"{inside!r} is not in a writable area of the sandbox "
                       f"({', '.join(prefix for prefix, _ in areas)})")


def copy_in(data: bytes | Path, target: Path, owner: tuple[int, int] | None = None) -> None:
    """Copy into the session directory; with ``owner`` (the sandbox's host uid, gid) what was made is theirs."""
    top = target
    while not top.parent.exists():
        top = top.parent
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        target.write_bytes(data)
    elif data.is_dir():
        _copy_dir_in(data, target)
    else:
        shutil.copyfile(data, target)
    if owner is not None:
        chown_tree(top, *owner)


def _copy_dir_in(source: Path, target: Path) -> None:
    """Merge ``source`` into ``target`` without following anything the sandbox put there: a symlink (or any other
    non-file) in the way of a file or directory is replaced, never written through (as root, writing through a link
    the sandbox planted would write the host). No sandbox process runs between execs, so nothing can race this."""
    for dirpath, dirnames, filenames in os.walk(source):
        rel = os.path.relpath(dirpath, source)
        here = target if rel == "." else target / rel
        if here.is_symlink() or (here.exists() and not here.is_dir()):
            here.unlink()
        here.mkdir(exist_ok=True)
        links = [n for n in dirnames if os.path.islink(os.path.join(dirpath, n))]
        dirnames[:] = [n for n in dirnames if n not in links]
        for name in filenames + links:
            src, dst = os.path.join(dirpath, name), here / name
            if dst.is_symlink() or dst.is_file():
                dst.unlink()
            elif dst.exists():
                shutil.rmtree(dst)
            if os.path.islink(src):
                os.symlink(os.readlink(src), dst)
            else:
                shutil.copyfile(src, dst)
                shutil.copymode(src, dst)


def copy_out(source: Path, dst: Path) -> None:
    if not source.exists():
        raise FileNotFoundError(f"nothing at {source}")
    dst.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, dst, symlinks=True, dirs_exist_ok=True, copy_function=copy_plain)
    else:
        copy_plain(str(source), str(dst))
