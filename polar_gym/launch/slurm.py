"""sbatch scripts for a gateway, the rollout server and an SGLang server, rendered by pure functions.

The files under ``slurm/`` are exactly ``render_all()``'s output (a test checks it); regenerate them with
``python -m polar_gym.launch.slurm [DIR]``. Each script documents the environment variables it reads at its top and
works on its own: ``POLAR_SERVER_URL=http://node:8700 POLAR_ADMIN_TOKEN_FILE=... POLAR_UPSTREAM=http://h100-01:30000
sbatch slurm/gateway.sbatch``. Each first runs :mod:`polar_gym.launch.preflight` (its python, its settings: one line
per problem, exit 2) and keeps its state under ``POLAR_STATE_DIR``, never the submit directory.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SLURM_DIR", "SbatchResources", "main", "render_all", "render_gateway", "render_server", "render_sglang",
           "write_all"]


@dataclass(frozen=True)
class SbatchResources:
    """The ``#SBATCH`` header of one script."""

    job_name: str
    cpus: int = 4
    mem: str = "8G"
    time: str = "24:00:00"
    gpus: int = 0
    extra: tuple[str, ...] = ()

    def header(self) -> str:
        """The ``#SBATCH`` lines. Slurm's own log is /dev/null: Slurm expands no variable in ``#SBATCH`` lines, so
        the state directory cannot be named here, and the script moves its output there itself (:data:`_JOB_LOG`);
        ``sbatch -o FILE`` overrides this line and the script then leaves the log where it was put."""
        lines = [f"#SBATCH --job-name={self.job_name}", "#SBATCH --nodes=1", "#SBATCH --ntasks=1",
                 f"#SBATCH --cpus-per-task={self.cpus}", f"#SBATCH --mem={self.mem}", f"#SBATCH --time={self.time}",
                 "#SBATCH --output=/dev/null"]
        if self.gpus:
            lines.append(f"#SBATCH --gres=gpu:{self.gpus}")
        lines += [f"#SBATCH {opt}" for opt in self.extra]
        return "\n".join(lines)


def _doc(title: str, variables: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in variables)
    rows = "\n".join(f"#   {name.ljust(width)}  {text}" for name, text in variables)
    return f"# {title}\n#\n# Environment variables it reads (all optional unless marked):\n{rows}"


# Waits for URL (argv[1]) to answer 200, for at most argv[2] seconds, while the process argv[3] lives.
_WAIT_PY = """import os, sys, time, urllib.request
url, limit, pid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + limit
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(f"process {pid} exited before {url} answered")
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
sys.exit(f"{url} did not answer within {limit:.0f} s")"""

# Adds an inference backend to the rollout server: argv = server_url/backends, backend_url (token from env).
_ADD_BACKEND_PY = """import json, os, sys, urllib.request
token = os.environ["POLAR_ADMIN_TOKEN"]
req = urllib.request.Request(sys.argv[1], data=json.dumps({"url": sys.argv[2]}).encode(), method="POST",
                             headers={"content-type": "application/json", "x-admin-token": token})
with urllib.request.urlopen(req, timeout=60) as r:
    print("backend added:", r.read().decode())"""

# Runs the preflight (polar_gym.launch.preflight) with argv[1] = the service; a python without polar_gym or one of its
# dependencies gets one line saying so instead of a traceback.
_BOOT_PY = """import sys
try:
    from polar_gym.launch.preflight import main
except ModuleNotFoundError as exc:
    name = exc.name or "?"
    head = f"polar_gym {sys.argv[1]} job: POLAR_PYTHON={sys.executable}"
    if name.split(".")[0] == "polar_gym":
        print(f"{head} cannot import polar_gym: set POLAR_PYTHON to the python of a polar_gym install "
              "(.venv/bin/python in the clone, made by bash scripts/setup.sh)", file=sys.stderr)
    else:
        print(f"{head} has polar_gym but cannot import {name}: install the dependencies of polar_gym into it "
              "(bash scripts/setup.sh builds .venv in the clone) or point POLAR_PYTHON at a python that has them",
              file=sys.stderr)
    sys.exit(2)
sys.exit(main(sys.argv[1:]))"""

