"""Pure command lines of the ``docker`` backend (golden-tested): every CLI call and in-container shell script
:class:`polar_gym.runtime.docker.DockerRuntime` runs, built from data with no I/O."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polar_gym.runtime.base import RELAY_PATH, SESSION_MOUNT
from polar_gym.runtime.errors import SandboxEnvError
from polar_gym.runtime.hostenv import host_env
from polar_gym.runtime.lease import LEASE_FILE
from polar_gym.runtime.relay import helper_argv

__all__ = [
    "CLI_HOST_NAMES",
    "CLI_HOST_PREFIXES",
    "ENV_FILE_LINE_MAX",
    "EXEC_WRAPPER",
    "INSTALL_HINT",
    "KEEPALIVE",
    "KILL_SCRIPT",
    "LABEL",
    "LEASE_MOUNT",
    "PRIVATE_DIR",
    "DockerCommands",
    "cli_env",
    "container_name",
    "env_file_text",
    "session_id_for",
]

#: where a container sees its gateway's lease directory (read-only: see polar_gym.runtime.lease)
LEASE_MOUNT = "/run/polar-lease"
#: the label every container of ours carries (value: the session id), for clean-up and leak checks
LABEL = "polar_gym.session"
#: our bookkeeping directory inside the session directory (pid and exit-code files, the ready marker)
PRIVATE_DIR = ".polar-docker"
INSTALL_HINT = ("install Docker (https://docs.docker.com/engine/install/) or Podman (Debian: apt-get install podman "
                "runc) and point runtime.options.cli at it, e.g. {\"cli\": [\"podman\", \"--runtime\", \"runc\"]}")

#: PID 1: create the workdir (``$2``; podman will not, unlike docker), mark the container ready (``$1``), then idle
#: until TERM. A workdir that cannot be made ends the container, which start() reports with its logs. With a lease
#: file (``$3``) it looks every ``$4`` seconds and exits, which stops the container, once the file's content has not
#: changed ``$5`` looks in a row: the gateway rewrites it while it lives, so a gateway that was SIGKILLed leaves no
#: container running (a detached container outlives its CLI; conmon is its parent).
KEEPALIVE = ("trap 'exit 0' TERM INT HUP; [ -d \"$2\" ] || mkdir -p \"$2\" || exit 1; : > \"$1\"; last= miss=0; "
             "while :; do sleep \"${4:-3600}\" & wait $!; [ -n \"$3\" ] || continue; v=; read -r v < \"$3\"; "
             "if [ -n \"$v\" ] && [ \"$v\" != \"$last\" ]; then last=$v miss=0; "
             "else miss=$((miss + 1)); [ \"$miss\" -lt \"$5\" ] || exit 0; fi; done 2>/dev/null")
#: runs every exec: ``$1`` is the path prefix for the pid and exit-code files, the rest is the command
EXEC_WRAPPER = ('f=$1; shift; { echo $$ > "$f.pid"; } 2>/dev/null; "$@"; rc=$?; '
                '{ echo $rc > "$f.rc"; } 2>/dev/null; exit $rc')
#: ``tree PID``: kill PID, its process group and session, and its descendants; ``all``: kill every process outside
#: PID 1's session (PID 1, its sleep and the relay stay). The tree is stopped before it is killed, so no shell in it
#: runs again to report its child's death ("Killed" on the exec's stderr). Shell builtins only: any image with sh.
KILL_SCRIPT = """mode=$1 root=$2 self=$$ keep=
if [ "$mode" = all ]; then read -r l </proc/1/stat; set -- ${l##*) }; keep=$4; fi
n=0
while [ $n -lt 3 ]; do
  n=$((n + 1)) v=" " grew=1
  while [ $grew = 1 ]; do
    grew=0
    for d in /proc/[0-9]*; do
      p=${d#/proc/}
      case "$v" in *" $p "*) continue ;; esac
      if [ "$p" = 1 ] || [ "$p" = "$self" ]; then continue; fi
      { read -r l <"$d/stat"; } 2>/dev/null || continue
      set -- ${l##*) }
      if [ "$mode" = all ]; then
        [ "$4" = "$keep" ] && continue
      elif [ "$p" != "$root" ] && [ "$3" != "$root" ] && [ "$4" != "$root" ]; then
        case "$v" in *" $2 "*) ;; *) continue ;; esac
      fi
      v="$v$p " grew=1
    done
  done
  [ "$v" = " " ] && exit 0
  kill -STOP $v 2>/dev/null; kill -9 $v 2>/dev/null
