"""A real one-node Slurm (scripts/slurm_local.sh): the sbatch scripts run as jobs, register, and cancel cleanly.

Skips only when the daemons cannot start (no root / no apt); with CI set it fails instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from polar_gym.assets import TINY_MODEL_NAME, tokenizer_dir
from tests._procs import take_ctrl_c
from tests._vllm import VLLMServer, load_stock_weights

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
    state = tmp_path.parent / f"{tmp_path.name}-state"  # the jobs' state, away from the submit directory
    server_job = _sbatch(slurm_env, ROOT / "slurm" / "server.sbatch", tmp_path, PORT=str(server_port),
                         POLAR_STATE_DIR=str(state / "server"), **common)
    server_url = f"http://127.0.0.1:{server_port}"
    gateway_job = _sbatch(slurm_env, ROOT / "slurm" / "gateway.sbatch", tmp_path, PORT=str(gateway_port),
                          POLAR_ENGINE="oracle", POLAR_SERVER_URL=server_url, POLAR_STATE_DIR=str(state / "gateway"),
                          **common)
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
        # the gateway registers itself (--server-url) since 252b5d6; gateway.sbatch no longer prints "registered:".
        # It logs that once the server has answered, so the server may list it a moment before the line is written.
        gateway_out = state / "gateway" / "job.log"  # the job log is in the state dir (slurm/*.sbatch's header)
        _wait_for(lambda: f"registered with {server_url}" in gateway_out.read_text(), 30,
                  "the gateway job to log its registration")
        assert f"POLAR_SERVER_URL=http://127.0.0.1:{server_port}" in (state / "server" / "job.log").read_text()
    finally:
        subprocess.run(["scancel", *jobs], env=slurm_env, timeout=30)
    _wait_for(lambda: not _squeue(slurm_env, jobs), 60, "cancelled jobs to leave the queue")

    def port_closed(port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) != 0

    _wait_for(lambda: port_closed(server_port) and port_closed(gateway_port), 30, "services to stop after scancel")
    # nothing in the submit directory: the logs, the db and the session directories are in the state directories
    assert list(tmp_path.iterdir()) == []
    assert (state / "server" / "server.sqlite").is_file() and (state / "gateway").is_dir()
    assert token not in gateway_out.read_text()


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


# -- launcher=slurm (submitit) -------------------------------------------------------------------------------------

LAUNCH_SMALL = ["launcher=slurm", "launcher.server_host=127.0.0.1", "launcher.advertise_host=127.0.0.1",
                "launcher.progress=false", "launcher.gateway.cpus_per_task=1", "launcher.gateway.mem_gb=1",
                "launcher.gateway.run_slots=2", "launcher.heartbeat_seconds=1", "launcher.register_timeout_seconds=180"]


def _launch(env: dict[str, str], out: Path, *overrides: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "polar_gym.launch", *LAUNCH_SMALL, *overrides, f"out_dir={out}"],
                            cwd=ROOT, env={**env, "COLUMNS": "160"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=take_ctrl_c)


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """The launch's output once it exited; if it does not within ``timeout``, it gets Ctrl-C (so it still cancels
    its Slurm jobs), then SIGKILL, and the test fails."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def _job_ids(out: Path) -> dict[str, str]:
    """name -> job id of every job the launcher submitted (its jobs.json)."""
    return {j["name"]: j["job_id"] for j in json.loads((out / "jobs.json").read_text())}


def _assert_no_job_left(env: dict[str, str], ids: list[str]) -> None:
    assert ids
    assert not _squeue(env, ids), f"jobs left in the queue: {_squeue(env, ids)}"
    states = _sacct_states(env, ids)
    assert set(states) == set(ids) and all(s == "CANCELLED" for s in states.values()), states