_HEAD = """set -euo pipefail
SUBMIT_DIR="${SLURM_SUBMIT_DIR:-$PWD}"
cd "$SUBMIT_DIR"  # relative paths in the variables mean the submit directory; nothing is written to it
HOST="${POLAR_ADVERTISE_HOST:-$(hostname)}"
"""

# The per-job state directory: POLAR_STATE_DIR, else one per job under XDG_STATE_HOME.
_STATE_DIR = """STATE_HOME="${XDG_STATE_HOME:-${HOME:-}/.local/state}"
POLAR_STATE_DIR="${POLAR_STATE_DIR:-$STATE_HOME/polar_gym/${SLURM_JOB_NAME:-@JOB@}-${SLURM_JOB_ID:-local-$$}}"
case "$POLAR_STATE_DIR" in /*) ;; *) POLAR_STATE_DIR="$SUBMIT_DIR/$POLAR_STATE_DIR" ;; esac
export POLAR_STATE_DIR
"""

# The job log. Slurm expands no variable in #SBATCH lines, so the header sends Slurm's own log to /dev/null and the
# job moves its output (both streams) to $POLAR_STATE_DIR/job.log first thing, before any check can fail; a state
# directory that cannot be made sends it to JOBNAME-JOBID.out in the submit directory, saying why. A log that `sbatch
# -o FILE` (or a terminal, or a test) gives is left where it is.
_JOB_LOG = """if [ "$(readlink "/proc/$$/fd/1" 2>/dev/null)" = /dev/null ]; then
  if (umask 077 && mkdir -p "$POLAR_STATE_DIR") 2>/dev/null && [ -w "$POLAR_STATE_DIR" ]; then
    exec >>"$POLAR_STATE_DIR/job.log" 2>&1
  else
    exec >>"$SUBMIT_DIR/${SLURM_JOB_NAME:-@JOB@}-${SLURM_JOB_ID:-local-$$}.out" 2>&1
    echo "polar_gym @SERVICE@ job: POLAR_STATE_DIR=$POLAR_STATE_DIR cannot be created: this log is in the submit" \\
      "directory instead"
  fi
fi
"""

_PREAMBLE = """clone_python() {  # DIR: the .venv python of the polar_gym clone at DIR, if it is one
  if [ -x "$1/.venv/bin/python" ] && [ -f "$1/polar_gym/__init__.py" ]; then
    echo "$(cd "$1" && pwd)/.venv/bin/python"
  fi
}

find_python() {  # POLAR_PYTHON, else the clone's .venv (around this script or the submit directory), else python3
  local root found script
  if [ -n "${POLAR_PYTHON:-}" ]; then echo "$POLAR_PYTHON"; return; fi
  for root in "$(dirname "$0")/.." "$SUBMIT_DIR" "$SUBMIT_DIR/.."; do
    found="$(clone_python "$root")"
    if [ -n "$found" ]; then echo "$found"; return; fi
  done
  if [ -n "${SLURM_JOB_ID:-}" ] && command -v scontrol >/dev/null 2>&1; then  # sbatch ran a copy: where from?
    script="$(timeout 10 scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -o 'Command=[^ ]*' | cut -d= -f2-)" \\
      || true
    found="$( [ -n "$script" ] && clone_python "$(dirname "$script")/.." || true)"
    if [ -n "$found" ]; then echo "$found"; return; fi
  fi
  echo python3
}

PY="$(find_python)"
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "polar_gym @SERVICE@ job: POLAR_PYTHON=$PY not found: set POLAR_PYTHON to the python of a polar_gym install" \\
    "(the clone's .venv/bin/python, made by bash scripts/setup.sh)" >&2
  exit 2
fi

preflight() {  # every missing setting or module, one line each, exit 2; else the state prepared (paths logged)
  "$PY" -c '@BOOT@' @SERVICE@
}

read_token() {  # TOKEN: POLAR_ADMIN_TOKEN, else the token file's content (never printed), else empty
  TOKEN="${POLAR_ADMIN_TOKEN:-}"
  if [ -z "$TOKEN" ] && [ -n "${POLAR_ADMIN_TOKEN_FILE:-}" ] && [ -f "$POLAR_ADMIN_TOKEN_FILE" ]; then
    TOKEN="$(cat "$POLAR_ADMIN_TOKEN_FILE")"
  fi
}

forward_signals() {  # from here on SIGTERM/SIGINT (scancel, the time limit) stop the service; the job ends with it
  trap 'kill -TERM "$child" ${waiter:+"$waiter"} 2>/dev/null || true; wait_child' TERM INT
}

wait_child() {  # waits for the service; exits the job with its status
  while true; do  # a trapped signal interrupts wait (status > 128) while the service is still stopping
    status=0
    wait "$child" || status=$?
    kill -0 "$child" 2>/dev/null || break
  done
  exit "$status"
}

wait_http() {  # URL SECONDS: returns once the service answers 200; else stops it and fails the job
  "$PY" -c '@SNIPPET@' "$1" "$2" "$child" &
  waiter=$!
  wait "$waiter" && return 0
  kill -TERM "$child" 2>/dev/null || true
  wait "$child" 2>/dev/null || true
  exit 1
}""".replace("@SNIPPET@", _WAIT_PY).replace("@BOOT@", _BOOT_PY)

