"""What a host binary we start for a sandbox sees of the world: a fixed environment of our own and a fixed working
directory, never a task's values (DESIGN.md invariant 9; issue 35, faults 1 and 2).

Every backend starts host binaries on a sandbox's behalf: the launcher and bwrap (local), the container CLI and,
through it, conmon (docker / podman), apptainer. A dynamic loader reads ``LD_PRELOAD``, ``LD_AUDIT`` or
``LD_LIBRARY_PATH`` from its process's environment before ``main``, and resolves a relative path against its working
directory: a task's env in that environment, or a working directory the sandbox writes, ran a task's library on the
host. So the sandboxed command's environment travels *into* the sandbox (bwrap ``--setenv`` through an args fd, an
env file in a private directory), and the host binary starts with :func:`host_env`: PATH, HOME and LANG of the
gateway's own process plus the names its tool needs (the gateway's container-engine configuration), in
:data:`HOST_CWD` or a private directory.

:func:`check_sandbox_env` is the second line of defence: names a loader, libc or container engine reads
(:func:`polar_gym.schema.host_read_env_names`) are refused in any environment a backend is handed (a request's
``RuntimeSpec.env``, built without its validator, or an exec's env from an evaluator or harness), with the name in the
error, even though none of it reaches a host process any more.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from polar_gym.runtime.errors import SandboxEnvError
from polar_gym.schema import host_read_env_names

__all__ = ["BASE_NAMES", "DEFAULT_HOST_PATH", "HOST_CWD", "check_sandbox_env", "host_env"]

#: the working directory of every host binary we start for a sandbox: no sandbox can write there
HOST_CWD = "/"
#: PATH of a host binary when the gateway has none
DEFAULT_HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: what every host binary gets from the gateway's own environment (when set there)
BASE_NAMES = ("PATH", "HOME", "LANG", "USER", "LOGNAME")


def host_env(names: Iterable[str] = (), prefixes: tuple[str, ...] = (),
             environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a host binary: :data:`BASE_NAMES` plus ``names`` and any name starting with one of
    ``prefixes``, each taken from the gateway's own environment (``environ``, default ``os.environ``), never from a
    task. No loader variable is ever passed on, whatever the gateway's environment holds."""
    source = os.environ if environ is None else environ
    wanted = {*BASE_NAMES, *names}
    env = {k: v for k, v in source.items()
           if (k in wanted or (prefixes and k.startswith(prefixes))) and not k.startswith("LD_")}
    env.setdefault("PATH", DEFAULT_HOST_PATH)
    env.setdefault("LANG", "C.UTF-8")
    return env


def check_sandbox_env(env: Mapping[str, str] | None, where: str) -> None:
    """Refuse (:class:`SandboxEnvError`, naming ``where`` and the variables) an environment for a sandbox that sets a
    name :data:`polar_gym.schema.HOST_READ_ENV` lists, or one no environment can hold (empty, ``=``, NUL)."""
    if not env:
        return
    refused = host_read_env_names(dict(env))
    if refused:
        raise SandboxEnvError(f"{where} may not set {', '.join(map(repr, refused))}: a dynamic loader, libc or "
                              "container engine reads it (set it in the image, or in a script the command runs)")
    bad = [k for k, v in env.items() if "\0" in v]
    if bad:
        raise SandboxEnvError(f"{where}: the value of {', '.join(map(repr, bad))} holds a NUL byte, which no "
                              "environment can carry")