def _results(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def _needs_tokenizer() -> None:
    if not (tokenizer_dir() / ".complete").exists():
        pytest.fail(f"the oracle engine's tokenizer {tokenizer_dir()} is not built (bash scripts/setup.sh)")


def test_launcher_slurm_runs_demo_tasks_on_gateway_jobs_and_cancels_them(slurm_env: dict[str, str],
                                                                          tmp_path: Path) -> None:
    _needs_tokenizer()
    out = tmp_path / "run"
    proc = _launch(slurm_env, out, "launcher.gateways=2", "num_samples=2")
    _, stderr = _finish(proc, 600)
    assert proc.returncode == 0, stderr[-4000:]
    jobs = _job_ids(out)
    assert sorted(jobs) == ["polar-gateway-0", "polar-gateway-1"]
    results = _results(out)
    assert len(results) == 8 and all(r["status"] == "COMPLETED" and r["evaluation"]["reward"] == 1.0  # type: ignore[index]
                                     for r in results)
    with contextlib.closing(sqlite3.connect(out / "server.sqlite")) as db:
        used = {g for (g,) in db.execute("SELECT DISTINCT gateway_id FROM sessions")}
        gateways = db.execute("SELECT COUNT(*) FROM gateways").fetchone()[0]
    assert gateways == 2 and len(used) == 2, "both gateway jobs registered and ran sessions"
    # the gateways' sandboxes ran inside the jobs: their session directories are under the run's folder
    assert len(list((out / "gateways").glob("gateway-*/*/*/artifacts"))) == 8
    # issue 11 fault 3: the submitit folder (its pickles carry the server token) is 700, every file holding the
    # token is 600, and the gateway jobs wrote their own fresh tokens to 600 files instead of their logs
    token = json.loads((out / "server.json").read_text())["admin_token"]
    assert (out / "slurm").stat().st_mode & 0o777 == 0o700
    holders = [p for p in out.rglob("*") if p.is_file() and token.encode() in p.read_bytes()]
    assert any(p.suffix == ".pkl" for p in holders) and [p for p in holders if p.stat().st_mode & 0o077] == []
    for i in range(2):
        gateway_token = (out / "gateways" / f"gateway-{i}" / "admin-token").read_text().strip()
        assert (out / "gateways" / f"gateway-{i}" / "admin-token").stat().st_mode & 0o077 == 0
        assert not [p for p in (out / "slurm").rglob("*") if p.is_file() and gateway_token.encode() in p.read_bytes()]
    _wait_for(lambda: not _squeue(slurm_env, list(jobs.values())), 60, "the gateway jobs to leave the queue")
    _wait_for(lambda: set(_sacct_states(slurm_env, list(jobs.values())).values()) == {"CANCELLED"}, 60,
              "sacct to record the cancelled gateway jobs")
    _assert_no_job_left(slurm_env, list(jobs.values()))


def test_cancelling_the_launch_leaves_no_job_behind(slurm_env: dict[str, str], tmp_path: Path) -> None:
    _needs_tokenizer()
    out = tmp_path / "run"
    proc = _launch(slurm_env, out, "launcher.server=job", "num_samples=20", "launcher.gateway.run_slots=1")
    try:
        def running() -> bool:
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            if not (out / "server.sqlite").exists():
                return False
            with contextlib.closing(sqlite3.connect(out / "server.sqlite")) as db:
                try:
                    return db.execute("SELECT COUNT(*) FROM sessions WHERE status='COMPLETED'").fetchone()[0] > 0
                except sqlite3.OperationalError:  # the server job created the file but not its tables yet
                    return False

        _wait_for(running, 300, "the first session to finish on the Slurm fleet")
        jobs = _job_ids(out)
        assert sorted(jobs) == ["polar-gateway-0", "polar-server"]  # the rollout server ran as a job too
        proc.send_signal(signal.SIGINT)
        _, stderr = _finish(proc, 300)
    finally:
        _stop(proc)
    assert proc.returncode == 130, stderr[-4000:]
    assert "interrupted" in stderr
    _wait_for(lambda: set(_sacct_states(slurm_env, list(jobs.values())).values()) == {"CANCELLED"}, 60,
              "sacct to record every job cancelled")
    _assert_no_job_left(slurm_env, list(jobs.values()))


def test_a_run_hands_over_when_told_and_finishes_every_session_once(slurm_env: dict[str, str],
                                                                   tmp_path: Path) -> None:
    """A launch in a Slurm job hands over when its batch script gets SIGUSR1 (what ``sbatch --signal=B:USR1@N`` and
    ``scancel --batch --signal=USR1`` send), twice, in a chain: each successor takes the unfinished sessions from the
    store; every session ends once, COMPLETED, in one attempt. Each job is told once it has finished sessions of its
    own, so the chain does not hang on how fast the machine is. The time-limit trigger is armed from the limit squeue
    reports (the console line), and fires in tests/launch/test_relaunch_units.py. The harness is
    docs/harnesses/agent.py from a config folder of the user's own (``--config-dir``, which the hand-over passes on):
    sessions of a harness CLI would cost CPU this test is not about."""
    if not (tokenizer_dir() / ".complete").exists():
        pytest.skip(f"the oracle engine's tokenizer {tokenizer_dir()} is not built (bash scripts/setup.sh)")
    out = tmp_path / "run"
    out.mkdir()
    sessions = 24
    command = [sys.executable, "-m", "polar_gym.launch", "--config-dir", str(_agent_conf(tmp_path)), "+harness=agent",
               "tasks.ids=[demo-calc-add]", f"num_samples={sessions}", "launcher.run_slots=2",
               "launcher.progress=false", "timeout_seconds=30", "relaunch.enabled=true", "relaunch.margin_seconds=60",
               f"out_dir={out}"]
    first = _sbatch_launch(slurm_env, command, out, "polar-relay", "--time=10", "--cpus-per-task=2", "--mem=4G")
    try:
        job = first
        for _ in range(2):  # each job finishes three sessions of its own, then is told to hand over
            job = _tell_to_hand_over(slurm_env, out, job, sessions_of_its_own=3)
        _wait_for(lambda: _chain_done(slurm_env, "polar-relay", out / "summary.md", out), 300,
                  "the chain of jobs to finish the run")
    finally:
        subprocess.run(["scancel", "-n", "polar-relay"], env=slurm_env, timeout=30)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(out.glob("*.log")))
    rows = [json.loads(line) for line in (out / "relaunches.jsonl").read_text().splitlines()]
    assert len(rows) == 2, logs
    assert rows[0]["job_id"] == first and rows[1]["job_id"] == rows[0]["successor"]
    assert [r["relaunch"] for r in rows] == [1, 2] and {r["trigger"] for r in rows} == {"SIGUSR1"}
    assert all(r["cut_sessions"] == 0 for r in rows), rows  # every running session finished in its job
    armed = re.search(r"hands over 60 s before its limit \(in (\d+) s\)", (out / f"first-{first}.log").read_text())
    assert armed is not None and 450 < int(armed[1]) <= 540, logs  # 600 s limit, 60 s margin, the start-up taken
    states = _sacct_states(slurm_env, [first, *(r["successor"] for r in rows)])
    assert set(states.values()) == {"COMPLETED"}, states
    stored = _stored_sessions(out)
    assert len(stored) == sessions and {s for _, s, _ in stored} == {"COMPLETED"}, stored
    assert {a for _, _, a in stored} == {1}, stored  # nothing ran twice
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["session_id"] for r in results) == sorted(s for s, _, _ in stored)  # each once, in the last job
    assert {r["harness"] for r in results} == {"shell"}


