"""A real one-node Slurm (scripts/slurm_local.sh): the sbatch scripts run as jobs, register, and cancel cleanly.

Skips only when the daemons cannot start (no root / no apt); with CI set it fails instead.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from polar_gym.assets import tokenizer_dir

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "slurm_local.sh"


@pytest.fixture(scope="session")
def slurm_env() -> Iterator[dict[str, str]]:
    """Start the local Slurm for the session; the environment to submit with; stop it afterwards."""
    started = time.monotonic()
    proc = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or "export SLURM_CONF=" not in proc.stdout:
        reason = f"local Slurm daemons could not start: {proc.stderr.strip()[-2000:]}"
        subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=60)
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    conf = proc.stdout.strip().splitlines()[-1].split("=", 1)[1]
    print(f"local Slurm up in {time.monotonic() - started:.1f} s", file=sys.stderr)
    try:
        yield {**os.environ, "SLURM_CONF": conf}
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sbatch(env: dict[str, str], script: Path, cwd: Path, **variables: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", "--cpus-per-task=1", "--mem=512M", str(script)], cwd=cwd,
                         env={**env, **variables}, capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.strip().split(";")[0]


def _squeue(env: dict[str, str], job_ids: list[str]) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %T", "-j", ",".join(job_ids)], env=env, capture_output=True,
                         text=True, timeout=30)
    return [line for line in out.stdout.splitlines() if line.strip()]


def _wait_for(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _get_json(url: str, token: str) -> dict[str, object]:
    req = urllib.request.Request(url, headers={"x-admin-token": token})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def test_trivial_job_runs(slurm_env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "hello.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --output=hello-%j.out\necho \"hello from $SLURM_JOB_ID\"\n")
    job = _sbatch(slurm_env, script, tmp_path)
    out = tmp_path / f"hello-{job}.out"
    _wait_for(lambda: out.exists() and f"hello from {job}" in out.read_text() and not _squeue(slurm_env, [job]),
              60, f"job {job} to finish")


def test_server_and_gateway_sbatch_register_and_cancel_cleanly(slurm_env: dict[str, str], tmp_path: Path) -> None:
    if not (tokenizer_dir() / ".complete").exists():
        pytest.skip(f"the oracle engine's tokenizer {tokenizer_dir()} is not built (bash scripts/setup.sh)")
    token, server_port, gateway_port = "slurm-test-token", _free_port(), _free_port()
    common = {"POLAR_PYTHON": sys.executable, "POLAR_ADMIN_TOKEN": token, "POLAR_ADVERTISE_HOST": "127.0.0.1"}
    server_job = _sbatch(slurm_env, ROOT / "slurm" / "server.sbatch", tmp_path, PORT=str(server_port), **common)
    server_url = f"http://127.0.0.1:{server_port}"
    gateway_job = _sbatch(slurm_env, ROOT / "slurm" / "gateway.sbatch", tmp_path, PORT=str(gateway_port),
                          POLAR_ENGINE="oracle", POLAR_SERVER_URL=server_url, **common)
    jobs = [server_job, gateway_job]
    try:
        def registered() -> bool:
            try:
                gateways = _get_json(f"{server_url}/gateways", token)["gateways"]
            except OSError:
                return False
            return any(g["url"] == f"http://127.0.0.1:{gateway_port}" and g["state"] == "healthy"
                       for g in gateways)  # type: ignore[union-attr]

        _wait_for(registered, 120, "the gateway job to register with the server job")
        gateway_out = (tmp_path / f"polar-gateway-{gateway_job}.out").read_text()
        # the gateway registers itself (--server-url) since 252b5d6; gateway.sbatch no longer prints "registered:"
        assert f"registered with {server_url}" in gateway_out
        assert f"POLAR_SERVER_URL=http://127.0.0.1:{server_port}" in (tmp_path / f"polar-server-{server_job}.out")\
            .read_text()
    finally:
        subprocess.run(["scancel", *jobs], env=slurm_env, timeout=30)
    _wait_for(lambda: not _squeue(slurm_env, jobs), 60, "cancelled jobs to leave the queue")

    def port_closed(port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) != 0

    _wait_for(lambda: port_closed(server_port) and port_closed(gateway_port), 30, "services to stop after scancel")


def _sacct_states(env: dict[str, str], job_ids: list[str]) -> dict[str, str]:
    """Job id -> accounting state (first word: sacct says "CANCELLED by 0")."""
    out = subprocess.run(["sacct", "-j", ",".join(job_ids), "-o", "JobID,State", "-n", "-X", "--parsable2"],
                         env=env, capture_output=True, text=True, timeout=30)
    states = {}
    for line in out.stdout.splitlines():
        if "|" in line:
            job, state = line.split("|", 1)
            states[job] = state.split()[0] if state.strip() else ""
    return states


def test_accounting_reports_job_states(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """slurmdbd records jobs: sacct (and so submitit's job.state) sees COMPLETED and CANCELLED, not UNKNOWN."""
    def submit(command: str) -> str:
        out = subprocess.run(["sbatch", "--parsable", "--cpus-per-task=1", "--mem=64M", "--output=/dev/null",
                              "--wrap", command], cwd=tmp_path, env=slurm_env, capture_output=True, text=True,
                             check=True, timeout=60)
        return out.stdout.strip().split(";")[0]

    short, long = submit("true"), submit("sleep 300")
    try:
        _wait_for(lambda: _sacct_states(slurm_env, [long]).get(long) == "RUNNING", 60,
                  f"sacct to report job {long} RUNNING")
    finally:
        subprocess.run(["scancel", long], env=slurm_env, timeout=30)
    expected = {short: "COMPLETED", long: "CANCELLED"}
    try:
        _wait_for(lambda: _sacct_states(slurm_env, [short, long]) == expected, 60, f"sacct to report {expected}")
    except AssertionError as e:
        raise AssertionError(f"{e}; last seen {_sacct_states(slurm_env, [short, long])}") from None
