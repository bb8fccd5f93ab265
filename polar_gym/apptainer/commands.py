"""Every Apptainer command line the runtime runs, built by pure functions (golden-tested; no I/O here).

The settings come from ``RuntimeSpec`` plus ``RuntimeSpec.options`` (see :class:`ApptainerOptions`), so one place
decides what a sandbox looks like and the runner only executes argv lists. Inside, the session directory is at
``/polar``; our own bookkeeping (exec pid files, transfer staging) lives under
``/polar/.polar_gym`` (the relay helper at ``/polar/.bin/relay``), so it travels through the one bind every
sandbox has.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from polar_gym.runtime.base import RELAY_PATH, SESSION_MOUNT
from polar_gym.runtime.errors import SandboxEnvError
from polar_gym.runtime.hostenv import host_env
from polar_gym.schema import RuntimeSpec

__all__ = [
    "ENV_PREFIXES",
    "HOST_NAMES",
    "HOST_PREFIXES",
    "INNER_STATE",
    "KILL_TREE_SCRIPT",
    "PIDFILE_WRAPPER",
    "RELAY_INNER",
    "REQUEST_OPTIONS",
    "ApptainerOptions",
    "OverlayMode",
    "env_file_text",
    "exec_argv",
    "host_environment",
    "instance_list_argv",
    "instance_name",
    "instance_start_argv",
    "instance_start_options",
    "instance_stop_argv",
    "kill_tree_argv",
    "overlay_create_argv",
    "shell_command",
    "version_argv",
]

OverlayMode = Literal["dir", "image", "tmpfs", "none"]

#: the options a session request may set (RuntimeSpec.options); ``binary``, ``binds``, ``workdir_bind``,
#: ``extra_start_args``, ``env_prefix``, ``containall`` and ``no_privs`` reach the host's command line or weaken the
#: containment, so only the gateway's own configuration sets them
REQUEST_OPTIONS = frozenset({"overlay", "overlay_size_mb", "gpu", "nv", "hostname", "limits", "fakeroot",
                             "start_timeout", "stop_timeout"})

#: our bookkeeping inside the sandbox (a subdirectory of the session mount)
INNER_STATE = f"{SESSION_MOUNT}/.polar_gym"

#: where the gateway relay helper is bound inside (the shared RELAY_PATH): under the session mount, which exists in
#: every image (a SIF is read-only and may lack any other mount point); the runtime makes an empty file to bind onto
RELAY_INNER = RELAY_PATH

#: runs the command after writing its pid (inside the sandbox's pid namespace) to the file named by ``$0``, so a
#: timeout or cancel can find and kill the whole tree from a second exec (``exec`` keeps the pid)
PIDFILE_WRAPPER = 'echo $$ > "$0" && exec "$@"'

#: kills the process trees rooted at the pids given as arguments: snapshot pid→ppid from /proc, walk the
#: descendants, SIGSTOP them all (so none forks away) and SIGKILL them; two rounds catch a fork in between.
#: Plain POSIX sh with no awk/pkill, because task images are arbitrary.
KILL_TREE_SCRIPT = r"""
for round in 1 2; do
  map=$(for d in /proc/[0-9]*; do
    [ -r "$d/status" ] || continue
    while read -r k v; do if [ "$k" = PPid: ]; then echo "${d#/proc/} $v"; break; fi; done < "$d/status"
  done 2>/dev/null)
  all="$*"; todo="$*"
  while [ -n "$todo" ]; do
    next=""
    for t in $todo; do
      while read -r p pp; do [ "$pp" = "$t" ] && next="$next $p"; done <<EOF
$map
EOF
    done
    all="$all $next"; todo=$next
  done
  kill -STOP $all 2>/dev/null
  kill -KILL $all 2>/dev/null