def _sbatch_launch(env: dict[str, str], command: list[str], out: Path, name: str, *resources: str) -> str:
    """Submit ``command`` as a batch job whose script runs it with ``exec`` (as a hand-over submits the successor), so a
    signal to the batch script reaches the launch."""
    return subprocess.run(["sbatch", "--parsable", *resources, f"--job-name={name}", f"--output={out}/first-%j.log",
                           f"--chdir={ROOT}", "--wrap", f"exec {shlex.join(command)}"], env=env, capture_output=True,
                          text=True, check=True, timeout=60).stdout.strip().split(";")[0]


def _stored_sessions(out: Path) -> list[tuple[str, str, int]]:
    """(session id, status, attempts) of every session in the run's store; none while it is not created yet."""
    if not (out / "server.sqlite").exists():
        return []
    with contextlib.closing(sqlite3.connect(f"file:{out / 'server.sqlite'}?mode=ro", uri=True, timeout=30)) as db:
        try:
            return db.execute("SELECT session_id, status, attempts FROM sessions").fetchall()
        except sqlite3.OperationalError:  # the launch has not made its tables yet
            return []


def _tell_to_hand_over(env: dict[str, str], out: Path, job: str, *, sessions_of_its_own: int) -> str:
    """Once ``job`` is running and has completed ``sessions_of_its_own`` sessions (counted from when its
    predecessor ended), SIGUSR1 to its batch script; its successor, once it has submitted one and ended."""
    before = sum(1 for _, status, _ in _stored_sessions(out) if status == "COMPLETED")
    _wait_for(lambda: sum(1 for _, status, _ in _stored_sessions(out) if status == "COMPLETED")
              >= before + sessions_of_its_own, 300, f"job {job} to complete {sessions_of_its_own} sessions")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True, timeout=30)
    relaunches = out / "relaunches.jsonl"

    def successor() -> str | None:
        rows = [json.loads(line) for line in relaunches.read_text().splitlines()] if relaunches.exists() else []
        return next((r["successor"] for r in rows if r["job_id"] == job), None)

    _wait_for(lambda: successor() is not None and not _squeue(env, [job]), 300, f"job {job} to hand over and end")
    return str(successor())


