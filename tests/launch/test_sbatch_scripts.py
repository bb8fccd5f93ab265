"""The sbatch scripts under slurm/ run as a job would (``bash slurm/X.sbatch`` with a made-up Slurm environment, no
Slurm needed): a python without polar_gym, or a missing setting, gives one line per problem and exit 2 before
anything starts; state goes to the state directory and never to the submit directory; a token is never printed and
its file is mode 600; a valid configuration starts the real service.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from polar_gym.assets import cache_root, tokenizer_dir
from polar_gym.launch.preflight import SERVICES, main, prepare, problems, python_has_module
from tests._procs import processes_with
from tests._waiting import until_sync

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ["gateway", "server", "sglang"]
BARE_PYTHON = shutil.which("python3.11") or "/usr/bin/python3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Job:
    """One script run as a Slurm job would run it: its own HOME, submit directory and job id."""

    def __init__(self, tmp: Path, name: str, job_id: int, **variables: str) -> None:
        self.home, self.submit = tmp / "home", tmp / "submit"
        self.home.mkdir(exist_ok=True)
        self.submit.mkdir(exist_ok=True)
        self.log = tmp / f"{name}-{job_id}.out"
        self.state = self.home / ".local" / "state" / "polar_gym" / f"polar-{name}-{job_id}"
        self.script = ROOT / "slurm" / f"{name}.sbatch"
        self.env = {"PATH": os.environ["PATH"], "HOME": str(self.home), "SLURM_JOB_ID": str(job_id),
                    "SLURM_SUBMIT_DIR": str(self.submit), "POLAR_ADVERTISE_HOST": "127.0.0.1",
                    "POLAR_CACHE": str(cache_root()), **variables}  # the built tokenizer, not under this HOME
        self.proc: subprocess.Popen[bytes] | None = None

    def run(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(self.script)], cwd=self.submit, env=self.env, capture_output=True,
                              text=True, timeout=120)

    def start(self) -> Job:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(["bash", str(self.script)], cwd=self.submit, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT)
        return self

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, line: str, timeout: float = 120) -> None:
        def seen() -> bool:
            assert self.proc is not None and self.proc.poll() is None, f"job exited:\n{self.text()}"
            return line in self.text()
        until_sync(seen, timeout, f"{line!r} in the job log")

    def stop(self) -> int:
        """SIGTERM as scancel sends it; the job's exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def _problem_lines(result: subprocess.CompletedProcess[str], service: str) -> list[str]:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    return [line for line in result.stderr.splitlines() if line.startswith(f"polar_gym {service} job: ")]


