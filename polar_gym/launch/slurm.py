"""sbatch scripts for a gateway, the rollout server and an SGLang server, rendered by pure functions.

The files under ``slurm/`` are exactly ``render_all()``'s output (a test checks it); regenerate them with
``python -m polar_gym.launch.slurm [DIR]``. Each script documents the environment variables it reads at its top and
works on its own: ``PORT=8100 POLAR_ENGINE=sglang POLAR_UPSTREAM=http://h100-01:30000 sbatch slurm/gateway.sbatch``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SbatchResources", "render_all", "render_gateway", "render_server", "render_sglang", "write_all"]


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
        """The ``#SBATCH`` lines (output goes to ``<job_name>-<jobid>.out`` in the submit directory)."""
        lines = [f"#SBATCH --job-name={self.job_name}", "#SBATCH --nodes=1", "#SBATCH --ntasks=1",
                 f"#SBATCH --cpus-per-task={self.cpus}", f"#SBATCH --mem={self.mem}", f"#SBATCH --time={self.time}",
                 f"#SBATCH --output={self.job_name}-%j.out"]
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

_PREAMBLE = """set -euo pipefail
PY="${POLAR_PYTHON:-python3}"
HOST="${POLAR_ADVERTISE_HOST:-$(hostname)}"
cd "${SLURM_SUBMIT_DIR:-$PWD}"

wait_http() {  # URL SECONDS PID
  "$PY" -c '@SNIPPET@' "$1" "$2" "$3"
}

run_child() {  # forwards SIGTERM/SIGINT (scancel, time limit) to the service and waits for it
  trap 'kill -TERM "$child" 2>/dev/null || true' TERM INT
  wait "$child" || status=$?
  trap - TERM INT
  wait "$child" 2>/dev/null || true
  exit "${status:-0}"
}""".replace("@SNIPPET@", _WAIT_PY)


def _script(resources: SbatchResources, doc: str, body: str) -> str:
    return f"#!/bin/bash\n{resources.header()}\n#\n{doc}\n\n{_PREAMBLE}\n\n{body.strip()}\n"


def render_gateway(resources: SbatchResources | None = None) -> str:
    """``slurm/gateway.sbatch``: one gateway node, registered with the rollout server when POLAR_SERVER_URL is set."""
    resources = resources or SbatchResources("polar-gateway", cpus=8, mem="16G")
    doc = _doc("polar_gym gateway node (python -m polar_gym.gateway) as a Slurm job.", [
        ("POLAR_SERVER_URL", "rollout server the gateway registers and heartbeats with (unset: none)"),
        ("POLAR_ADMIN_TOKEN", "admin token of gateway and server (unset: a fresh one in POLAR_ADMIN_TOKEN_FILE)"),
        ("POLAR_ADMIN_TOKEN_FILE", "where a fresh token is written, mode 600 (default: $WORKDIR/admin-token)"),
        ("POLAR_ENGINE", "vllm, sglang, sglang_generate, openai or oracle (default: sglang)"),
        ("POLAR_UPSTREAM", "space-separated inference base URLs (required except for oracle)"),
        ("MODEL_PATH", "tokenizer directory for oracle / sglang_generate (default: polar_gym's built one)"),
        ("PORT", "listening port (default: 8100)"),
        ("POLAR_CAPACITY", "concurrent run slots, also the capacity registered (default: 8)"),
        ("POLAR_WORKDIR", "session directories and journal (default: polar-gateway-$SLURM_JOB_ID)"),
        ("POLAR_ADVERTISE_HOST", "host the server and sandboxes use to reach it (default: $(hostname))"),
        ("POLAR_PYTHON", "python with polar_gym installed (default: python3)"),
    ])
    body = """ENGINE="${POLAR_ENGINE:-sglang}"
PORT="${PORT:-8100}"
CAPACITY="${POLAR_CAPACITY:-8}"
WORKDIR="${POLAR_WORKDIR:-polar-gateway-${SLURM_JOB_ID:-local}}"
args=(--engine "$ENGINE" --host 0.0.0.0 --port "$PORT" --advertise-host "$HOST" --workdir "$WORKDIR"
      --capture-dir "$WORKDIR/capture" --run-slots "$CAPACITY")
if [ -n "${POLAR_ADMIN_TOKEN_FILE:-}" ]; then  # without POLAR_ADMIN_TOKEN the gateway writes its fresh token there
  args+=(--admin-token-file "$POLAR_ADMIN_TOKEN_FILE")
fi
if [ -n "${POLAR_UPSTREAM:-}" ]; then
  read -r -a upstreams <<< "$POLAR_UPSTREAM"
  args+=(--upstream "${upstreams[@]}")
fi
if [ -n "${POLAR_SERVER_URL:-}" ]; then
  args+=(--server-url "$POLAR_SERVER_URL")
fi
if [ -n "${MODEL_PATH:-}" ]; then
  args+=(--tokenizer "$MODEL_PATH")
elif [ "$ENGINE" = oracle ] || [ "$ENGINE" = sglang_generate ]; then
  args+=(--tokenizer "$("$PY" -c 'from polar_gym.assets import tokenizer_dir; print(tokenizer_dir())')")
fi
mkdir -p "$WORKDIR"
"$PY" -m polar_gym.gateway "${args[@]}" "$@" &
child=$!
URL="http://$HOST:$PORT"
wait_http "http://127.0.0.1:$PORT/gateway/health" 300 "$child"
echo "gateway up: $URL"
run_child"""
    return _script(resources, doc, body)