done
exit 0"""


def session_id_for(session_dir: Path, options: dict[str, Any]) -> str:
    """The session id in names and labels: ``options["session_id"]``, else the directory name plus a path hash."""
    raw = options.get("session_id")
    if not raw:
        digest = hashlib.sha1(str(session_dir.resolve()).encode()).hexdigest()[:8]
        raw = f"{session_dir.name}-{digest}"
    return re.sub(r"[^a-zA-Z0-9_.-]", "-", str(raw)).strip("-.") or "session"


def container_name(session_id: str) -> str:
    return f"polar-{session_id}"


#: what the container CLI (and conmon, which it starts) gets of the gateway's own environment besides PATH, HOME,
#: LANG, USER and LOGNAME: where rootless podman finds its store and runtime directory, how docker finds its daemon
CLI_HOST_NAMES = ("TMPDIR", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME",
                  "DBUS_SESSION_BUS_ADDRESS", "REGISTRY_AUTH_FILE", "STORAGE_DRIVER", "STORAGE_OPTS")
CLI_HOST_PREFIXES = ("CONTAINERS_", "CONTAINER_", "DOCKER_", "PODMAN_")
#: the longest line an env file may hold: docker and podman read it with Go's bufio.Scanner (64 KiB per line)
ENV_FILE_LINE_MAX = 65535


def cli_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The container CLI's own environment: a fixed one of ours (:func:`~polar_gym.runtime.hostenv.host_env`) with
    the gateway's engine settings (:data:`CLI_HOST_NAMES`, :data:`CLI_HOST_PREFIXES`), never a sandbox's values:
    those go in an env file (:func:`env_file_text`). A task's ``LD_PRELOAD`` there once ran in podman and conmon as
    root (issue 35)."""
    return host_env(CLI_HOST_NAMES, CLI_HOST_PREFIXES, environ)


def env_file_text(env: Mapping[str, str]) -> str:
    """``NAME=VALUE`` lines for ``--env-file`` (values verbatim: no quoting, no expansion). What that format cannot
    carry is refused with the variable named (:class:`SandboxEnvError`): a newline or carriage return in a value, a
    name with whitespace, ``=``, a leading ``#`` or nothing, a line over :data:`ENV_FILE_LINE_MAX` bytes. A name
    alone would take its value from the CLI's environment, so every line has its ``=``."""
    lines = []
    for name, value in env.items():
        if not name or name[0] == "#" or "=" in name or any(c.isspace() or c == "\0" for c in name):
            raise SandboxEnvError(f"environment variable {name!r} cannot be passed to a container: a name may not be "
                                  "empty, start with '#' or hold '=', whitespace or NUL")
        if any(c in value for c in "\n\r\0"):
            raise SandboxEnvError(f"the value of environment variable {name!r} holds a newline, carriage return or "
                                  "NUL, which a docker/podman env file cannot carry: pass it in a file the command "
                                  "reads instead (an upload, or runtime.prepare)")
        line = f"{name}={value}"
        if len(line.encode("utf-8", "surrogateescape")) > ENV_FILE_LINE_MAX:
            raise SandboxEnvError(f"environment variable {name!r} is longer than a docker/podman env file line may "
                                  f"be ({ENV_FILE_LINE_MAX} bytes with its name): pass it in a file instead")
        lines.append(line + "\n")
    return "".join(lines)