assert "'" not in _BOOT_PY + _WAIT_PY + _ADD_BACKEND_PY, "snippets are single-quoted in bash"

# The admin token's file, by default in the job's own state directory (the scripts whose service keeps a token).
_TOKEN = """POLAR_ADMIN_TOKEN_FILE="${POLAR_ADMIN_TOKEN_FILE:-$POLAR_STATE_DIR/admin-token}"
export POLAR_ADMIN_TOKEN_FILE"""


def _script(resources: SbatchResources, doc: str, service: str, body: str, *, token: bool = True) -> str:
    preamble = "\n".join([_HEAD, _STATE_DIR, _JOB_LOG, _PREAMBLE]).replace("@SERVICE@", service)
    if token:
        preamble += "\n\n" + _TOKEN
    preamble = preamble.replace("@JOB@", resources.job_name)
    return f"#!/bin/bash\n{resources.header()}\n#\n{doc}\n\n{preamble}\n\n{body.strip()}\n"


_PYTHON_DOC = ("POLAR_PYTHON", "python with polar_gym and its dependencies (default: the .venv of the clone this "
               "script or the submit directory is in, else python3)")
_STATE_DOC = ("POLAR_STATE_DIR", "this job's files and its log, job.log; reuse one to resume (default: "
              "~/.local/state/polar_gym/JOBNAME-JOBID)")
_LOG_DOC = ("POLAR_STATE_DIR", "this job's log, job.log (default: ~/.local/state/polar_gym/JOBNAME-JOBID; "
            "sbatch -o FILE puts the log in FILE instead)")