done
exit 0
""".strip()

#: Apptainer reads ``APPTAINERENV_X`` (SingularityCE: ``SINGULARITYENV_X``) from the environment of ``exec`` as
#: ``X`` inside. We never use them (a sandbox's values would sit in the host process's environment): the
#: environment goes in an ``--env-file`` (:func:`env_file_text`), and these never reach the CLI at all.
ENV_PREFIXES = ("APPTAINERENV_", "SINGULARITYENV_")
#: what the CLI gets of the gateway's own environment besides PATH, HOME, LANG, USER and LOGNAME (the operator's
#: apptainer settings: cache and tmp dirs, the runtime dir rootless cgroups need)
HOST_NAMES = ("TMPDIR", "XDG_RUNTIME_DIR", "DBUS_SESSION_BUS_ADDRESS")
HOST_PREFIXES = ("APPTAINER_", "SINGULARITY_")
_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

_NAME_OK = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class ApptainerOptions:
    """The apptainer backend's settings, read from ``RuntimeSpec.options`` (unknown keys are an error).

    - ``binary``: the CLI to call; default ``singularity``, the name spython calls and that Apptainer installs too.
    - ``fakeroot`` / ``containall``: rootless root inside and full containment (files, PID, IPC, environment);
      ``no_privs`` (default on): ``--no-privs``, root inside keeps no capabilities.
    - ``overlay``: where writes go. ``dir`` (default) a directory ``<session>/overlay``, needs unprivileged
      overlayfs (kernel >= 5.11) or fuse-overlayfs; ``image`` an ext3 file ``<session>/overlay.img`` of
      ``overlay_size_mb`` (sparse, made by ``overlay create --fakeroot``); ``tmpfs`` ``--writable-tmpfs``, capped
      by ``sessiondir max size`` in apptainer.conf (64 MiB by default: too small for npm installs); ``none``
      read-only image.
    - ``binds``: extra ``src[:dst[:opts]]`` host binds; ``workdir_bind``: a host directory for ``spec.workdir``
      (``true`` means ``<session>/workdir``); by default the workdir is created in the overlay.
    - ``gpu`` (or ``nv``): ``--nv``; ``limits``: pass ``spec.cpus``/``memory_mb``/``max_processes`` as cgroup
      limits (rootless cgroups need cgroups v2 with systemd delegation, hence off by default).
    - ``start_timeout`` / ``stop_timeout``: seconds for ``instance start`` (may pull an image) and for the graceful
      ``instance stop`` before ``--force``.
    - ``env_prefix``: unused since the environment travels in an ``--env-file`` (kept so configurations that set it
      still load).
    - ``extra_start_args``: appended to the ``instance start`` options verbatim.
    """

    binary: str = "singularity"
    fakeroot: bool = True
    containall: bool = True
    no_privs: bool = True
    overlay: OverlayMode = "dir"
    overlay_size_mb: int = 4096
    binds: tuple[str, ...] = ()
    workdir_bind: str | bool | None = None
    gpu: bool = False
    limits: bool = False
    hostname: str | None = None
    env_prefix: str = "APPTAINERENV_"
    start_timeout: float = 600.0
    stop_timeout: float = 10.0
    extra_start_args: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> ApptainerOptions:
        values = dict(options)
        if "nv" in values:  # Apptainer's own name for the flag
            values["gpu"] = bool(values.pop("nv")) or bool(values.get("gpu"))
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown apptainer option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        for key in ("binds", "extra_start_args"):
            if key in values:
                values[key] = tuple(str(v) for v in values[key])
        if values.get("overlay", "dir") not in ("dir", "image", "tmpfs", "none"):
            raise ValueError(f"overlay must be dir, image, tmpfs or none, not {values['overlay']!r}")
        return cls(**values)

    def overlay_path(self, session_dir: Path) -> Path | None:
        """The host path of the writable layer (``None`` for tmpfs or a read-only sandbox)."""
        if self.overlay == "dir":
            return session_dir / "overlay"
        if self.overlay == "image":
            return session_dir / "overlay.img"
        return None

    def workdir_host(self, session_dir: Path) -> Path | None:
        if self.workdir_bind is True or (self.workdir_bind is None and self.overlay == "none"):
            return session_dir / "workdir"
        if isinstance(self.workdir_bind, str):
            return Path(self.workdir_bind)
        return None


def instance_name(session_dir: Path, token: str) -> str:
    """A valid, unique instance name (``[A-Za-z0-9._-]+``) that still says which session it belongs to."""
    stem = _NAME_OK.sub("-", session_dir.name).strip("-.")[:40] or "session"
    return f"polar-{stem}-{token}"


def version_argv(binary: str) -> list[str]:
    return [binary, "--version"]


def overlay_create_argv(binary: str, path: Path, size_mb: int, *, fakeroot: bool = True) -> list[str]:
    """A sparse ext3 overlay image, made usable by ``--fakeroot`` actions when asked."""
    return [binary, "overlay", "create", *(["--fakeroot"] if fakeroot else []), "--sparse",
            "--size", str(size_mb), str(path)]


def instance_start_options(spec: RuntimeSpec, opts: ApptainerOptions, session_dir: Path, *,
                           relay: Path | None = None) -> list[str]:
    """The options of ``instance start`` (between the subcommand and the image), in a fixed order; ``relay`` is the
    host's gateway relay helper, bound read-only at :data:`RELAY_INNER` (``network="gateway"``)."""
    args: list[str] = []
    if opts.fakeroot:
        args.append("--fakeroot")
    if opts.containall:
        args.append("--containall")
    if opts.no_privs:
        args.append("--no-privs")
    if spec.network in ("none", "gateway"):
        # a new network namespace with loopback only; "gateway" adds the relay on top (see runtime.py)
        args += ["--net", "--network", "none"]
    overlay = opts.overlay_path(session_dir)
    if overlay is not None:
        args += ["--overlay", str(overlay)]
    elif opts.overlay == "tmpfs":
        args.append("--writable-tmpfs")
    args += ["--bind", f"{session_dir}:{SESSION_MOUNT}"]
    workdir = opts.workdir_host(session_dir)
    if workdir is not None:
        args += ["--bind", f"{workdir}:{spec.workdir}"]
    if relay is not None:
        args += ["--bind", f"{relay}:{RELAY_INNER}:ro"]
    for bind in opts.binds:
        args += ["--bind", bind]
    if opts.gpu:
        args.append("--nv")
    if opts.hostname:
        args += ["--hostname", opts.hostname]
    if opts.limits:
        if spec.cpus is not None:
            args += ["--cpus", f"{spec.cpus:g}"]
        if spec.memory_mb is not None:
            args += ["--memory", f"{spec.memory_mb}M"]
        if spec.max_processes is not None:
            args += ["--pids-limit", str(spec.max_processes)]
    args += list(opts.extra_start_args)
    return args