def _agent_conf(root: Path) -> Path:
    """A config folder whose ``harness/agent.yaml`` is the shell harness running docs/harnesses/agent.py (as
    docs/harnesses/custom.md writes it)."""
    agent = (ROOT / "docs" / "harnesses" / "agent.py").read_text()
    (root / "conf" / "harness").mkdir(parents=True)
    (root / "conf" / "harness" / "agent.yaml").write_text(json.dumps(
        {"name": "shell", "model_name": "policy",
         "config": {"command": 'python3 agent.py "$1"', "files": {"agent.py": agent}}}))
    return root / "conf"


def test_a_grpo_run_hands_over_and_trains_every_step_once(slurm_env: dict[str, str], tmp_path: Path,
                                                          vllm_train_server: VLLMServer) -> None:
    """A GRPO run on the real vLLM (fp32, weight reloads) in a Slurm job told to hand over (SIGUSR1) while its
    first step's sessions run: the job finishes that step (trains, saves) and hands over at the step boundary; the
    successor resumes after the last saved step (weights, optimizer, the feed's groups) and pushes it to the engine
    first. Steps 1 and 2 each once, each sampled by the version of the step before; every session once, in one
    attempt. The task is a stranger's Harbor task whose verifier takes 8 s (:func:`_slow_task`). That a successor
    hands over again, in a chain, is the plain run's test above: the hand-over is the same code in both."""
    out = tmp_path / "grpo"
    out.mkdir()
    steps, samples = 2, 2
    command = [sys.executable, "-m", "polar_gym.launch", "+trainer=grpo", f"trainer.steps={steps}",
               "trainer.learning_rate=1e-3", "inference=vllm", f"inference.upstreams=[{vllm_train_server.url}]",
               f"inference.upstream_model={TINY_MODEL_NAME}", "inference.max_tokens_cap=48", "tasks=harbor",
               f"tasks.path={_slow_task(tmp_path)}", f"num_samples={samples}", "launcher.run_slots=2",
               "launcher.progress=false", "timeout_seconds=60", "relaunch.enabled=true",
               "relaunch.margin_seconds=60", f"out_dir={out}"]
    first = _sbatch_launch(slurm_env, command, out, "polar-grpo-relay", "--time=10", "--cpus-per-task=2",
                           "--mem=6G")
    checkpoints = out / "trainer" / "checkpoints"
    try:
        # step 1's sessions are under way (past what a drain withdraws): the job must finish the step first
        _wait_for(lambda: len([s for _, s, _ in _stored_sessions(out) if s not in _NOT_STARTED]) >= samples, 300,
                  "the first step's sessions to run")
        subprocess.run(["scancel", "--batch", "--signal=USR1", first], env=slurm_env, check=True, timeout=30)
        _wait_for(lambda: not _squeue(slurm_env, [first]), 300, f"job {first} to hand over and end")
        assert (checkpoints / "step-1" / "state").is_dir() and not (checkpoints / "step-2").exists()
        _wait_for(lambda: _chain_done(slurm_env, "polar-grpo-relay", checkpoints / f"step-{steps}" / "state", out),
                  600, "the chain of jobs to finish the GRPO run")
    finally:
        subprocess.run(["scancel", "-n", "polar-grpo-relay"], env=slurm_env, timeout=30)
        load_stock_weights(vllm_train_server)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(out.glob("*.log")))
    rows = [json.loads(line) for line in (out / "relaunches.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["job_id"] == first and rows[0]["trigger"] == "SIGUSR1", logs
    assert rows[0]["cut_sessions"] == 0, rows  # the hand-over waited for the step's sessions
    states = _sacct_states(slurm_env, [first, rows[0]["successor"]])
    assert set(states.values()) == {"COMPLETED"}, (states, logs)
    train = [json.loads(line) for line in (out / "trainer" / "train_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in train] == list(range(1, steps + 1)), logs  # continuous, each step once
    assert [r["sampled_versions"] for r in train] == [[str(n)] for n in range(steps)], logs
    assert all(r["sessions"] == samples and r["errored"] == 0 for r in train), train
    stored = _stored_sessions(out)
    assert len(stored) == steps * samples and {s for _, s, _ in stored} == {"COMPLETED"}, stored
    assert {a for _, _, a in stored} == {1}, stored  # nothing ran twice
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["session_id"] for r in results) == sorted(s for s, _, _ in stored)  # each once


#: the states a drain withdraws to the queue (a session in them has not started running)
_NOT_STARTED = {"REGISTERED", "INITIALIZING", "READY"}


def _slow_task(root: Path) -> Path:
    """A Harbor task whose verifier sleeps 8 s: a GRPO step on it is still under way a few seconds after its
    sessions start running, when the test tells the job to hand over, so the job stops after that step."""
    task = root / "tasks" / "slow-check"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "solution").mkdir()
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\necho lighthouse > /app/answer.txt\n")
    (task / "task.toml").write_text('version = "1.0"\n\n[verifier]\ntimeout_sec = 60.0\n\n[agent]\n'
                                    'timeout_sec = 60.0\n')
    (task / "instruction.md").write_text("Write the word lighthouse to /app/answer.txt.\n")
    (task / "environment" / "Dockerfile").write_text("FROM python:3.12-slim\nWORKDIR /app\n")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\nsleep 8\ngrep -qx lighthouse /app/answer.txt && echo 1 "
                                           "> /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")
    return task.parent


def _chain_done(env: dict[str, str], name: str, last_file: Path, out: Path) -> bool:
    """No job of the chain ``name`` is queued or running, and the run's ``last_file`` is there (else the chain broke:
    AssertionError with the jobs' logs)."""
    def queued() -> list[str]:
        return subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], env=env, capture_output=True, text=True,
                              timeout=30).stdout.split()

    if queued():
        return False
    time.sleep(1)  # a successor is queued by sbatch before its predecessor leaves the queue: look twice
    left = queued()
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(out.glob("*.log")))
    assert left or last_file.exists(), f"the chain ended before the run did:\n{logs}"
    return not left
