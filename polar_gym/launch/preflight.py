"""What an sbatch script under ``slurm/`` checks before it starts anything, and the state it prepares.

A job that dies with a traceback an hour after it was queued, or that sits idle because a setting was missing, costs
a queue wait each time; so each script first runs ``python -m polar_gym.launch.preflight SERVICE`` (through a small
bootstrap that turns a missing module into one line) with the environment it will run with. Every problem is one line
naming the variable and how to set it, all of them at once, and the exit code is 2 before anything started. On
success the job's state directory is created (mode 700) and, where the service mints its own admin token, a fresh
one is written to a mode-600 file: only the file's path is printed, never the token (job logs are often readable by
other users of the cluster).

The checks read the variables the scripts document (the scripts resolve the defaults: ``POLAR_STATE_DIR``,
``POLAR_ENGINE``, ``POLAR_ADMIN_TOKEN_FILE`` arrive set); :func:`problems` is pure apart from looking at files and
importing modules, so tests call it with a made-up environment.
"""

from __future__ import annotations

import importlib
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from polar_gym.private_files import write_secret
from polar_gym.proxy.settings import ProxySettings, check_engine
from polar_gym.server.sql import is_database_url
from polar_gym.settings import ConfigError, validate

__all__ = ["SERVICES", "main", "prepare", "problems", "python_has_module"]

#: service -> the modules its process imports (a missing dependency shows up importing them)
SERVICES: dict[str, tuple[str, ...]] = {
    "gateway": ("uvicorn", "polar_gym.gateway.api", "polar_gym.gateway.registration"),
    "server": ("uvicorn", "polar_gym.server.app", "polar_gym.server.store"),
    "sglang": (),
}

#: an engine setting's field -> the script variable that sets it
_ENGINE_VARS = {"engine": "POLAR_ENGINE", "upstreams": "POLAR_UPSTREAM", "tokenizer": "MODEL_PATH",
                "prompt_mode": "POLAR_ENGINE", "parser": "POLAR_ENGINE"}

#: how to tell the gateway which rollout server to join (or that it runs on its own)
_NO_SERVER = "none"


def _missing_module(modules: tuple[str, ...]) -> str | None:
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            return exc.name or name
    return None


def python_has_module(python: str, module: str) -> bool:
    """Whether ``python`` can import ``module`` (without importing it: sglang takes seconds to import)."""
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _positive_int(env: Mapping[str, str], name: str) -> list[str]:
    value = env.get(name, "")
    if value and not (value.isdigit() and int(value) > 0):
        return [f"{name}={value} is not a positive integer"]
    return []


