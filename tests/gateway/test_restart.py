"""Fault 8 (issue 11): a gateway killed with SIGKILL mid-session and restarted with the same ``--workdir`` and
``--capture-dir``. The retried session must neither trip over the dead attempt's workspace (its prepare step is
not idempotent, like a ``git commit``) nor mix the dead attempt's model call into its trajectory.

A real ``python -m polar_gym.gateway`` process (oracle engine, real Qwen tokenizer, bubblewrap sandboxes), killed
and restarted on the same port and directories, as an operator's supervisor would."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.schema import AgentSpec, BuilderSpec, EvaluatorSpec, PrepareAction, RuntimeSpec, SessionSpec
from tests._procs import processes_with
from tests._serving import free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "restart-admin-token"
ADMIN = {"x-admin-token": TOKEN}

#: one model call, then wait for the test's go file in HOME (the attempt's own session dir)
HARNESS = r"""
curl -sS --fail-with-body -X POST "$OPENAI_BASE_URL/chat/completions" -H "Authorization: Bearer $POLAR_API_KEY" \
     -H 'content-type: application/json' -d '{"model":"policy","messages":[{"role":"user","content":"hi"}]}' \
     > "$HOME/reply.json" || exit 7
while [ ! -e "$HOME/go" ]; do sleep 0.05; done
"""


def wait_for(probe: Callable[[], Any], timeout: float, what: str, proc: subprocess.Popen[bytes] | None = None,
             log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = probe()
        except httpx.HTTPError:
            got = None
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the gateway exited while waiting for {what}: {log.read_text() if log else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {log.read_text()[-3000:] if log else ''}")
        time.sleep(0.05)


class GatewayProcess:
    def __init__(self, tmp: Path, port: int) -> None:
        self.tmp, self.port, self.url = tmp, port, f"http://127.0.0.1:{port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.log = tmp / "gateway.log"

    def start(self) -> subprocess.Popen[bytes]:
        with self.log.open("a") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "polar_gym.gateway", "--engine", "oracle", "--tokenizer", str(tokenizer_dir()),
                 "--port", str(self.port), "--workdir", str(self.tmp / "work"),
                 "--capture-dir", str(self.tmp / "capture"), "--admin-token", TOKEN, "--log-level", "warning"],
                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=log)
        self.procs.append(proc)
        wait_for(lambda: httpx.get(self.url + "/gateway/health", timeout=2).status_code == 200, 120,
                 "the gateway to listen", proc, self.log)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    if not (tokenizer_dir() / ".complete").exists():
        pytest.fail("the Qwen tokenizer asset is missing: run `bash scripts/setup.sh`")
    gw = GatewayProcess(tmp_path, free_port())
    try:
        yield gw
    finally:
        gw.close()


def session_spec(session_id: str, marker: str) -> SessionSpec:
    # prepare is not idempotent on purpose (like `git commit`): it fails in a workspace an earlier attempt used
    prepare = [PrepareAction(type="exec", command=["sh", "-c", "test ! -e /workspace/.prepared && "
                                                               "touch /workspace/.prepared"])]
    return SessionSpec(
        session_id=session_id, task_id="restart", instruction="say hi", timeout_seconds=120,
        runtime=RuntimeSpec(backend="local", network="gateway", workdir="/workspace",
                            env={"POLAR_TEST_MARKER": marker}, prepare=prepare),
        agent=AgentSpec(harness="shell", model_name="policy", config={"command": HARNESS}),
        builder=BuilderSpec(strategy="per_request"), evaluator=EvaluatorSpec(strategy="session_completed"))


def completions(gw: GatewayProcess, sid: str) -> list[dict[str, Any]]:
    resp = httpx.get(f"{gw.url}/sessions/{sid}/completions", headers=ADMIN, timeout=10)
    resp.raise_for_status()
    return resp.json()["completions"]  # type: ignore[no-any-return]


def test_a_session_retried_after_kill_9_runs_clean_and_trains_only_its_own_calls(gateway: GatewayProcess) -> None:
    sid, marker = f"restart-{uuid.uuid4().hex[:6]}", f"polarrestart{uuid.uuid4().hex[:12]}"
    body = session_spec(sid, marker).model_dump(mode="json")
    work = gateway.tmp / "work"

    first = gateway.start()
    created = httpx.post(f"{gateway.url}/sessions", json=body, headers=ADMIN, timeout=10)
    assert created.status_code == 201, created.text
    dead_attempt = created.json()["attempt_id"]
    (dead_call,) = wait_for(lambda: completions(gateway, sid), 120, "the first attempt's model call", first,
                            gateway.log)
    first.send_signal(signal.SIGKILL)  # mid-session: the harness waits for a go file that never comes
    first.wait(timeout=30)
    wait_for(lambda: not processes_with(marker), 30, "the dead gateway's sandboxes to go")

    second = gateway.start()  # same port, same --workdir and --capture-dir
    created = httpx.post(f"{gateway.url}/sessions", json=body, headers=ADMIN, timeout=10)
    assert created.status_code == 201, created.text
    attempt = created.json()["attempt_id"]
    assert attempt != dead_attempt
    (new_call,) = wait_for(lambda: completions(gateway, sid), 120, "the new attempt's model call", second,
                           gateway.log)
    assert new_call["completion_id"] != dead_call["completion_id"]
    (work / sid / attempt / "sandbox" / "home" / "go").touch()

    done = httpx.get(f"{gateway.url}/sessions/{sid}/result", params={"wait": 120}, headers=ADMIN, timeout=130)
    assert done.status_code == 200, done.text
    result = done.json()
    assert result["status"] == "COMPLETED", result["reason"]  # prepare ran in a fresh workspace
    assert result["metadata"]["attempt_id"] == attempt
    (trace,) = result["trajectory"]["traces"]
    assert trace["metadata"]["completion_ids"] == [new_call["completion_id"]]  # nothing of the dead attempt
    artifacts = result["metadata"]["artifacts"]
    assert artifacts["completions"] == 1
    # the call log shipped with the result: this attempt's one call, timings without bodies or token arrays
    (call,) = artifacts["call_log"]
    assert call["completion_id"] == new_call["completion_id"] and call["total_seconds"] > 0
    assert call["response_tokens"] > 0 and "request" not in call and "response_ids" not in call
    assert artifacts["earlier_attempts"] == {dead_attempt: 1}  # reported, not trained
    assert not (work / sid / dead_attempt).exists()  # the dead attempt's workspace is cleaned
    assert (gateway.tmp / "capture" / sid / "attempts" / dead_attempt / "records.jsonl").exists()
