"""Pure command-line and environment builders for the local (bubblewrap) sandbox, golden-tested.

The root is bwrap's own tmpfs, remounted read-only at the end. On the host's ``/`` only an allow-list of system
directories is bound onto it read-only (:data:`SYSTEM_DIRS`: ``/usr``, ``/bin``, ``/sbin``, ``/lib*``, ``/etc``;
their symlinks recreated), with secrets under ``/etc`` masked by an empty file or an empty read-only tmpfs
(:func:`secret_masks`). Nothing else of the host is there: no ``/root``, ``/home``, ``/var``, ``/run``, ``/opt``,
host ``/tmp``, project checkout or other session. With an unpacked image directory every top-level entry of the
image is bound instead. Binding entry by entry rather than ``--ro-bind / /`` lets us create mount points that do
not exist in a read-only root (``/polar``, the workdir) without touching the host or the image.

Bind sources that are not system directories (the session directory and its ``tmp`` and workdir, the helper's
directory, the image, read-only extras) go through the host-side launcher (``relay.c``, ``-S``/``-B``): it binds
each one, opened with ``O_NOFOLLOW``, at ``<stage>/<i>`` in a private mount namespace, so that (1) bwrap can reach
them after dropping to an unprivileged uid that could not traverse their parents, and (2) a symlink a sandbox puts
in place of its own ``tmp`` or workdir is refused rather than followed to a host path.
"""

from __future__ import annotations

import functools
import os
import posixpath
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from polar_gym.private_files import write_all
from polar_gym.runtime.base import RELAY_PATH, SESSION_MOUNT

__all__ = [
    "DEFAULT_PATH",
    "HOME",
    "SECRETS",
    "SHM_BYTES",
    "SYSTEM_DIRS",
    "Launch",
    "Mask",
    "RootEntry",
    "SandboxLayout",
    "WorkdirError",
    "bwrap_argv",
    "cgroup_wrap",
    "env_args",
    "env_args_fd",
    "launcher_argv",
    "list_root",
    "plan_links",
    "plan_workdir",
    "sandbox_env",
    "secret_masks",
]

#: HOME inside the local sandbox: in the session directory, so it is writable and survives between execs
HOME = f"{SESSION_MOUNT}/home"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: top-level names the sandbox provides itself instead of taking them from the root
_OWN = frozenset({"proc", "dev", "sys", "tmp", SESSION_MOUNT.strip("/")})
#: the host directories a sandbox on the host's root sees (read-only); everything else stays out
SYSTEM_DIRS = frozenset({"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc"})
#: always masked when present, whatever their mode; any other entry of /etc that "others" cannot read is masked too
SECRETS = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/sudoers", "/etc/sudoers.d",
           "/etc/ssl/private", "/etc/security/opasswd", "/etc/munge", "/etc/krb5.keytab", "/etc/ssh/ssh_host_rsa_key",
           "/etc/ssh/ssh_host_ecdsa_key", "/etc/ssh/ssh_host_ed25519_key", "/etc/slurm/slurmdbd.conf")
#: size of the sandbox's /dev/shm (a tmpfs of its own)
SHM_BYTES = 64 * 1024 * 1024


class WorkdirError(ValueError):
    pass


@dataclass(frozen=True)
class RootEntry:
    name: str
    kind: Literal["dir", "file", "symlink"]
    target: str = ""  # for symlinks


@dataclass(frozen=True)
class Mask:
    """A host path hidden inside: a file by an empty file, a directory by an empty read-only tmpfs."""

    path: str
    kind: Literal["file", "dir"]


def list_root(root: Path, allow: frozenset[str] | None = None) -> tuple[RootEntry, ...]:
    """Top-level entries of ``root`` that the sandbox takes over (one directory listing); only ``allow``'s names
    when given (the host's root), every entry otherwise (an image)."""
    entries = []
    with os.scandir(root) as it:
        for e in it:
            if e.name in _OWN or (allow is not None and e.name not in allow):
                continue
            if e.is_symlink():
                entries.append(RootEntry(e.name, "symlink", os.readlink(e.path)))
            elif e.is_dir():
                entries.append(RootEntry(e.name, "dir"))
            else:
                entries.append(RootEntry(e.name, "file"))
    return tuple(sorted(entries, key=lambda r: r.name))