def _writable_dir(path: Path) -> bool:
    """Whether ``path`` exists as a writable directory or could be created (its nearest existing parent is)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate.is_dir() and os.access(candidate, os.W_OK | os.X_OK)
    return False


def _token_problems(env: Mapping[str, str], *, needed_from: str | None) -> list[str]:
    """With ``needed_from`` (who issued the token), the token must exist already: a fresh one would be refused."""
    token_file = env.get("POLAR_ADMIN_TOKEN_FILE", "")
    if env.get("POLAR_ADMIN_TOKEN"):
        return []
    if token_file and Path(token_file).is_file():
        if not os.access(token_file, os.R_OK):
            return [f"POLAR_ADMIN_TOKEN_FILE={token_file} is not readable"]
        if Path(token_file).stat().st_mode & 0o077:
            return [f"POLAR_ADMIN_TOKEN_FILE={token_file} is readable by others: chmod 600 {token_file}"]
        return []
    if needed_from is not None:
        where = f"POLAR_ADMIN_TOKEN_FILE={token_file} does not exist" if token_file else "no admin token given"
        return [f"{where}: set POLAR_ADMIN_TOKEN_FILE to {needed_from}'s token file (server.sbatch prints its path) "
                "or export POLAR_ADMIN_TOKEN"]
    return []


def _gateway(env: Mapping[str, str]) -> list[str]:
    found: list[str] = []
    server = env.get("POLAR_SERVER_URL", "")
    if not server:
        found.append("POLAR_SERVER_URL is not set: set it to the rollout server's URL (server.sbatch prints "
                     "POLAR_SERVER_URL=...), or POLAR_SERVER_URL=none for a gateway nobody dispatches to")
    elif server != _NO_SERVER and not server.startswith(("http://", "https://")):
        found.append(f"POLAR_SERVER_URL={server} is not an http(s) URL")
    engine = env.get("POLAR_ENGINE", "")
    try:
        settings = validate(ProxySettings, {"engine": engine, "upstreams": env.get("POLAR_UPSTREAM", "").split(),
                                            "tokenizer": env.get("MODEL_PATH") or None})
        check_engine(settings)
    except ConfigError as exc:
        for key, message in exc.problems:
            variable = _ENGINE_VARS.get(key, key)
            if variable == "POLAR_UPSTREAM":
                message = (f"engine {engine!r} needs the inference server's base URL, e.g. POLAR_UPSTREAM=http://"
                           "GPU-NODE:30000 (sglang.sbatch prints it); or POLAR_ENGINE=oracle to run without a model")
            found.append(f"{variable}: {message}" if variable else message)
    needed_from = "the rollout server" if server and server != _NO_SERVER and not env.get("POLAR_SERVER_TOKEN") \
        else None
    found += _token_problems(env, needed_from=needed_from)
    workdir = env.get("POLAR_WORKDIR", "")
    if workdir and not _writable_dir(Path(workdir)):
        found.append(f"POLAR_WORKDIR={workdir} cannot be created or written")
    return found + _positive_int(env, "POLAR_CAPACITY")


def _server(env: Mapping[str, str]) -> list[str]:
    found = _token_problems(env, needed_from=None)
    db = env.get("POLAR_DB", "")
    if db and not is_database_url(db) and not _writable_dir(Path(db).parent):
        found.append(f"POLAR_DB={db}: cannot write to its directory")
    return found


def _sglang(env: Mapping[str, str], has_module: Callable[[str, str], bool]) -> list[str]:
    found: list[str] = []
    model = env.get("MODEL_PATH", "")
    if not model:
        found.append("MODEL_PATH is not set: set it to the model directory or hub id to serve")
    elif model.startswith(("/", ".", "~")) and not Path(model).expanduser().exists():
        found.append(f"MODEL_PATH={model} does not exist")
    python = env.get("SGLANG_PYTHON", "") or sys.executable
    if not has_module(python, "sglang"):
        found.append(f"SGLANG_PYTHON={python} cannot import sglang: set SGLANG_PYTHON to the python of an SGLang "
                     "install (pip install 'sglang[all]' in its own venv)")
    if env.get("POLAR_SERVER_URL"):
        found += _token_problems(env, needed_from="the rollout server")
    return found + _positive_int(env, "TP_SIZE")


def problems(service: str, env: Mapping[str, str], *,
             has_module: Callable[[str, str], bool] = python_has_module) -> list[str]:
    """Every reason the ``service`` job cannot work with ``env``, one line each (empty: go ahead)."""
    found: list[str] = []
    missing = _missing_module(SERVICES[service])
    if missing is not None:
        found.append(f"POLAR_PYTHON={sys.executable} has polar_gym but cannot import {missing}: install polar_gym's "
                     "dependencies into it (bash scripts/setup.sh builds the clone's .venv) or point POLAR_PYTHON at "
                     "a python that has them")
    found += _positive_int(env, "PORT")
    state = env.get("POLAR_STATE_DIR", "")
    if state and not _writable_dir(Path(state)):
        found.append(f"POLAR_STATE_DIR={state} cannot be created or written: set POLAR_STATE_DIR to a directory "
                     "of yours (node-local scratch or your home)")
    if service == "gateway":
        found += _gateway(env)
    elif service == "server":
        found += _server(env)
    else:
        found += _sglang(env, has_module)
    return found


def prepare(service: str, env: Mapping[str, str]) -> list[str]:
    """Create the state directory (mode 700) and, where the service mints its own token, a fresh one in its
    mode-600 file; the lines to log (paths only)."""
    lines = []
    state = env.get("POLAR_STATE_DIR", "")
    if state:
        Path(state).mkdir(mode=0o700, parents=True, exist_ok=True)
        lines.append(f"state directory: {state}")
    token_file = env.get("POLAR_ADMIN_TOKEN_FILE", "")
    if env.get("POLAR_ADMIN_TOKEN") or not token_file:
        return lines
    if Path(token_file).is_file():
        lines.append(f"admin token read from {token_file}")
    elif service == "server":  # a gateway without a token writes its own (its CLI), an sglang job needs none
        write_secret(Path(token_file), secrets.token_urlsafe(24) + "\n")
        lines.append(f"admin token written to {token_file} (mode 600)")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``preflight SERVICE``: the problems on stderr and exit 2, or the state prepared and exit 0."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in SERVICES:
        print(f"usage: python -m polar_gym.launch.preflight {{{','.join(SERVICES)}}}", file=sys.stderr)
        return 2
    service, env = args[0], dict(os.environ)
    found = problems(service, env)
    if found:
        for line in found:
            print(f"polar_gym {service} job: {line}", file=sys.stderr)
        print(f"polar_gym {service} job: nothing was started ({len(found)} problem(s) above)", file=sys.stderr)
        return 2
    for line in prepare(service, env):
        print(f"polar_gym {service} job: {line}", flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
