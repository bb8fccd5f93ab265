"""Slurm as an unprivileged user: root starts the local one-node Slurm (scripts/slurm_local.sh, the instance the
SLURM_LOCAL_* variables name), and ``polar-ci`` submits from its own clone (tests/unprivileged/_user_kit.py):
``python -m polar_gym.launch launcher=slurm`` (pi on the demo tasks, the oracle engine) runs its gateway job as the
user, every session completes, and the output folder is the user's with private modes where a token is; and
``sbatch slurm/server.sbatch`` + ``gateway.sbatch`` run as the user's jobs, keep their state and their job logs in
the user's state directory (nothing in the submit directory), and never print a token."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.unprivileged._user_kit import ROOT, USER, UserClone, as_user

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SCRIPT = ROOT / "scripts" / "slurm_local.sh"
LAUNCH_SMALL = ("launcher=slurm launcher.server_host=127.0.0.1 launcher.advertise_host=127.0.0.1 "
                "launcher.progress=false launcher.gateway.cpus_per_task=1 launcher.gateway.mem_gb=1 "
                "launcher.gateway.run_slots=2 launcher.heartbeat_seconds=1 launcher.register_timeout_seconds=180")


@pytest.fixture(scope="session")
def slurm_conf() -> Iterator[str]:
    """The local Slurm, started by root with this process's SLURM_LOCAL_* (idempotent: tests/launch's fixture may
    have started it); its SLURM_CONF, which the user reads."""
    proc = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or "export SLURM_CONF=" not in proc.stdout:
        reason = f"local Slurm daemons could not start: {proc.stderr.strip()[-2000:]}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield proc.stdout.strip().splitlines()[-1].split("=", 1)[1]
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=120)


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sacct_users(conf: str, clone: UserClone, job_ids: list[str]) -> dict[str, str]:
    out = as_user(f"sacct -n -X -P -o jobid,user -j {','.join(job_ids)}", cwd=clone.home, timeout=60,
                  env={"SLURM_CONF": conf})
    return dict(line.split("|", 1) for line in out.stdout.split())


def _assert_run_as_the_user(conf: str, clone: UserClone, job_ids: list[str]) -> None:
    """Every job is in accounting as the user's. Waited for: right after a submit and a cancel, slurmdbd may not have
    every job's record yet (once, on a loaded machine, a job read as root's)."""
    users: dict[str, str] = {}

    def recorded() -> bool:
        users.clear()
        users.update(_sacct_users(conf, clone, job_ids))
        return set(users) >= set(job_ids) and set(users.values()) == {USER}

    with contextlib.suppress(AssertionError):
        _wait_for(recorded, 60, "accounting to record the jobs")
    assert set(users) >= set(job_ids) and set(users.values()) == {USER}, users


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def test_launcher_slurm_as_an_unprivileged_user(user_clone: UserClone, slurm_conf: str) -> None:
    out = user_clone.home / "runs" / "slurm"
    as_user(f"rm -rf {out}", cwd=user_clone.home, timeout=60)
    run = as_user(f".venv/bin/python -m polar_gym.launch {LAUNCH_SMALL} out_dir={out}", cwd=user_clone.clone,
                  timeout=900, env={"SLURM_CONF": slurm_conf})
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-4000:])
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(results) == 4 and all(r["status"] == "COMPLETED" and r["evaluation"]["reward"] == 1.0
                                     for r in results), results
    jobs = [j["job_id"] for j in json.loads((out / "jobs.json").read_text())]
    assert jobs
    _assert_run_as_the_user(slurm_conf, user_clone, jobs)
    uid = pwd.getpwnam(USER).pw_uid
    assert [p for p in out.rglob("*") if p.lstat().st_uid != uid] == []  # every file the run made is the user's
    token = json.loads((out / "server.json").read_text())["admin_token"]
    holders = [p for p in out.rglob("*") if p.is_file() and not p.is_symlink() and token.encode() in p.read_bytes()]
    assert holders and [p for p in holders if p.stat().st_mode & 0o077] == [], "a token file others can read"
    for private in (out / "slurm", out / "gateways" / "gateway-0"):
        assert stat.S_IMODE(private.stat().st_mode) == 0o700, private
    assert stat.S_IMODE((out / "gateways" / "gateway-0" / "admin-token").stat().st_mode) == 0o600


def test_the_sbatch_scripts_as_an_unprivileged_user(user_clone: UserClone, slurm_conf: str) -> None:
    """The README's bare ``sbatch slurm/server.sbatch`` then ``gateway.sbatch``, by the user from a submit folder of
    its own: the state and the job logs land in ~/.local/state/polar_gym/JOBNAME-JOBID (mode 700), the token in a
    600 file and never in a log, and the submit folder stays empty."""
    submit = user_clone.home / "submit"
    as_user(f"rm -rf {submit} && mkdir {submit}", cwd=user_clone.home, timeout=60)
    port, gateway_port = _free_port(), _free_port()
    env = {"SLURM_CONF": slurm_conf, "POLAR_ADVERTISE_HOST": "127.0.0.1"}

    def sbatch(script: str, **variables: str) -> str:
        done = as_user(f"sbatch --parsable --cpus-per-task=1 --mem=512M {user_clone.clone}/slurm/{script}",
                       cwd=submit, timeout=60, env={**env, **variables})
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    state = user_clone.home / ".local" / "state" / "polar_gym"
    jobs = [sbatch("server.sbatch", PORT=str(port))]
    try:
        server_log = state / f"polar-server-{jobs[0]}" / "job.log"
        _wait_for(lambda: f"POLAR_SERVER_URL=http://127.0.0.1:{port}" in _read(server_log), 180,
                  "the server job's log in its state directory")
        token_file = server_log.parent / "admin-token"
        jobs.append(sbatch("gateway.sbatch", PORT=str(gateway_port), POLAR_ENGINE="oracle",
                           POLAR_SERVER_URL=f"http://127.0.0.1:{port}", POLAR_ADMIN_TOKEN_FILE=str(token_file)))
        gateway_log = state / f"polar-gateway-{jobs[1]}" / "job.log"
        _wait_for(lambda: f"registered with http://127.0.0.1:{port}" in _read(gateway_log), 180,
                  "the gateway job to register and log it in its state directory")
    finally:
        as_user(f"scancel {' '.join(jobs)}", cwd=user_clone.home, timeout=60, env=env)
    _assert_run_as_the_user(slurm_conf, user_clone, jobs)
    token = token_file.read_text().strip()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and token_file.stat().st_uid == pwd.getpwnam(USER).pw_uid
    for log in (server_log, gateway_log):
        assert stat.S_IMODE(log.parent.stat().st_mode) == 0o700
        assert token not in log.read_text()
    assert (server_log.parent / "server.sqlite").is_file()
    assert list(submit.iterdir()) == []