def instance_start_argv(spec: RuntimeSpec, opts: ApptainerOptions, session_dir: Path, name: str, *,
                        relay: Path | None = None) -> list[str]:
    """``instance start [options] IMAGE NAME``."""
    if not spec.image:
        raise ValueError("the apptainer backend needs RuntimeSpec.image (a .sif path, a sandbox dir or docker://...)")
    options = instance_start_options(spec, opts, session_dir, relay=relay)
    return [opts.binary, "instance", "start", *options, spec.image, name]


def instance_stop_argv(binary: str, name: str, *, timeout: float | None = None, force: bool = False) -> list[str]:
    """``instance stop``. Matches what spython's ``Instance.stop`` builds (``--quiet`` first) for the same input."""
    argv = [binary, "--quiet", "instance", "stop"]
    if force:
        argv.append("--force")
    elif timeout:
        argv += ["-t", str(int(timeout))]
    return argv + [name]


def instance_list_argv(binary: str, name: str | None = None) -> list[str]:
    """``instance list --json [NAME]`` (what spython's ``Client.instances`` builds)."""
    return [binary, "instance", "list", "--json", *([name] if name else [])]


def shell_command(command: Sequence[str] | str) -> list[str]:
    """argv as given; a string runs through ``/bin/sh -c``."""
    return ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)


def exec_argv(binary: str, name: str, command: Sequence[str] | str, *, cwd: str | None = None,
              pidfile: str | None = None, env_file: str | None = None) -> list[str]:
    """``exec [--env-file FILE] [--pwd DIR] instance://NAME CMD...``; with ``pidfile`` the command first records its
    pid there; ``env_file`` (a host path, :func:`env_file_text`) holds the command's environment."""
    argv = [binary, "exec"]
    if env_file:
        argv += ["--env-file", env_file]
    if cwd:
        argv.append(f"--pwd={cwd}")
    argv.append(f"instance://{name}")
    inner = shell_command(command)
    if pidfile:
        inner = ["/bin/sh", "-c", PIDFILE_WRAPPER, pidfile, *inner]
    return argv + inner


def kill_tree_argv(binary: str, name: str, pids: Sequence[int]) -> list[str]:
    """Kill the process trees rooted at ``pids`` (pids inside the sandbox) from a second exec."""
    return [binary, "exec", f"instance://{name}", "/bin/sh", "-c", KILL_TREE_SCRIPT, "kill-tree",
            *(str(p) for p in pids)]


def host_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every apptainer command we run: a fixed one of ours plus the operator's apptainer
    settings (:data:`HOST_NAMES`, :data:`HOST_PREFIXES`), never a sandbox's values and never ``APPTAINERENV_*``."""
    return host_env(HOST_NAMES, HOST_PREFIXES, environ)


def env_file_text(env: Mapping[str, str]) -> str:
    """``NAME='VALUE'`` lines for ``--env-file``, which Apptainer reads as a shell script: each value single-quoted
    (any byte but NUL, newlines included, is carried verbatim and nothing is expanded). A name that is not a shell
    identifier, or a NUL, cannot be carried and is refused with the variable named (:class:`SandboxEnvError`)."""
    lines = []
    for key, value in env.items():
        if not _SHELL_NAME.fullmatch(key):
            raise SandboxEnvError(f"environment variable {key!r} cannot be passed to apptainer: its env file takes "
                                  "shell names only ([A-Za-z_][A-Za-z0-9_]*)")
        if "\0" in value:
            raise SandboxEnvError(f"the value of environment variable {key!r} holds a NUL byte")
        lines.append(f"{key}={shlex.quote(value)}\n")
    return "".join(lines)
