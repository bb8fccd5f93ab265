"""Host-side limits of the local sandbox (as documented in :mod:`polar_gym.runtime.local`): per-sandbox pids and
memory cgroups, the disk-usage walk the watchdog uses, and handing the session directory to the sandbox's uid."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import stat
import uuid
from pathlib import Path

__all__ = ["SETID", "SandboxCgroup", "cgroup_name", "chown_tree", "copy_plain", "disk_usage"]

_CGROUP_PREFIX = "polar_gym-"


class SandboxCgroup:
    """The pids and memory cgroups of one sandbox (as root): every process of every exec is counted together."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    @classmethod
    def create(cls, name: str, max_pids: int | None, memory_bytes: int | None) -> tuple[SandboxCgroup, set[str]]:
        """The cgroups made and which limits they hold (``pids``, ``memory``); a limit with no writable
        hierarchy is left out (the helper's rlimits then stand in)."""
        made: list[Path] = []
        held: set[str] = set()
        wanted = {"pids": max_pids, "memory": memory_bytes}
        for controller, value in wanted.items():
            if not value:
                continue
            for base, v2 in _bases(controller):
                _sweep(base)
                path = base / name
                fresh = path not in made
                try:
                    if fresh:
                        path.mkdir()
                    _write_limit(path, controller, value, v2)
                except OSError:
                    if fresh:
                        with contextlib.suppress(OSError):
                            path.rmdir()
                    continue
                if fresh:
                    made.append(path)
                held.add(controller)
                break
        return cls(made), held

    @property
    def procs_files(self) -> tuple[str, ...]:
        return tuple(str(p / "cgroup.procs") for p in self.paths)

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer has ended in this sandbox so far (v2 ``memory.events``, v1
        ``memory.oom_control``): an exec whose count rose lost a process to the memory limit, which a harness that
        forks workers may survive and exit 0 from with its work undone."""
        total = 0
        for path in self.paths:
            for name in ("memory.events", "memory.oom_control"):
                with contextlib.suppress(OSError, ValueError):
                    for line in (path / name).read_text().splitlines():
                        key, _, value = line.partition(" ")
                        if key == "oom_kill":
                            total += int(value)
        return total

    def kill_all(self) -> None:
        for path in self.paths:
            with contextlib.suppress(OSError):
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)

    async def remove(self) -> None:
        for path in self.paths:
            for _ in range(100):
                self.kill_all()
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    await asyncio.sleep(0.02)
        self.paths = []


def cgroup_name() -> str:
    """``polar_gym-<our pid>-<random>``: the pid lets a later start remove what a process that died left behind."""
    return f"{_CGROUP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _sweep(base: Path) -> None:
    """Remove our cgroups under ``base`` whose process is gone (a gateway killed before stop()); empty ones only."""
    with contextlib.suppress(OSError):
        for path in base.glob(f"{_CGROUP_PREFIX}*"):
            pid = path.name.removeprefix(_CGROUP_PREFIX).split("-")[0]
            if not pid.isdigit() or Path(f"/proc/{pid}").exists():
                continue
            with contextlib.suppress(OSError):
                path.rmdir()


def _write_limit(path: Path, controller: str, value: int, v2: bool) -> None:
    if controller == "pids":
        (path / "pids.max").write_text(str(value))
    elif v2:
        (path / "memory.max").write_text(str(value))
        with contextlib.suppress(OSError):
            (path / "memory.swap.max").write_text("0")
    else:
        (path / "memory.limit_in_bytes").write_text(str(value))
        with contextlib.suppress(OSError):  # no swap accounting: the limit above already holds without swap
            (path / "memory.memsw.limit_in_bytes").write_text(str(value))


def _bases(controller: str) -> list[tuple[Path, bool]]:
    """Writable-looking parents for a new cgroup with ``controller``: (our v1 cgroup of it, False) or (our v2 cgroup
    where it is delegated, True)."""
    bases = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, rel = line.split(":", 2)
            if controller in controllers.split(","):
                bases.append((Path("/sys/fs/cgroup") / controller / rel.lstrip("/"), False))
            elif controllers == "":
                for mount in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
                    own = mount / rel.lstrip("/")
                    with contextlib.suppress(OSError):
                        if controller in (own / "cgroup.subtree_control").read_text().split():
                            bases.append((own, True))
    return bases


SETID = stat.S_ISUID | stat.S_ISGID


def disk_usage(root: Path, *, clear_setid: bool = False) -> int:
    """Bytes allocated under ``root`` (st_blocks, each inode once). With ``clear_setid`` the same walk takes the
    setuid / setgid bits off every regular file: a sandbox may set them on its own files, which would then run as
    their owner for anyone on the host who reaches them. The walk goes by directory fds and never follows a symlink
    (os.fwalk, *at calls with no-follow), so a sandbox that swaps a directory for a link to a host directory while
    we walk cannot make us count, let alone chmod, anything outside ``root``."""
    total, seen = 0, set()
    for _, dirnames, filenames, dirfd in os.fwalk(str(root), follow_symlinks=False):
        for name in dirnames + filenames:
            try:
                st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
            if clear_setid and stat.S_ISREG(st.st_mode) and st.st_mode & SETID:
                # fchmodat(AT_SYMLINK_NOFOLLOW): a file swapped for a link since the stat is refused (ValueError)
                with contextlib.suppress(OSError, ValueError, NotImplementedError):
                    os.chmod(name, stat.S_IMODE(st.st_mode) & ~SETID, dir_fd=dirfd, follow_symlinks=False)
    return total


def chown_tree(path: Path, uid: int, gid: int) -> None:
    """chown ``path`` and, for a directory, everything under it (symlinks themselves, never their targets; by
    directory fds, so a directory swapped for a link to the host meanwhile never leads the walk out of ``path``)."""
    os.chown(path, uid, gid, follow_symlinks=False)
    if path.is_dir() and not path.is_symlink():
        for _, dirnames, filenames, dirfd in os.fwalk(path, follow_symlinks=False):
            for name in dirnames + filenames:
                os.chown(name, uid, gid, dir_fd=dirfd, follow_symlinks=False)


def copy_plain(src: str, dst: str, *, follow_symlinks: bool = True) -> str:
    """A ``shutil`` copy function for files leaving a sandbox: content and permission bits, never setuid / setgid
    (copied out by a root gateway, a planted setuid file would become a root-owned one)."""
    shutil.copyfile(src, dst, follow_symlinks=follow_symlinks)
    os.chmod(dst, stat.S_IMODE(os.stat(src, follow_symlinks=follow_symlinks).st_mode) & ~SETID & 0o777)
    return dst