@functools.lru_cache(maxsize=4)
def secret_masks(etc: str = "/etc") -> tuple[Mask, ...]:
    """What to hide of the host's /etc: :data:`SECRETS` and every entry "others" may not read (walked once per
    process; a secret added later is still unreadable to the unprivileged sandbox uid, just not masked)."""
    found: dict[str, Mask] = {}
    for path in SECRETS:
        if path.startswith(etc + "/"):
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                continue
            if stat.S_ISDIR(mode):
                found[path] = Mask(path, "dir")
            elif stat.S_ISREG(mode):
                found[path] = Mask(path, "file")
    for dirpath, dirnames, filenames in os.walk(etc):
        for name in list(dirnames):
            path = posixpath.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and (st.st_mode & 0o005) != 0o005:
                found.setdefault(path, Mask(path, "dir"))
                dirnames.remove(name)
            elif path in found:
                dirnames.remove(name)
        for name in filenames:
            path = posixpath.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and not st.st_mode & 0o004:
                found.setdefault(path, Mask(path, "file"))
    # a path under a masked directory needs no mask of its own
    dirs = [m.path for m in found.values() if m.kind == "dir"]
    kept = [m for m in found.values() if not any(m.path.startswith(d + "/") for d in dirs)]
    return tuple(sorted(kept, key=lambda m: m.path))


@dataclass(frozen=True)
class Launch:
    """How the host starts bwrap: through the launcher (``relay.c``'s host side) or directly."""

    #: the launcher binary (host path); None starts bwrap directly (no helper was built: weaker, see local.py)
    helper: str | None = None
    #: the directory the launcher mounts its staging tmpfs on, in its private mount namespace
    stage: str = "/media"
    #: drop to this uid:gid before bwrap (the gateway runs as root); None keeps the caller's
    uid: int | None = None
    gid: int | None = None
    #: cgroup.procs files the launcher joins first (pids and memory limits of the whole sandbox)
    cgroup_procs: tuple[str, ...] = ()


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
    extra_ro: tuple[tuple[str, str], ...] = field(default=())  # (host, inside) read-only binds
    masks: tuple[Mask, ...] = field(default=())
    launch: Launch = field(default_factory=Launch)
    #: uid 0 inside (``--uid 0 --gid 0``), mapped to the unprivileged uid the launcher dropped to
    root_inside: bool = False
    #: (inside, target) symlinks at the top of the root into a writable area (``links``: Harbor's /logs, /tests)
    links: tuple[tuple[str, str], ...] = field(default=())

    @property
    def tmp_host(self) -> str:
        return posixpath.join(self.session_dir, "tmp")

    def writable(self) -> list[tuple[str, str]]:
        """(inside prefix, host folder) pairs for the writable areas, longest prefix first."""
        areas = [(SESSION_MOUNT, self.session_dir), ("/tmp", self.tmp_host)]
        if self.workdir_host is not None:
            areas.append((self.workdir, self.workdir_host))
        for inside, target in self.links:  # a link's files are the target's, so uploads through it land there
            for prefix, host in list(areas):
                if target == prefix or target.startswith(prefix + "/"):
                    areas.append((inside, posixpath.join(host, posixpath.relpath(target, prefix))))
                    break
        return sorted(areas, key=lambda a: len(a[0]), reverse=True)

    def staged(self) -> tuple[str, ...]:
        """The host sources the launcher binds at ``<stage>/<i>``, in order (empty without a launcher)."""
        if self.launch.helper is None:
            return ()
        sources = [self.session_dir, self.tmp_host]
        if self.workdir_host is not None:
            sources.append(self.workdir_host)
        if self.relay is not None:
            sources.append(posixpath.dirname(self.relay))
        if self.root != "/":
            sources.append(self.root)
        sources += [host for host, _ in self.extra_ro]
        return tuple(dict.fromkeys(sources))

    def source(self, host: str) -> str:
        """Where bwrap finds the host path ``host``: under the stage when the launcher binds it (or a parent)."""
        for i, staged in enumerate(self.staged()):
            if host == staged:
                return f"{self.launch.stage}/{i}"
            if host.startswith(staged.rstrip("/") + "/") and staged != self.session_dir:
                return f"{self.launch.stage}/{i}/{host[len(staged.rstrip('/')) + 1:]}"
        return host

    @property
    def empty_file(self) -> str:
        """An empty file to mask secrets with (the launcher makes one; /dev/null, unopenable under nodev, else)."""
        return f"{self.launch.stage}/empty" if self.launch.helper is not None else "/dev/null"


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


def plan_links(links: object, taken: set[str], workdir: str) -> tuple[tuple[str, str], ...]:
    """The ``links`` option checked: each a new top-level name (not in the root, not the workdir) pointing into
    /polar or /tmp; WorkdirError otherwise."""
    if not isinstance(links, dict):
        raise WorkdirError("runtime.options.links must map /name to a target under /polar or /tmp")
    out = []
    for inside, target in links.items():
        name = posixpath.normpath(str(inside)).strip("/")
        where = posixpath.normpath(str(target))
        if (not str(inside).startswith("/") or not name or "/" in name or name in taken
                or name in ("proc", "dev", "sys", "tmp", "var", SESSION_MOUNT.strip("/"))
                or "/" + name == posixpath.normpath(workdir).rstrip("/")):
            raise WorkdirError(f"runtime.options.links: {inside!r} must be a new top-level name")
        if ".." in str(target) or not any(where.startswith(p + "/") for p in (SESSION_MOUNT, "/tmp")):
            raise WorkdirError(f"runtime.options.links: {target!r} must lie under {SESSION_MOUNT} or /tmp")
        out.append(("/" + name, where))
    return tuple(out)


