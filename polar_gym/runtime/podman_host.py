"""The container CLI and ``run`` options this host needs, found once instead of known only by a test helper.

When nothing names the CLI (no ``cli`` option, no $POLAR_DOCKER_CLI), the docker backend takes ``podman`` if it is
on PATH, else ``docker``. For podman it adds ``--runtime runc`` when runc is installed (crun fails on some hosts'
cgroups), and when no ``run_args`` are given it probes which ``--ulimit`` options a container needs to start:
podman asks for nofile/nproc limits above what an unprivileged or nested host allows, and runc then fails with
``error setting rlimit``. The probe starts a container from an empty root filesystem (``--rootfs``; no image, no
registry) whose command does not exist: an rlimit error means "try the next candidate", any other error means the
limits were applied. :func:`ulimit_candidates` and :func:`probe_verdict` are pure; :func:`host_defaults` runs the
probes (blocking, a fraction of a second each) and caches the answer for the process.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["HostDefaults", "default_cli", "host_defaults", "probe_argv", "probe_verdict", "ulimit_candidates"]

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