@pytest.fixture(scope="module")
def venv_without_polar_gym(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("venv") / "bare"
    subprocess.run([BARE_PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    return venv / "bin" / "python"


@pytest.mark.parametrize("service", SCRIPTS)
@pytest.mark.parametrize("python", ["bare", "venv"])
def test_a_python_without_polar_gym_fails_at_once_saying_so(service: str, python: str, tmp_path: Path,
                                                             venv_without_polar_gym: Path) -> None:
    job = Job(tmp_path, service, 11, POLAR_PYTHON=BARE_PYTHON if python == "bare" else str(venv_without_polar_gym))
    lines = _problem_lines(job.run(), service)
    assert len(lines) == 1 and "cannot import polar_gym" in lines[0] and "POLAR_PYTHON" in lines[0], lines
    assert not list(job.submit.iterdir()) and not job.state.exists()


def test_polar_gym_without_its_dependencies_names_the_missing_module(tmp_path: Path,
                                                                     venv_without_polar_gym: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([BARE_PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "polar_gym_source.pth").write_text(f"{ROOT}\n")  # the package, none of its dependencies
    lines = _problem_lines(Job(tmp_path, "server", 12, POLAR_PYTHON=str(venv / "bin" / "python")).run(), "server")
    assert len(lines) == 1 and "has polar_gym but cannot import" in lines[0], lines


def test_a_python_that_does_not_exist_is_named(tmp_path: Path) -> None:
    lines = _problem_lines(Job(tmp_path, "gateway", 13, POLAR_PYTHON=str(tmp_path / "nope")).run(), "gateway")
    assert lines == [f"polar_gym gateway job: POLAR_PYTHON={tmp_path / 'nope'} not found: set POLAR_PYTHON to the "
                     "python of a polar_gym install (the clone's .venv/bin/python, made by bash scripts/setup.sh)"]


def test_the_clone_venv_is_found_from_the_submit_directory_when_sbatch_runs_a_copy(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    copy = spool / "slurm_script"
    shutil.copy(ROOT / "slurm" / "gateway.sbatch", copy)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SLURM_SUBMIT_DIR": str(ROOT)}
    found = subprocess.run(["bash", str(copy)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "POLAR_SERVER_URL is not set" in found.stderr  # polar_gym imported: the settings were checked
    env["SLURM_SUBMIT_DIR"] = str(spool)  # no clone around: python3, which has no polar_gym here
    bare = subprocess.run(["bash", str(copy)], cwd=spool, env=env, capture_output=True, text=True, timeout=120)
    assert bare.returncode == 2 and "cannot import polar_gym" in bare.stderr
    # submitted from elsewhere by its full path: Slurm knows the original (scontrol show job: Command=...)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "JobId=$4 JobName=polar-gateway Command={ROOT}/slurm/'
                                      'gateway.sbatch WorkDir=/elsewhere"\n')
    (bin_dir / "scontrol").chmod(0o755)
    env.update(SLURM_JOB_ID="31", PATH=f"{bin_dir}:{env['PATH']}")
    asked = subprocess.run(["bash", str(copy)], cwd=spool, env=env, capture_output=True, text=True, timeout=120)
    assert "POLAR_SERVER_URL is not set" in asked.stderr, asked.stderr


def test_gateway_names_every_missing_setting(tmp_path: Path) -> None:
    job = Job(tmp_path, "gateway", 21)
    lines = _problem_lines(job.run(), "gateway")
    assert [line.split(": ", 1)[1].split()[0] for line in lines[:-1]] == ["POLAR_SERVER_URL", "POLAR_UPSTREAM:"]
    assert "POLAR_ENGINE=oracle" in lines[1] and lines[-1].endswith("nothing was started (2 problem(s) above)")
    assert not list(job.submit.iterdir()) and not job.state.exists()


def _as_slurm_runs_it(job: Job) -> int:
    """The job with stdout and stderr on /dev/null, as the scripts' ``#SBATCH --output=/dev/null`` makes Slurm start
    it (no ``sbatch -o``)."""
    return subprocess.run(["bash", str(job.script)], cwd=job.submit, env=job.env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, timeout=120).returncode


@pytest.mark.parametrize("service", SCRIPTS)
def test_the_job_log_is_in_the_state_directory_not_the_submit_directory(service: str, tmp_path: Path) -> None:
    """Slurm expands no variable in #SBATCH lines, so the header sends Slurm's log to /dev/null and the job moves
    its output (the preflight's lines too) to $POLAR_STATE_DIR/job.log, mode 700 folder, before any check."""
    assert "#SBATCH --output=/dev/null" in (ROOT / "slurm" / f"{service}.sbatch").read_text()
    job = Job(tmp_path, service, 24, PORT="0")  # a bad port: the preflight fails, and says so in the log
    assert _as_slurm_runs_it(job) == 2
    log = (job.state / "job.log").read_text()
    assert f"polar_gym {service} job: " in log and "nothing was started" in log, log
    assert stat.S_IMODE(job.state.stat().st_mode) == 0o700
    assert not list(job.submit.iterdir())


def test_a_state_directory_that_cannot_be_made_puts_the_log_in_the_submit_directory_saying_why(
        tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    job = Job(tmp_path, "server", 25, POLAR_STATE_DIR=str(blocker / "state"))
    assert _as_slurm_runs_it(job) == 2
    log = (job.submit / "polar-server-25.out").read_text()
    assert log.startswith(f"polar_gym server job: POLAR_STATE_DIR={blocker / 'state'} cannot be created: this log is "
                          "in the submit directory instead\n"), log
    assert "POLAR_STATE_DIR" in log.splitlines()[1]  # then the preflight's own line about it


def test_gateway_joining_a_server_needs_the_servers_token(tmp_path: Path) -> None:
    job = Job(tmp_path, "gateway", 22, POLAR_SERVER_URL="http://127.0.0.1:9", POLAR_ENGINE="oracle",
              POLAR_ADMIN_TOKEN_FILE=str(tmp_path / "missing"), POLAR_CAPACITY="many")
    lines = _problem_lines(job.run(), "gateway")
    assert any(line.split(": ", 1)[1].startswith(f"POLAR_ADMIN_TOKEN_FILE={tmp_path / 'missing'} does not exist")
               for line in lines), lines
    assert any("POLAR_CAPACITY=many is not a positive integer" in line for line in lines), lines


def test_sglang_names_its_model_and_its_python(tmp_path: Path) -> None:
    lines = _problem_lines(Job(tmp_path, "sglang", 23, POLAR_SERVER_URL="http://127.0.0.1:9").run(), "sglang")
    text = "\n".join(lines)
    for needed in ("MODEL_PATH is not set", "cannot import sglang: set SGLANG_PYTHON", "POLAR_ADMIN_TOKEN"):
        assert needed in text


def test_a_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("secret-value\n")
    token_file.chmod(0o644)
    env = {"POLAR_ADMIN_TOKEN_FILE": str(token_file), "POLAR_STATE_DIR": str(tmp_path / "state")}
    assert problems("server", env) == [f"POLAR_ADMIN_TOKEN_FILE={token_file} is readable by others: chmod 600 "
                                       f"{token_file}"]
    token_file.chmod(0o600)
    assert problems("server", env) == []
    unwritable = tmp_path / "a-file"
    unwritable.write_text("")
    assert problems("server", {"POLAR_STATE_DIR": str(unwritable / "state"), "PORT": "0"}) == [
        "PORT=0 is not a positive integer",
        f"POLAR_STATE_DIR={unwritable / 'state'} cannot be created or written: set POLAR_STATE_DIR to a directory "
        "of yours (node-local scratch or your home)"]


def _get(url: str, token: str | None = None) -> dict[str, Any]:
    request = urllib.request.Request(url, headers={"x-admin-token": token} if token else {})
    with urllib.request.urlopen(request, timeout=5) as r:
        return dict(json.loads(r.read()))


@pytest.fixture
def server_job(tmp_path: Path) -> Iterator[Job]:
    job = Job(tmp_path, "server", 4242, PORT=str(_free_port())).start()
    try:
        yield job
    finally:
        job.stop()


def test_server_job_serves_keeps_state_off_the_submit_dir_and_never_logs_its_token(server_job: Job) -> None:
    url = f"http://127.0.0.1:{server_job.env['PORT']}"
    server_job.wait_for(f"POLAR_SERVER_URL={url}")
    assert _get(f"{url}/health")
    token_file = server_job.state / "admin-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(server_job.state.stat().st_mode) == 0o700
    token = token_file.read_text().strip()
    assert _get(f"{url}/gateways", token) == {"gateways": []}  # the file holds the token the server checks
    assert (server_job.state / "server.sqlite").is_file()
    assert f"POLAR_ADMIN_TOKEN_FILE={token_file}" in server_job.text()
    assert server_job.stop() in (0, 143)  # uvicorn re-raises the SIGTERM once it has shut down
    assert token not in server_job.text()
    assert not list(server_job.submit.iterdir())
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", int(server_job.env["PORT"]))) != 0


def test_scancel_while_the_service_starts_stops_it(tmp_path: Path) -> None:
    job = Job(tmp_path, "server", 4245, PORT=str(_free_port())).start()
    job.wait_for("state directory:")
    until_sync(lambda: processes_with(str(job.state / "server.sqlite")), 60, "the server process to start")
    job.stop()
    until_sync(lambda: not processes_with(str(job.state / "server.sqlite")), 60, "the server process to stop")


FAKE_SGLANG = '''"""A stand-in for sglang.launch_server: answers /health on --port (the script's contract)."""
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", port), Health).serve_forever()
'''


@pytest.mark.slow
def test_gateway_and_sglang_jobs_join_the_server_job_through_its_token_file(server_job: Job, tmp_path: Path) -> None:
    if not (tokenizer_dir() / ".complete").exists():
        pytest.skip(f"the oracle engine's tokenizer {tokenizer_dir()} is not built (bash scripts/setup.sh)")
    server_url = f"http://127.0.0.1:{server_job.env['PORT']}"
    server_job.wait_for(f"POLAR_SERVER_URL={server_url}")
    token_file = server_job.state / "admin-token"
    token = token_file.read_text().strip()
    gateway = Job(tmp_path, "gateway", 4243, PORT=str(_free_port()), POLAR_ENGINE="oracle",
                  POLAR_SERVER_URL=server_url, POLAR_ADMIN_TOKEN_FILE=str(token_file)).start()
    fake = tmp_path / "fake-sglang"
    (fake / "sglang").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text("")
    (fake / "sglang" / "launch_server.py").write_text(FAKE_SGLANG)
    wrapper = tmp_path / "sglang-python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={fake} exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    sglang = Job(tmp_path, "sglang", 4244, PORT=str(_free_port()), MODEL_PATH="Qwen/Qwen3-0.6B",
                 SGLANG_PYTHON=str(wrapper), POLAR_SERVER_URL=server_url,
                 POLAR_ADMIN_TOKEN_FILE=str(token_file)).start()
    try:
        gateway_url = f"http://127.0.0.1:{gateway.env['PORT']}"

        def registered() -> bool:
            assert gateway.proc is not None and gateway.proc.poll() is None, gateway.text()
            gateways = _get(f"{server_url}/gateways", token)["gateways"]
            return any(g["url"] == gateway_url and g["state"] == "healthy" for g in gateways)

        until_sync(registered, 120, "the gateway job to register with the server job")
        sglang.wait_for("backend added:")
        assert _get(f"{server_url}/backends", token)["backends"] == [f"http://127.0.0.1:{sglang.env['PORT']}"]
        assert gateway.state.is_dir() and f"state directory: {gateway.state}" in gateway.text()
        assert not (gateway.state / "admin-token").exists()  # it used the server's, and wrote none of its own
    finally:
        codes = [gateway.stop(), sglang.stop()]
    for job in (server_job, gateway, sglang):
        assert token not in job.text()
    assert set(codes) <= {0, 143}, codes  # 143: the service ended by the SIGTERM it was sent
    until_sync(lambda: not processes_with(str(gateway.state)) and not processes_with(str(fake)), 30,
               "every process of the stopped jobs to end")
    assert not list(server_job.submit.iterdir())


def test_preflight_checks_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The same checks called directly: each problem names its variable; prepare() makes the state and the token."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    gateway = problems("gateway", {"POLAR_SERVER_URL": "node:8700", "POLAR_ENGINE": "oracle",
                                   "POLAR_ADMIN_TOKEN": "t", "POLAR_WORKDIR": str(a_file / "work")})
    assert gateway == ["POLAR_SERVER_URL=node:8700 is not an http(s) URL",
                       f"POLAR_WORKDIR={a_file / 'work'} cannot be created or written"]
    assert problems("gateway", {"POLAR_SERVER_URL": "none", "POLAR_ENGINE": "no-such-engine"})[0].startswith(
        "POLAR_ENGINE: ")
    sglang = problems("sglang", {"MODEL_PATH": str(tmp_path / "missing"), "TP_SIZE": "two"},
                      has_module=lambda python, module: module != "sglang")
    assert [line.split(" ", 1)[0] for line in sglang] == [f"MODEL_PATH={tmp_path / 'missing'}",
                                                         f"SGLANG_PYTHON={sys.executable}", "TP_SIZE=two"]
    joining = problems("gateway", {"POLAR_SERVER_URL": "http://node:8700", "POLAR_ENGINE": "oracle"})
    assert joining == ["no admin token given: set POLAR_ADMIN_TOKEN_FILE to the rollout server's token file "
                       "(server.sbatch prints its path) or export POLAR_ADMIN_TOKEN"]
    assert problems("gateway", {"POLAR_SERVER_URL": "http://node:8700", "POLAR_ENGINE": "oracle",
                                "POLAR_SERVER_TOKEN": "t"}) == []  # its own token is minted; the server's is given
    assert problems("sglang", {"POLAR_SERVER_URL": "http://node:8700"}, has_module=lambda python, module: True) == [
        "MODEL_PATH is not set: set it to the model directory or hub id to serve", joining[0]]
    monkeypatch.setitem(SERVICES, "server", ("no_such_module_here",))
    assert "has polar_gym but cannot import no_such_module_here" in problems("server", {})[0]
    monkeypatch.undo()
    assert python_has_module(sys.executable, "json") and not python_has_module(sys.executable, "no_such_module_here")
    assert not python_has_module(str(tmp_path / "no-python"), "json")

    env = {"POLAR_STATE_DIR": str(tmp_path / "state"), "POLAR_ADMIN_TOKEN_FILE": str(tmp_path / "state" / "tok")}
    assert prepare("server", env)[1] == f"admin token written to {tmp_path / 'state' / 'tok'} (mode 600)"
    assert stat.S_IMODE((tmp_path / "state" / "tok").stat().st_mode) == 0o600
    assert prepare("server", env)[1] == f"admin token read from {tmp_path / 'state' / 'tok'}"
    assert prepare("gateway", {**env, "POLAR_ADMIN_TOKEN_FILE": str(tmp_path / "g")}) == [
        f"state directory: {tmp_path / 'state'}"]  # a gateway without a token mints its own (its CLI)
    assert not (tmp_path / "g").exists()

    assert main(["nope"]) == 2
    monkeypatch.setattr(os, "environ", {**env, "PORT": "8700"})
    assert main(["server"]) == 0 and "admin token read from" in capsys.readouterr().out
    monkeypatch.setattr(os, "environ", {**env, "PORT": "-1"})
    assert main(["server"]) == 2
    assert capsys.readouterr().err.splitlines() == ["polar_gym server job: PORT=-1 is not a positive integer",
                                                    "polar_gym server job: nothing was started (1 problem(s) above)"]