def render_gateway(resources: SbatchResources | None = None) -> str:
    """``slurm/gateway.sbatch``: one gateway node, registered with the rollout server POLAR_SERVER_URL names."""
    resources = resources or SbatchResources("polar-gateway", cpus=8, mem="16G")
    doc = _doc("polar_gym gateway node (python -m polar_gym.gateway) as a Slurm job.", [
        ("POLAR_SERVER_URL", "rollout server to register and heartbeat with (required; none: serve on its own)"),
        ("POLAR_ADMIN_TOKEN", "the server's admin token, also this node's (unset: read from POLAR_ADMIN_TOKEN_FILE)"),
        ("POLAR_ADMIN_TOKEN_FILE", "file holding it (mode 600), e.g. the server job's; created fresh without a "
                                   "server (default: $POLAR_STATE_DIR/admin-token)"),
        ("POLAR_ENGINE", "vllm, sglang, sglang_generate, openai or oracle (default: sglang)"),
        ("POLAR_UPSTREAM", "space-separated inference base URLs (required except for oracle)"),
        ("MODEL_PATH", "the model's tokenizer directory; set, vllm / sglang send token prompts (token_in; unset: "
                       "chat, or add --prompt-mode token_in for polar_gym's built Qwen one); oracle / "
                       "sglang_generate default to polar_gym's built one"),
        ("PORT", "listening port (default: 8100)"),
        ("POLAR_CAPACITY", "concurrent run slots, also the capacity registered (default: 8)"),
        ("POLAR_WORKDIR", "session directories and capture journal, e.g. node-local scratch "
                          "(default: $POLAR_STATE_DIR/work)"),
        _STATE_DOC,
        ("POLAR_ADVERTISE_HOST", "host the server and sandboxes use to reach it (default: $(hostname))"),
        _PYTHON_DOC,
    ])
    body = """POLAR_ENGINE="${POLAR_ENGINE:-sglang}"
POLAR_WORKDIR="${POLAR_WORKDIR:-$POLAR_STATE_DIR/work}"
export POLAR_ENGINE POLAR_WORKDIR
preflight
read_token
PORT="${PORT:-8100}"
args=(--engine "$POLAR_ENGINE" --host 0.0.0.0 --port "$PORT" --advertise-host "$HOST" --workdir "$POLAR_WORKDIR"
      --capture-dir "$POLAR_WORKDIR/capture" --run-slots "${POLAR_CAPACITY:-8}"
      --admin-token-file "$POLAR_ADMIN_TOKEN_FILE")  # the gateway writes a fresh token there if it has none
if [ -n "${POLAR_UPSTREAM:-}" ]; then
  read -r -a upstreams <<< "$POLAR_UPSTREAM"
  args+=(--upstream "${upstreams[@]}")
fi
if [ "$POLAR_SERVER_URL" = none ]; then
  unset POLAR_SERVER_URL  # the gateway would take it for a URL
else
  args+=(--server-url "$POLAR_SERVER_URL")
fi
if [ -n "${MODEL_PATH:-}" ]; then
  args+=(--tokenizer "$MODEL_PATH")
fi
POLAR_ADMIN_TOKEN="$TOKEN" "$PY" -m polar_gym.gateway "${args[@]}" "$@" &
child=$!
forward_signals
wait_http "http://127.0.0.1:$PORT/gateway/health" 300
echo "gateway up: http://$HOST:$PORT"
wait_child"""
    return _script(resources, doc, "gateway", body)


def render_server(resources: SbatchResources | None = None) -> str:
    """``slurm/server.sbatch``: the rollout server with its SQLite store."""
    resources = resources or SbatchResources("polar-server", cpus=4, mem="8G", time="7-00:00:00")
    doc = _doc("polar_gym rollout server (python -m polar_gym.server) as a Slurm job.", [
        ("POLAR_ADMIN_TOKEN", "admin token of /tasks, /gateways, /backends (unset: read from POLAR_ADMIN_TOKEN_FILE)"),
        ("POLAR_ADMIN_TOKEN_FILE", "file holding it, mode 600; a fresh one is written if it does not exist "
                                   "(default: $POLAR_STATE_DIR/admin-token)"),
        ("PORT", "listening port (default: 8700)"),
        ("POLAR_DB", "SQLite store; reuse it to resume a run (default: $POLAR_STATE_DIR/server.sqlite); or the "
                     "postgresql:// URL several server workers share (one job each, with --worker NAME)"),
        _STATE_DOC,
        ("POLAR_ADVERTISE_HOST", "host gateways and trainers use to reach it (default: $(hostname))"),
        _PYTHON_DOC,
    ])
    body = """POLAR_DB="${POLAR_DB:-$POLAR_STATE_DIR/server.sqlite}"
export POLAR_DB
preflight  # also writes a fresh token to POLAR_ADMIN_TOKEN_FILE if there is none
read_token
PORT="${PORT:-8700}"
POLAR_ADMIN_TOKEN="$TOKEN" "$PY" -m polar_gym.server --host 0.0.0.0 --port "$PORT" "$@" &  # --db: $POLAR_DB
child=$!
forward_signals
wait_http "http://127.0.0.1:$PORT/health" 120
echo "POLAR_SERVER_URL=http://$HOST:$PORT"
echo "gateways and sglang jobs: POLAR_ADMIN_TOKEN_FILE=$POLAR_ADMIN_TOKEN_FILE (the token itself is never logged)"
wait_child"""
    return _script(resources, doc, "server", body)