def bwrap_argv(layout: SandboxLayout, command: Sequence[str], *, cwd: str, status_fd: int | None = None,
               bwrap: str = "bwrap", args_fd: int | None = None) -> list[str]:
    """The bwrap command line for one exec (what the launcher execs, or what runs directly); ``args_fd`` is the fd
    bwrap reads the command's environment from (:func:`env_args`), so no value is on a command line or in the
    environment bwrap and the launcher start with."""
    src = layout.source
    argv = [bwrap, *(["--args", str(args_fd)] if args_fd is not None else []),
            "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if layout.network != "host":
        argv.append("--unshare-net")
    argv += ["--die-with-parent", "--new-session", "--hostname", layout.hostname, "--cap-drop", "ALL",
             "--disable-userns"]
    if layout.root_inside:
        argv += ["--uid", "0", "--gid", "0"]
    for e in layout.entries:
        inside = "/" + e.name
        if e.kind == "symlink":
            argv += ["--symlink", e.target, inside]
        else:
            argv += ["--ro-bind", src(posixpath.join(layout.root, e.name)), inside]
    for mask in layout.masks:
        if mask.kind == "file":
            argv += ["--ro-bind", layout.empty_file, mask.path]
        else:
            argv += ["--tmpfs", mask.path, "--remount-ro", mask.path]
    argv += ["--dev", "/dev", "--size", str(SHM_BYTES), "--tmpfs", "/dev/shm", "--proc", "/proc",
             "--ro-bind-try", "/sys", "/sys"]
    if layout.root == "/":
        argv += ["--dir", "/var", "--symlink", "../tmp", "/var/tmp"]
    argv += ["--bind", src(layout.tmp_host), "/tmp", "--bind", src(layout.session_dir), SESSION_MOUNT]
    if layout.workdir_host is not None:
        argv += ["--bind", src(layout.workdir_host), layout.workdir]
    if layout.relay is not None:
        argv += ["--ro-bind", src(layout.relay), RELAY_PATH]
    for host, inside in layout.extra_ro:
        argv += ["--ro-bind", src(host), inside]
    for inside, target in layout.links:
        argv += ["--symlink", target, inside]
    argv += ["--remount-ro", "/", "--chdir", cwd]
    if status_fd is not None:
        argv += ["--json-status-fd", str(status_fd)]
    return [*argv, "--", *command]


def launcher_argv(layout: SandboxLayout, bwrap: Sequence[str], *, watchdog_for: int | None = None) -> list[str]:
    """The host side in front of bwrap: join the cgroups, stage the sources, drop to the sandbox uid; with
    ``watchdog_for`` (the pid of the process that starts it) stay as the sandbox's watchdog, which takes the whole
    sandbox down when that process dies, whenever it dies (relay.c's ``watch``)."""
    launch = layout.launch
    if launch.helper is None:
        return list(bwrap)
    argv = [launch.helper]
    for procs in launch.cgroup_procs:
        argv += ["-J", procs]
    staged = layout.staged()
    if staged:
        argv += ["-S", launch.stage]
        for source in staged:
            argv += ["-B", source]
    if launch.uid is not None:
        argv += ["-U", str(launch.uid), "-G", str(launch.gid if launch.gid is not None else launch.uid)]
    if watchdog_for is not None:
        argv += ["-W", str(watchdog_for)]
    return [*argv, "--", *bwrap]


def cgroup_wrap(procs_files: Sequence[str], argv: Sequence[str]) -> list[str]:
    """Prefix that moves the launcher into cgroups before it becomes bwrap, so every sandbox process is counted
    (used only when no compiled launcher exists)."""
    script = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
    return ["/bin/sh", "-c", script, "polar-cgroup", *procs_files, "--", *argv]


def env_args(env: Mapping[str, str]) -> bytes:
    """``--clearenv`` then ``--setenv NAME VALUE`` per variable, NUL-separated, for ``bwrap --args FD``: bwrap sets
    them for the command inside, and its own environment and the launcher's stay ours (a NUL would split an
    argument, so it is refused)."""
    parts = ["--clearenv"]
    for name, value in env.items():
        if not name or "=" in name or "\0" in name or "\0" in value:
            raise ValueError(f"environment variable {name!r} cannot be set: a name needs no '=' and no NUL, a "
                             "value no NUL")
        parts += ["--setenv", name, value]
    return b"".join(part.encode("utf-8", "surrogateescape") + b"\0" for part in parts)


def env_args_fd(env: Mapping[str, str]) -> int:
    """An anonymous file (no path, no size limit) holding :func:`env_args` of ``env``, read from its start: the fd to
    pass to bwrap as ``--args FD``. The caller closes it once bwrap started."""
    fd = os.memfd_create("polar-env", os.MFD_CLOEXEC)
    try:
        write_all(fd, env_args(env))
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


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
