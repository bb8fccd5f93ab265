"""Pure command-line and environment builders for the local (bubblewrap) sandbox, golden-tested.

The root is bwrap's own tmpfs, remounted read-only at the end, with every top-level entry of the chosen root (the
host's ``/`` or an unpacked image directory) bound read-only onto it and its symlinks recreated. Binding entry by
entry rather than ``--ro-bind / /`` lets us create mount points that do not exist in a read-only root (``/polar``,
the workdir) without touching the host or the image.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from polar_gym.runtime.base import RELAY_PATH, SESSION_MOUNT

__all__ = [
    "DEFAULT_PATH",
    "HOME",
    "RootEntry",
    "SandboxLayout",
    "WorkdirError",
    "bwrap_argv",
    "cgroup_wrap",
    "list_root",
    "plan_workdir",
    "sandbox_env",
]

#: HOME inside the local sandbox: in the session directory, so it is writable and survives between execs
HOME = f"{SESSION_MOUNT}/home"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: top-level names the sandbox provides itself instead of taking them from the root
_OWN = frozenset({"proc", "dev", "sys", "tmp", SESSION_MOUNT.strip("/")})


class WorkdirError(ValueError):
    pass


@dataclass(frozen=True)
class RootEntry:
    name: str
    kind: Literal["dir", "file", "symlink"]
    target: str = ""  # for symlinks


def list_root(root: Path) -> tuple[RootEntry, ...]:
    """Top-level entries of ``root`` that the sandbox takes over (one directory listing)."""
    entries = []
    with os.scandir(root) as it:
        for e in it:
            if e.name in _OWN:
                continue
            if e.is_symlink():
                entries.append(RootEntry(e.name, "symlink", os.readlink(e.path)))
            elif e.is_dir():
                entries.append(RootEntry(e.name, "dir"))
            else:
                entries.append(RootEntry(e.name, "file"))
    return tuple(sorted(entries, key=lambda r: r.name))


@dataclass(frozen=True)
class SandboxLayout:
    """Everything a bwrap invocation needs; one per sandbox, shared by its execs."""

    root: str  # "/" or an unpacked image directory
    entries: tuple[RootEntry, ...]
    session_dir: str
    workdir: str  # inside
    #: host folder bound at ``workdir``; None when the workdir already lies in a writable mount (/polar, /tmp)
    workdir_host: str | None
    network: Literal["none", "host", "gateway"]
    relay: str | None = None  # host path of the helper, bound read-only at RELAY_PATH
    hostname: str = "polar"
    extra_ro: tuple[tuple[str, str], ...] = field(default=())  # (host, inside) read-only binds from options

    @property
    def tmp_host(self) -> str:
        return posixpath.join(self.session_dir, "tmp")

    def writable(self) -> list[tuple[str, str]]:
        """(inside prefix, host folder) pairs for the writable areas, longest prefix first."""
        areas = [(SESSION_MOUNT, self.session_dir), ("/tmp", self.tmp_host)]
        if self.workdir_host is not None:
            areas.append((self.workdir, self.workdir_host))
        return sorted(areas, key=lambda a: len(a[0]), reverse=True)


def plan_workdir(workdir: str, entries: Sequence[RootEntry], root: Path, session_dir: str) -> str | None:
    """The host folder to bind at ``workdir``, or None when the workdir lies in a writable mount already.

    The workdir must be creatable on the sandbox's own root (its first component is not taken from the root) or
    already exist as a directory in the root; anything else would need writing into the read-only root.
    """
    if not posixpath.isabs(workdir):
        raise WorkdirError(f"workdir must be absolute, got {workdir!r}")
    workdir = posixpath.normpath(workdir)
    for prefix in (SESSION_MOUNT, "/tmp"):
        if workdir == prefix or workdir.startswith(prefix + "/"):
            return None
    if workdir == "/":
        raise WorkdirError("workdir cannot be /")
    first = workdir.strip("/").split("/")[0]
    taken = {e.name for e in entries}
    if first in taken and not (root / workdir.lstrip("/")).is_dir():
        raise WorkdirError(f"workdir {workdir!r} is under /{first}, a read-only part of the root where it does "
                           f"not exist; use a path outside it (such as /workspace) or one under {SESSION_MOUNT}")
    return posixpath.join(session_dir, "workspace")


def bwrap_argv(layout: SandboxLayout, command: Sequence[str], *, cwd: str, status_fd: int | None = None,
               bwrap: str = "bwrap") -> list[str]:
    """The full bwrap command line for one exec."""
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if layout.network != "host":
        argv.append("--unshare-net")
    argv += ["--die-with-parent", "--new-session", "--hostname", layout.hostname]
    for e in layout.entries:
        inside = "/" + e.name
        if e.kind == "symlink":
            argv += ["--symlink", e.target, inside]
        else:
            argv += ["--ro-bind", posixpath.join(layout.root, e.name), inside]
    argv += ["--dev", "/dev", "--proc", "/proc", "--ro-bind-try", "/sys", "/sys"]
    argv += ["--bind", layout.tmp_host, "/tmp", "--bind", layout.session_dir, SESSION_MOUNT]
    if layout.workdir_host is not None:
        argv += ["--bind", layout.workdir_host, layout.workdir]
    if layout.relay is not None:
        argv += ["--ro-bind", layout.relay, RELAY_PATH]
    for host, inside in layout.extra_ro:
        argv += ["--ro-bind", host, inside]
    argv += ["--remount-ro", "/", "--chdir", cwd]
    if status_fd is not None:
        argv += ["--json-status-fd", str(status_fd)]
    return [*argv, "--", *command]


def cgroup_wrap(procs_file: str, argv: Sequence[str]) -> list[str]:
    """Prefix that moves the launcher into a cgroup before it becomes bwrap, so every sandbox process is counted."""
    return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', procs_file, *argv]


def sandbox_env(spec_env: Mapping[str, str], exec_env: Mapping[str, str] | None, *, loopback_ip: str | None = None,
                gateway_url: str | None = None) -> dict[str, str]:
    """The command's whole environment: nothing is inherited from the host process (no secrets leak in)."""
    env = {"PATH": DEFAULT_PATH, "HOME": HOME, "LANG": "C.UTF-8", "TERM": "dumb", "POLAR_SESSION_DIR": SESSION_MOUNT}
    if loopback_ip is not None:
        env["POLAR_LOOPBACK_IP"] = loopback_ip
    if gateway_url is not None:
        env["POLAR_GATEWAY_URL"] = gateway_url
    env.update(spec_env)
    env.update(exec_env or {})
    return env