def render_server(resources: SbatchResources | None = None) -> str:
    """``slurm/server.sbatch``: the rollout server with its SQLite store."""
    resources = resources or SbatchResources("polar-server", cpus=4, mem="8G", time="7-00:00:00")
    doc = _doc("polar_gym rollout server (python -m polar_gym.server) as a Slurm job.", [
        ("POLAR_ADMIN_TOKEN", "admin token of /tasks, /gateways, /backends (unset: fresh, in POLAR_ADMIN_TOKEN_FILE)"),
        ("POLAR_ADMIN_TOKEN_FILE", "where a fresh token goes, mode 600 (default: polar-server-$SLURM_JOB_ID.token)"),
        ("PORT", "listening port (default: 8700)"),
        ("POLAR_DB", "SQLite store; reuse it to resume a run (default: polar-server.sqlite)"),
        ("POLAR_ADVERTISE_HOST", "host gateways and trainers use to reach it (default: $(hostname))"),
        ("POLAR_PYTHON", "python with polar_gym installed (default: python3)"),
    ])
    body = """PORT="${PORT:-8700}"
DB="${POLAR_DB:-polar-server.sqlite}"
if [ -z "${POLAR_ADMIN_TOKEN:-}" ]; then  # never echoed: the job log may be readable by others
  TOKEN_FILE="${POLAR_ADMIN_TOKEN_FILE:-polar-server-${SLURM_JOB_ID:-local}.token}"
  (umask 077 && rm -f "$TOKEN_FILE" && "$PY" -c 'import secrets; print(secrets.token_urlsafe(24))' > "$TOKEN_FILE")
  POLAR_ADMIN_TOKEN="$(cat "$TOKEN_FILE")"
  echo "admin token written to $TOKEN_FILE (mode 600)"
fi
export POLAR_ADMIN_TOKEN
"$PY" -m polar_gym.server --host 0.0.0.0 --port "$PORT" --db "$DB" "$@" &
child=$!
wait_http "http://127.0.0.1:$PORT/health" 120 "$child"
echo "POLAR_SERVER_URL=http://$HOST:$PORT"
run_child"""
    return _script(resources, doc, body)


def render_sglang(resources: SbatchResources | None = None) -> str:
    """``slurm/sglang.sbatch``: an SGLang server on a GPU node (for POLAR_UPSTREAM of gateways)."""
    resources = resources or SbatchResources("polar-sglang", cpus=16, mem="128G", gpus=1)
    doc = _doc("SGLang inference server (python -m sglang.launch_server) as a Slurm job.", [
        ("MODEL_PATH", "model directory or hub id (required)"),
        ("PORT", "listening port (default: 30000)"),
        ("TP_SIZE", "tensor parallel size (default: the GPUs Slurm gave, else 1)"),
        ("SGLANG_ARGS", "extra launch_server arguments, space-separated"),
        ("POLAR_SERVER_URL", "rollout server to add this backend to once healthy (unset: none)"),
        ("POLAR_ADMIN_TOKEN", "the rollout server's admin token (with POLAR_SERVER_URL)"),
        ("POLAR_ADVERTISE_HOST", "host gateways use to reach it (default: $(hostname))"),
        ("POLAR_PYTHON", "python with sglang installed (default: python3)"),
    ])
    body = """: "${MODEL_PATH:?MODEL_PATH must name the model to serve}"
PORT="${PORT:-30000}"
GPUS="${SLURM_GPUS_ON_NODE:-1}"
TP="${TP_SIZE:-$GPUS}"
read -r -a extra <<< "${SGLANG_ARGS:-}"
"$PY" -m sglang.launch_server --model-path "$MODEL_PATH" --host 0.0.0.0 --port "$PORT" --tp-size "$TP" \\
  ${extra[@]+"${extra[@]}"} "$@" &
child=$!
wait_http "http://127.0.0.1:$PORT/health" 1800 "$child"
echo "POLAR_UPSTREAM=http://$HOST:$PORT"
if [ -n "${POLAR_SERVER_URL:-}" ]; then
  "$PY" -c '@SNIPPET@' "${POLAR_SERVER_URL%/}/backends" "http://$HOST:$PORT"
fi
run_child""".replace("@SNIPPET@", _ADD_BACKEND_PY)
    return _script(resources, doc, body)


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


if __name__ == "__main__":  # pragma: no cover
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "slurm"
    for written in write_all(target):
        print(written)