def render_sglang(resources: SbatchResources | None = None) -> str:
    """``slurm/sglang.sbatch``: an SGLang server on a GPU node (for POLAR_UPSTREAM of gateways)."""
    resources = resources or SbatchResources("polar-sglang", cpus=16, mem="128G", gpus=1)
    doc = _doc("SGLang inference server (python -m sglang.launch_server) as a Slurm job.", [
        ("MODEL_PATH", "model directory or hub id (required)"),
        ("PORT", "listening port (default: 30000)"),
        ("TP_SIZE", "tensor parallel size (default: the GPUs Slurm gave, else 1)"),
        ("SGLANG_ARGS", "extra launch_server arguments, space-separated"),
        ("SGLANG_PYTHON", "python with sglang installed (default: POLAR_PYTHON)"),
        ("POLAR_SERVER_URL", "rollout server to add this backend to once healthy (unset: none)"),
        ("POLAR_ADMIN_TOKEN", "the rollout server's admin token (with POLAR_SERVER_URL; or POLAR_ADMIN_TOKEN_FILE)"),
        ("POLAR_ADMIN_TOKEN_FILE", "the server job's token file (its log prints the path)"),
        ("POLAR_ADVERTISE_HOST", "host gateways use to reach it (default: $(hostname))"),
        _LOG_DOC,
        _PYTHON_DOC,
    ])
    body = """SGLANG_PYTHON="${SGLANG_PYTHON:-$PY}"
export SGLANG_PYTHON
preflight
read_token
PORT="${PORT:-30000}"
GPUS="${SLURM_GPUS_ON_NODE:-1}"
TP="${TP_SIZE:-$GPUS}"
read -r -a extra <<< "${SGLANG_ARGS:-}"
"$SGLANG_PYTHON" -m sglang.launch_server --model-path "$MODEL_PATH" --host 0.0.0.0 --port "$PORT" --tp-size "$TP" \\
  ${extra[@]+"${extra[@]}"} "$@" &
child=$!
forward_signals
wait_http "http://127.0.0.1:$PORT/health" 1800
echo "POLAR_UPSTREAM=http://$HOST:$PORT"
if [ -n "${POLAR_SERVER_URL:-}" ]; then
  POLAR_ADMIN_TOKEN="$TOKEN" "$PY" -c '@SNIPPET@' "${POLAR_SERVER_URL%/}/backends" "http://$HOST:$PORT"
fi
wait_child""".replace("@SNIPPET@", _ADD_BACKEND_PY)
    return _script(resources, doc, "sglang", body, token=False)


def render_all() -> dict[str, str]:
    """File name → content for every script under ``slurm/``."""
    return {"gateway.sbatch": render_gateway(), "server.sbatch": render_server(), "sglang.sbatch": render_sglang()}


def write_all(directory: Path) -> list[Path]:
    """Write ``render_all()`` into ``directory`` (executable); returns the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in render_all().items():
        path = directory / name
        path.write_text(text)
        path.chmod(0o755)
        paths.append(path)
    return paths


#: where ``python -m polar_gym.launch.slurm`` writes without an argument: the ``slurm/`` directory of this clone
SLURM_DIR = Path(__file__).resolve().parents[2] / "slurm"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m polar_gym.launch.slurm [DIR]``: write every script into DIR (default :data:`SLURM_DIR`) and print
    the paths."""
    args = sys.argv[1:] if argv is None else list(argv)
    for written in write_all(Path(args[0]) if args else SLURM_DIR):
        print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
