"""The container CLI and ``run`` options this host needs, found once instead of known only by a test helper.

When nothing names the CLI (no ``cli`` option, no $POLAR_DOCKER_CLI), the docker backend takes ``podman`` if it is
on PATH, else ``docker``. For podman it adds ``--runtime runc`` when runc is installed (crun fails on some hosts'
cgroups), and when no ``run_args`` are given it probes which ``--ulimit`` options a container needs to start:
podman asks for nofile/nproc limits above what an unprivileged or nested host allows, and runc then fails with
``error setting rlimit``. The probe starts a container from an empty root filesystem (``--rootfs``; no image, no
registry) whose command does not exist: an rlimit error means "try the next candidate", any other error means the
limits were applied. :func:`ulimit_candidates` and :func:`probe_verdict` are pure; :func:`host_defaults` runs the
probes (blocking, a fraction of a second each) and caches the answer for the process.

Which of ``memory_mb`` and ``max_processes`` the engine enforces (cgroups) is read from ``podman info`` too: rootless
podman on cgroup v1 (or v2 without a delegated controller) ignores ``--memory`` and ``--pids-limit`` with only a
warning, so :attr:`HostDefaults.limits` says so and the backend logs it once instead of pretending
(:func:`enforced_limits` is pure).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import resource
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "ALL_LIMITS",
    "HostDefaults",
    "default_cli",
    "enforced_limits",
    "host_defaults",
    "probe_argv",
    "probe_verdict",
    "ulimit_candidates",
]

_log = logging.getLogger(__name__)
#: the limits a container engine can enforce for a sandbox (cgroups: --pids-limit, --memory)
ALL_LIMITS = frozenset({"max_processes", "memory_mb"})

#: podman's own default for both limits when it runs as root
PODMAN_DEFAULT_LIMIT = 1_048_576
#: the last resort: limits every host seen so far accepts
SAFE_LIMIT = 1024


@dataclass(frozen=True)
class HostDefaults:
    """What the docker backend uses when its configuration does not say."""

    cli: tuple[str, ...]
    run_args: tuple[str, ...] = ()
    note: str = ""
    #: which of :data:`ALL_LIMITS` the engine enforces (docker's daemon and rootful podman: all)
    limits: frozenset[str] = ALL_LIMITS


def enforced_limits(rootless: bool, cgroups_version: str, controllers: Sequence[str] = ()) -> frozenset[str]:
    """What ``--pids-limit`` / ``--memory`` really do: all of it as root; rootless, only on cgroup v2 with the
    controller delegated to the user (cgroup v1 has no delegation: podman ignores both)."""
    if not rootless:
        return ALL_LIMITS
    if cgroups_version != "v2":
        return frozenset()
    return frozenset(name for name, ctl in (("max_processes", "pids"), ("memory_mb", "memory")) if ctl in controllers)


def _podman_limits(cli: Sequence[str]) -> frozenset[str]:
    fmt = "{{.Host.Security.Rootless}} {{.Host.CgroupsVersion}} {{range .Host.CgroupControllers}}{{.}} {{end}}"
    try:
        done = subprocess.run([*cli, "info", "--format", fmt], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ALL_LIMITS
    words = done.stdout.split()
    if done.returncode != 0 or len(words) < 2:
        return ALL_LIMITS  # unknown: assume the engine's documented behaviour
    return enforced_limits(words[0] == "true", words[1], words[2:])


def default_cli(which: Callable[[str], str | None] = shutil.which) -> tuple[str, ...]:
    """``podman`` if installed (with ``--runtime runc`` where runc is installed), else ``docker``. Podman first: it
    needs no daemon, whereas a ``docker`` client is often installed where no daemon runs."""
    if which("podman"):
        return ("podman", "--runtime", "runc") if which("runc") else ("podman",)
    return ("docker",)


def ulimit_candidates(nofile_hard: int, nproc_hard: int) -> list[tuple[str, ...]]:
    """``--ulimit`` sets to try in order: none (podman's defaults), the host's own hard limits (capped at what
    podman would ask for; nproc no higher than nofile, which some nested hosts cap it at), then ``SAFE_LIMIT``."""
    nofile = min(nofile_hard, PODMAN_DEFAULT_LIMIT)
    nproc = min(nproc_hard, nofile)
    host = ("--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}")
    safe = ("--ulimit", f"nofile={SAFE_LIMIT}:{SAFE_LIMIT}", "--ulimit", f"nproc={SAFE_LIMIT}:{SAFE_LIMIT}")
    return list(dict.fromkeys([(), host, safe]))


def probe_argv(cli: Sequence[str], run_args: Sequence[str], rootfs: str) -> list[str]:
    """A container from an empty directory whose command cannot exist: it gets as far as the limits, no further."""
    return [*cli, "run", "--rm", "--network", "none", *run_args, "--rootfs", rootfs, "/polar-probe-absent"]


def probe_verdict(returncode: int, stderr: str) -> bool | None:
    """True: these limits start a container; False: an rlimit error (try the next); None: podman itself fails
    (no point in trying more)."""
    text = stderr.lower()
    if "rlimit" in text:
        return False
    if returncode == 0 or "polar-probe-absent" in text or "not found" in text or "no such file" in text:
        return True
    return None


def _probe(cli: Sequence[str], run_args: Sequence[str]) -> bool | None:
    with tempfile.TemporaryDirectory(prefix="polar-probe-") as rootfs:
        try:
            done = subprocess.run(probe_argv(cli, run_args, rootfs), capture_output=True, text=True, timeout=60,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None
    return probe_verdict(done.returncode, done.stderr)


@functools.cache
def host_defaults(cli: tuple[str, ...] | None = None) -> HostDefaults:
    """The CLI (given, or :func:`default_cli`) and, for podman, the ``--ulimit`` run arguments this host needs.
    Cached per CLI for the process; docker (a daemon that applies its own limits) gets none."""
    cli = cli or default_cli()
    if os.path.basename(cli[0]) != "podman" or shutil.which(cli[0]) is None:
        return HostDefaults(cli)
    limits = _podman_limits(cli)
    if limits != ALL_LIMITS:
        _log.warning("rootless podman here does not enforce %s (no delegated cgroup controller): a sandbox's limits "
                     "of that kind are not applied", ", ".join(sorted(ALL_LIMITS - limits)))
    return dataclasses.replace(_probe_run_args(cli), limits=limits)


def _probe_run_args(cli: tuple[str, ...]) -> HostDefaults:
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    huge = PODMAN_DEFAULT_LIMIT * 4
    for candidate in ulimit_candidates(nofile if nofile >= 0 else huge, nproc if nproc >= 0 else huge):
        verdict = _probe(cli, candidate)
        if verdict is None:
            return HostDefaults(cli, note="podman could not start a probe container; no run options added")
        if verdict:
            return HostDefaults(cli, candidate, note="probed")
    return HostDefaults(cli, note="no --ulimit candidate let a probe container start")
