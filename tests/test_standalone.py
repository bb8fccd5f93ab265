"""`python -m polar_gym.proxy` as a user runs it: a real process, the oracle engine with the real Qwen tokenizer,
a capture directory that holds the session afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.journal import read_session
from tests._serving import free_port, json_server
from tests._waiting import until_sync

ROOT = Path(__file__).resolve().parents[1]


def test_standalone_proxy_serves_and_captures(tmp_path: Path):
    if not (tokenizer_dir() / ".complete").exists():
        pytest.fail("the Qwen tokenizer asset is missing: run `bash scripts/setup.sh`")
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"commands": ["ls"], "final_answer": "listed"}))
    port = free_port()
    log = (tmp_path / "proxy.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "polar_gym.proxy", "--engine", "oracle", "--tokenizer", str(tokenizer_dir()),
         "--oracle-script", str(script), "--port", str(port), "--capture-dir", str(tmp_path / "cap"),
         "--admin-token", "t0ken", "--log-level", "warning"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=log, stdout=log)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                health = httpx.get(base + "/health", timeout=1).json()
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.time() > deadline:
                    raise AssertionError((tmp_path / "proxy.log").read_text()) from None
                time.sleep(0.2)
        assert health["engine"] == "oracle" and health["paused"] is False
        body = {"model": "policy", "messages": [{"role": "user", "content": "hello"}]}
        resp = httpx.post(base + "/v1/chat/completions", json=body, headers={"authorization": "Bearer sess-1"})
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "listed"
        assert httpx.get(base + "/v1/models").json()["data"][0]["id"] == "policy"
        assert httpx.get(base + "/admin/upstreams").status_code == 401
        assert httpx.get(base + "/admin/upstreams", headers={"x-admin-token": "t0ken"}).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()
    (rec,) = read_session(tmp_path / "cap" / "sess-1")
    assert rec.prompt_ids[:3] == [151644, 872, 198]  # <|im_start|>user\n
    assert rec.response_ids[-1] == 151645 and rec.request == body


def test_engine_without_upstream_is_a_clear_error():
    out = subprocess.run([sys.executable, "-m", "polar_gym.proxy", "--engine", "vllm"], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2 and "--upstream: engine 'vllm' needs at least one upstream URL" in out.stderr


MODELS = {"object": "list", "data": [{"id": "policy", "object": "model"}]}


def _chat_only(method: str, path: str) -> tuple[int, object]:
    """A server that serves only chat: /v1/models and /v1/chat/completions, no token-prompt route."""
    return (200, MODELS) if path == "/v1/models" else (404, {"detail": "Not Found"})


@pytest.mark.parametrize("module", ["polar_gym.proxy", "polar_gym.gateway"])
def test_a_token_in_process_says_its_mode_first_and_exits_3_on_a_chat_only_upstream(tmp_path: Path,
                                                                                   module: str) -> None:
    """Issue 41: the mode is the first line on stderr, and an upstream that refuses token prompts stops the start
    (exit 3, before any admin token is written) with a message saying to use prompt_mode chat."""
    if not (tokenizer_dir() / ".complete").exists():
        pytest.fail("the Qwen tokenizer asset is missing: run `bash scripts/setup.sh`")
    with json_server(_chat_only) as url:
        out = subprocess.run([sys.executable, "-m", module, "--engine", "vllm", "--upstream", url, "--prompt-mode",
                              "token_in", "--port", str(free_port()), "--capture-dir", str(tmp_path / "cap"),
                              "--workdir" if module.endswith("gateway") else "--log-level",
                              str(tmp_path / "gw") if module.endswith("gateway") else "warning"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    role = module.rpartition(".")[2]
    lines = out.stderr.splitlines()
    assert out.returncode == 3, out.stderr
    assert lines[0] == (f"polar_gym {role}: engine vllm, prompt mode token_in (tokenizer {tokenizer_dir()}, parser "
                        f"qwen3), upstreams {url}"), out.stderr
    assert lines[-1] == (f"polar_gym {role}: upstream {url} refused a token prompt (POST {url}/v1/completions "
                         'answered HTTP 404: {"detail": "Not Found"}); this upstream does not take token prompts: use '
                         "prompt_mode chat (--prompt-mode chat / inference.prompt_mode=chat)"), out.stderr
    assert "admin token written" not in out.stderr


async def test_await_upstreams_starts_an_engine_with_an_empty_pool():
    """--await-upstreams: the engine starts without an upstream; its pool then waits for one to be added (that
    waiting is tested in tests/unit/test_engines.py::test_pool_empty_waits_for_a_server_then_gives_up)."""
    from polar_gym.proxy.cli import parse_args, settings_from_args
    from polar_gym.proxy.settings import build_engine

    engine = build_engine(settings_from_args(parse_args(["--engine", "vllm", "--await-upstreams"])))
    try:
        assert engine.pool.servers() == [] and engine.pool.wait_for_server_seconds > 0
    finally:
        await engine.aclose()


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_adhoc_sessions_are_bounded_and_their_files_closed(tmp_path: Path) -> None:
    """Issue 35: 2,000 ad-hoc keys kept every session's state (and up to 64 streams' files) for the idle timeout.
    Now at most --max-adhoc-sessions are kept; the least recently used beyond it is forgotten and its journal files
    are closed at once, and nothing it captured is lost: every key's record reads back from disk."""
    if not (tokenizer_dir() / ".complete").exists():
        pytest.fail("the Qwen tokenizer asset is missing: run `bash scripts/setup.sh`")
    port, cap, keep, keys = free_port(), tmp_path / "cap", 8, 120
    log = (tmp_path / "proxy.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "polar_gym.proxy", "--engine", "oracle", "--tokenizer", str(tokenizer_dir()),
         "--port", str(port), "--capture-dir", str(cap), "--admin-token", "t0ken", "--log-level", "warning",
         "--max-adhoc-sessions", str(keep)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=log, stdout=log)
    base = f"http://127.0.0.1:{port}"
    body = {"model": "policy", "messages": [{"role": "user", "content": "hello"}]}
    try:
        with httpx.Client(base_url=base, timeout=60) as client:
            until_sync(lambda: proc.poll() is not None or _answers(client), timeout=60, what="the proxy to listen")
            assert proc.poll() is None, (tmp_path / "proxy.log").read_text()
            for i in range(keep):  # the kept sessions' files open: the most this process should ever hold
                assert client.post("/v1/chat/completions", json=body,
                                   headers={"authorization": f"Bearer warm-{i}"}).status_code == 200
            held = _fds(proc.pid)
            for i in range(keys):
                resp = client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer key-{i}"})
                assert resp.status_code == 200, resp.text
                assert _fds(proc.pid) <= held + 6, f"after {i + 1} keys"  # a connection or two, not 3 per key
            for i in (0, keys // 2, keys - 1):  # forgotten or not, its record is on disk and reads back
                got = client.get(f"/sessions/key-{i}/completions", headers={"authorization": f"Bearer key-{i}"})
                assert got.status_code == 200 and len(got.json()["completions"]) == 1, got.text
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()
    for i in range(keys):
        (rec,) = read_session(cap / f"key-{i}")
        assert rec.request == body and rec.response_ids[-1] == 151645


def _answers(client: httpx.Client) -> bool:
    try:
        return client.get("/health").status_code == 200
    except httpx.HTTPError:
        return False