@dataclass(frozen=True)
class DockerCommands:
    """Every command line the backend runs, as pure functions of their inputs."""

    cli: tuple[str, ...] = ("docker",)
    run_args: tuple[str, ...] = ()
    shell: str = "/bin/sh"

    def run(self, *, name: str, session_id: str, image: str, session_dir: Path, workdir: str,
            env_file: str | None = None, network: str = "none", cpus: float | None = None,
            memory_mb: int | None = None, max_processes: int | None = None,
            relay: Path | None = None, max_connections: int | None = None,
            lease: tuple[Path, float, int] | None = None) -> list[str]:
        """``run -d``: the container idles in PID 1 until removed, with no capabilities and no new privileges.
        ``relay`` (the helper binary on the host) makes the entrypoint the relay, which opens the gateway port
        (at most ``max_connections`` at once) and then execs PID 1's loop. ``lease`` (the host directory of a
        :class:`~polar_gym.runtime.lease.Lease`, mounted read-only; seconds between looks; looks without a change)
        ends the container when its gateway stops rewriting the lease. ``env_file`` (a host path) holds the
        container's environment (:func:`env_file_text`)."""
        argv = [*self.cli, "run", "-d", "--name", name, "--label", f"{LABEL}={session_id}",
                "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                "-v", f"{session_dir}:{SESSION_MOUNT}",
                "--network", "host" if network == "host" else "none"]
        if env_file is not None:  # no name or value of the sandbox's on the command line or in the CLI's environment
            argv += ["--env-file", env_file]
        if cpus is not None:
            argv += ["--cpus", f"{cpus:g}"]
        if memory_mb is not None:
            argv += ["--memory", f"{memory_mb}m"]
        if max_processes is not None:
            argv += ["--pids-limit", str(max_processes)]
        init = [self.shell, "-c", KEEPALIVE, "polar-init", f"{SESSION_MOUNT}/{PRIVATE_DIR}/ready", workdir]
        if lease is not None:
            directory, every, misses = lease
            argv += ["-v", f"{directory}:{LEASE_MOUNT}:ro"]
            init += [f"{LEASE_MOUNT}/{LEASE_FILE}", f"{every:g}", str(misses)]
        if relay is not None:
            argv += ["-v", f"{relay}:{RELAY_PATH}:ro"]
            init = helper_argv(RELAY_PATH, init, gateway=True, max_connections=max_connections)
        return [*argv, "--entrypoint", init[0], *self.run_args, image, *init[1:]]

    def exec(self, name: str, command: Sequence[str], *, marker: str, env_file: str | None = None,
             cwd: str | None = None) -> list[str]:
        """``exec -i``: ``command`` under the wrapper that records its pid and exit code at ``marker``.{pid,rc};
        ``env_file`` (a host path) holds the exec's own environment."""
        argv = [*self.cli, "exec", "-i"]
        if env_file is not None:
            argv += ["--env-file", env_file]
        if cwd:
            argv += ["-w", cwd]
        return [*argv, name, self.shell, "-c", EXEC_WRAPPER, "polar-exec", marker, *command]

    def kill_tree(self, name: str, pid: int) -> list[str]:
        return [*self.cli, "exec", name, self.shell, "-c", KILL_SCRIPT, "polar-kill", "tree", str(pid)]

    def kill_all(self, name: str) -> list[str]:
        return [*self.cli, "exec", name, self.shell, "-c", KILL_SCRIPT, "polar-kill", "all", "0"]

    def copy_in(self, name: str) -> list[str]:
        """``cp - NAME:/``: a tar on stdin whose member names are absolute paths without the leading slash."""
        return [*self.cli, "cp", "-", f"{name}:/"]

    def copy_out(self, name: str, src: str) -> list[str]:
        """``cp NAME:SRC -``: a tar on stdout whose one top-level member is ``basename(SRC)``."""
        return [*self.cli, "cp", f"{name}:{src}", "-"]

    def logs(self, name: str) -> list[str]:
        return [*self.cli, "logs", name]

    def is_running(self, name: str) -> list[str]:
        return [*self.cli, "inspect", "-f", "{{.State.Running}}", name]

    def list_session(self, session_id: str) -> list[str]:
        return [*self.cli, "ps", "-a", "-q", "--filter", f"label={LABEL}={session_id}"]

    def remove(self, names: Sequence[str]) -> list[str]:
        return [*self.cli, "rm", "-f", *names]

    def restart(self, name: str) -> list[str]:
        """Cancel's last resort, when nothing can be started inside (the pids limit is used up)."""
        return [*self.cli, "restart", "-t", "0", name]
