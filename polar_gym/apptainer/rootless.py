"""The harness images' Debian base without root: ``mmdebstrap --mode=unshare`` straight into a tarball.

Why mmdebstrap and not debootstrap in ``podman unshare``: debootstrap needs real root (it makes device nodes and
mounts /proc in its chroot), while mmdebstrap's ``unshare`` mode runs the whole bootstrap in a user namespace mapped
on the user's subordinate ids (``newuidmap`` and ``/etc/subuid``: what rootless podman needs anyway) and writes a
tarball whose members are owned by root, which ``podman import`` takes as it is. It is one Perl script that needs
only apt, perl and python3 (on every Debian host), so a user without it installed gets it with ``apt-get download
mmdebstrap`` and ``dpkg-deb -x`` into the cache: a path the user runs alone, with no admin. The package list and
mirror are the recipe's (the same as the root path's debootstrap), so the base's tag does not depend on the tool.

Pure: :func:`mmdebstrap_argv`, :func:`fetch_argvs`. I/O: :func:`find_mmdebstrap`, :func:`fetch_mmdebstrap`.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

__all__ = ["MMDEBSTRAP_DIR", "fetch_argvs", "fetch_mmdebstrap", "find_mmdebstrap", "mmdebstrap_argv"]

#: the cache folder (under $POLAR_CACHE) of the mmdebstrap a user fetched without root
MMDEBSTRAP_DIR = "mmdebstrap"

Runner = Callable[[Sequence[str]], int]


class _Recipe(Protocol):
    @property
    def suite(self) -> str: ...
    @property
    def mirror(self) -> str: ...
    @property
    def packages(self) -> tuple[str, ...]: ...


def mmdebstrap_argv(recipe: _Recipe, tar: Path, program: str = "mmdebstrap") -> list[str]:
    """The rootless bootstrap of the recipe's base into ``tar`` (``--variant=minbase``: debootstrap's own minbase,
    so both paths make the same base; apt's lists and caches are cleaned by mmdebstrap itself)."""
    return [program, "--mode=unshare", "--variant=minbase", f"--include={','.join(sorted(set(recipe.packages)))}",
            recipe.suite, str(tar), recipe.mirror]


def _cached_program(cache: Path) -> Path:
    return cache / MMDEBSTRAP_DIR / "usr" / "bin" / "mmdebstrap"


def find_mmdebstrap(cache: Path, which: Callable[[str], str | None] = shutil.which) -> str | None:
    """The system's mmdebstrap, else the one fetched into the cache, else None."""
    found = which("mmdebstrap")
    if found:
        return found
    cached = _cached_program(cache)
    return str(cached) if cached.is_file() else None


def fetch_argvs(download_dir: Path, extract_dir: Path) -> list[list[str]]:
    """``apt-get download`` (no root: it only reads the apt lists and writes the .deb into the working directory,
    ``download_dir``), then ``dpkg-deb -x`` of what it fetched."""
    return [["apt-get", "download", "-q", "mmdebstrap"],
            ["sh", "-c", 'exec dpkg-deb -x "$1"/mmdebstrap_*.deb "$2"', "polar-fetch", str(download_dir),
             str(extract_dir)]]


def fetch_mmdebstrap(cache: Path, runner: Callable[[Sequence[str], Path], int]) -> str:
    """Fetch Debian's mmdebstrap package into ``cache`` as this user (``runner(argv, cwd)``), unless it is there;
    returns the program. Raises ``RuntimeError`` when apt cannot fetch it (not a Debian host, no apt lists)."""
    program = _cached_program(cache)
    if program.is_file():
        return str(program)
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise RuntimeError("no mmdebstrap, and no apt-get/dpkg-deb to fetch it: ask an admin for "
                           "`apt-get install mmdebstrap uidmap` (or build the base as root with debootstrap)")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="polar-mmdebstrap-", dir=cache) as tmp:
        download, extract = Path(tmp) / "deb", Path(tmp) / "tree"
        download.mkdir()
        for argv in fetch_argvs(download, extract):
            if runner(argv, download) != 0:
                raise RuntimeError(f"fetching mmdebstrap failed: {' '.join(argv)} (ask an admin for "
                                   "`apt-get install mmdebstrap`)")
        final = cache / MMDEBSTRAP_DIR
        shutil.rmtree(final, ignore_errors=True)
        extract.rename(final)  # whole or not at all: the program appears only once extracted
    return str(program)
