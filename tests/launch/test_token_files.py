"""Issue 11, fault 3 (token files): a file that must hold an admin token is readable by its owner only (mode 600,
its directory 700 where it holds only secrets) and no token is printed to a log other users may read: the submitit
folder, the sbatch scripts and ``python -m polar_gym.gateway`` / ``polar_gym.proxy`` started without a token (a local
launch's out_dir: tests/launch/test_launch_outputs.py). Real processes, real files."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.launch.slurm import render_all
from polar_gym.launch.submitit_launcher import SlurmLauncher, SlurmLauncherSettings
from polar_gym.private_files import write_secret
from tests._procs import processes_with
from tests._serving import free_port

ROOT = Path(__file__).resolve().parents[2]
SLURM_DIR = ROOT / "slurm"


def _private(path: Path) -> bool:
    return path.stat().st_mode & 0o077 == 0


def _files_containing(root: Path, needle: str) -> list[Path]:
    data = needle.encode()
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and data in p.read_bytes()]


def _needs_assets() -> None:
    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")


def test_write_secret_makes_an_existing_world_readable_file_private(tmp_path: Path) -> None:
    path = tmp_path / "server.json"
    path.write_text("old")
    path.chmod(0o644)
    write_secret(path, "new")
    assert path.read_text() == "new" and _private(path) and [p.name for p in tmp_path.iterdir()] == ["server.json"]


def test_the_submitit_folder_and_what_submitit_writes_into_it_are_private(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    os.umask(umask)
    launcher = SlurmLauncher(SlurmLauncherSettings(cluster="local"))
    job = type("Job", (), {"out_dir": tmp_path})()
    executor = launcher._executor(job, "polar-test", timeout_min=1)
    submitted = launcher._submit(executor, "polar-test", print, "a-secret-token", out_dir=tmp_path)
    submitted.result()
    folder = tmp_path / "slurm"
    assert folder.stat().st_mode & 0o777 == 0o700
    written = [p for p in folder.rglob("*") if p.is_file()]
    assert any(p.suffix == ".pkl" for p in written) and _files_containing(folder, "a-secret-token")
    assert [p for p in written if not _private(p)] == []
    now = os.umask(umask)
    assert now == umask  # the launcher's own umask is back once submitted


@pytest.mark.parametrize("name", sorted(render_all()))
def test_no_sbatch_script_prints_a_token(name: str) -> None:
    text = render_all()[name]
    assert not re.search(r"(echo|printf|print)[^\n]*\$\{?POLAR_(ADMIN|SERVER)_TOKEN\b", text), name
    assert "admin token: " not in text


@contextlib.contextmanager
def _script(name: str, cwd: Path, **env: str) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """Run slurm/NAME with bash the way a Slurm job would (output to a log file in the submit directory)."""
    log = cwd / f"{name}.log"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("POLAR_", "SLURM_"))}
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", str(SLURM_DIR / name)], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True,
                                env={**base, "POLAR_PYTHON": sys.executable, "POLAR_ADVERTISE_HOST": "127.0.0.1",
                                     "SLURM_SUBMIT_DIR": str(cwd), "PYTHONPATH": str(ROOT), **env})
        try:
            yield proc, log
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait_for_line(proc: subprocess.Popen[str], log: Path, needle: str, timeout: float = 180) -> str:
    deadline = time.monotonic() + timeout
    while needle not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    return log.read_text()


def test_server_sbatch_writes_a_fresh_token_to_a_private_file_and_never_prints_it(tmp_path: Path) -> None:
    port = free_port()
    with _script("server.sbatch", tmp_path, PORT=str(port), POLAR_DB=str(tmp_path / "srv.sqlite"),
                 POLAR_STATE_DIR=str(tmp_path / "state")) as (proc, log):
        text = _wait_for_line(proc, log, "POLAR_SERVER_URL=")
        token_file = tmp_path / "state" / "admin-token"
        token = token_file.read_text().strip()
        assert f"admin token written to {token_file} (mode 600)" in text and token not in text
        assert _private(token_file)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/gateways", headers={"x-admin-token": token}).status_code == 200
        assert httpx.get(f"{base}/gateways").status_code == 401


def test_gateway_without_a_token_writes_it_to_a_private_file_and_prints_only_the_path(tmp_path: Path) -> None:
    """slurm/gateway.sbatch runs ``python -m polar_gym.gateway`` without --admin-token (the job log is shared)."""
    _needs_assets()
    port = free_port()
    workdir = tmp_path / "gw"
    with _script("gateway.sbatch", tmp_path, PORT=str(port), POLAR_ENGINE="oracle", POLAR_SERVER_URL="none",
                 POLAR_WORKDIR=str(workdir), POLAR_STATE_DIR=str(tmp_path / "state")) as (proc, log):
        text = _wait_for_line(proc, log, "gateway up:")
        token_file = tmp_path / "state" / "admin-token"
        token = token_file.read_text().strip()
        assert f"admin token written to {token_file} (mode 600)" in text and token not in text
        assert _private(token_file) and len(token) >= 32
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/admin/upstreams", headers={"x-admin-token": token}).status_code == 200
        assert httpx.get(f"{base}/admin/upstreams").status_code == 401
        # POLAR_SERVER_URL=none: a gateway on its own, which must not take "none" for a server URL
        assert [line for line in processes_with("POLAR_SERVER_URL=none") if "polar_gym.gateway" in line] == []


def test_standalone_proxy_without_a_token_prints_only_the_path_of_its_private_file(tmp_path: Path) -> None:
    _needs_assets()
    port = free_port()
    log = tmp_path / "proxy.log"
    env = {k: v for k, v in os.environ.items() if k != "POLAR_ADMIN_TOKEN"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "polar_gym.proxy", "--engine", "oracle", "--tokenizer",
                                 str(tokenizer_dir()), "--port", str(port), "--capture-dir", str(tmp_path / "cap"),
                                 "--log-level", "warning"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    token_file = tmp_path / "cap" / "admin-token"
    token = token_file.read_text().strip()
    assert f"admin token written to {token_file} (mode 600)" in log.read_text()
    assert token not in log.read_text() and _private(token_file)
