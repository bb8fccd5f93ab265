"""The real-engine tier: one vLLM CPU server (tiny random Qwen3, real Qwen tokenizer) for the whole session, and
a proxy in front of it whose upstream client keeps every raw answer, so tests compare what we recorded with what
the engine actually said.

The server is started once (35-60 s here), logs to a file named on the terminal, and is torn down with its whole
process group (API server, engine core and worker) however the session ends. A missing vLLM venv or model is a
failure, not a skip: run ``bash scripts/setup.sh --engine``. ``POLAR_SKIP_ENGINE=1`` skips the tier on purpose.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from _serving import serve

from polar_gym.assets import (
    TINY_MODEL_NAME,
    tiny_model_dir,
    tokenizer_dir,
    vllm_python,
    vllm_server_command,
    vllm_server_env,
)
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool

READY_TIMEOUT = float(os.environ.get("POLAR_ENGINE_READY_TIMEOUT", "180"))
SETUP_HINT = "run `bash scripts/setup.sh --engine` (installs vLLM's CPU build and builds the tiny model, ~4 min once)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _say(config: pytest.Config, msg: str) -> None:
    """Progress on the real terminal, past pytest's output capture."""
    capture = config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        print(f"\n[engine] {msg}", file=sys.stderr, flush=True)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, then SIGKILL what is left after a grace period."""
    for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        # the leader is gone; make sure no worker of its group lingers
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return


@dataclass
class VLLMServer:
    url: str
    model: str
    model_dir: Path
    tokenizer_dir: Path
    log_path: Path
    seconds_to_ready: float


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[VLLMServer]:
    if os.environ.get("POLAR_SKIP_ENGINE") == "1":
        pytest.skip("POLAR_SKIP_ENGINE=1: the real vLLM engine tier is skipped on purpose")
    python, model = vllm_python(), tiny_model_dir()
    if not python.exists():
        pytest.fail(f"vLLM's CPU venv is missing ({python}): {SETUP_HINT}", pytrace=False)
    if not (model / ".complete").exists():
        pytest.fail(f"the tiny Qwen3 model is missing ({model}): {SETUP_HINT}", pytrace=False)
    if not (tokenizer_dir() / "tokenizer.json").exists():
        pytest.fail(f"the Qwen tokenizer is missing ({tokenizer_dir()}): {SETUP_HINT}", pytrace=False)

    port = _free_port()
    log_path = Path(os.environ.get("POLAR_ENGINE_LOG") or tmp_path_factory.mktemp("vllm") / "vllm-server.log")
    cmd = vllm_server_command(port)
    _say(pytestconfig, f"starting vLLM on 127.0.0.1:{port} (up to {READY_TIMEOUT:.0f} s); log: {log_path}")
    started = time.monotonic()
    with open(log_path, "wb") as log:
        log.write((" ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=vllm_server_env(), cwd=str(log_path.parent), start_new_session=True)
    atexit.register(_kill_group, proc)  # also when the session dies without running fixture teardown
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode} before it was ready; log {log_path}:\n"
                            f"{_tail(log_path)}", pytrace=False)
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() - started > READY_TIMEOUT:
                pytest.fail(f"vLLM was not ready after {READY_TIMEOUT:.0f} s; log {log_path}:\n{_tail(log_path)}",
                            pytrace=False)
            time.sleep(0.5)
        ready = time.monotonic() - started
        _say(pytestconfig, f"vLLM ready after {ready:.1f} s")
        yield VLLMServer(url, TINY_MODEL_NAME, model, tokenizer_dir(), log_path, ready)
    finally:
        _kill_group(proc)
        _say(pytestconfig, "vLLM stopped")


@pytest.fixture(scope="session")
def qwen_tokenizer(vllm_server: VLLMServer) -> HFChatTokenizer:
    return HFChatTokenizer(vllm_server.tokenizer_dir)


@dataclass
class Exchange:
    """One upstream call as it went over the wire."""

    path: str
    request: dict[str, Any]
    status: int
    answer: dict[str, Any]


@dataclass
class RecordingTransport(httpx.AsyncBaseTransport):
    """Passes requests to the real network transport and keeps each request body and raw JSON answer."""

    exchanges: list[Exchange] = field(default_factory=list)
    # no keep-alive: each proxy runs on its own short-lived event loop, which must not leave sockets open behind it
    inner: httpx.AsyncBaseTransport = field(
        default_factory=lambda: httpx.AsyncHTTPTransport(limits=httpx.Limits(max_keepalive_connections=0)))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        content = await response.aread()
        await response.aclose()
        try:
            answer = json.loads(content)
        except ValueError:
            answer = {"_raw": content.decode(errors="replace")}
        self.exchanges.append(Exchange(request.url.path, json.loads(request.content or b"{}"),
                                       response.status_code, answer))
        headers = [(k, v) for k, v in response.headers.multi_items()
                   if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")]
        return httpx.Response(response.status_code, headers=headers, content=content, request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclass
class EngineProxy:
    """The proxy (real app, uvicorn, loopback) with a VLLMEngine on the real server, plus the wire log."""

    url: str
    service: ProxyService
    transport: RecordingTransport
    server: VLLMServer

    @property
    def exchanges(self) -> list[Exchange]:
        return self.transport.exchanges


@pytest.fixture
def engine_proxy(vllm_server: VLLMServer) -> Iterator[EngineProxy]:
    transport = RecordingTransport()
    client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(120.0, connect=5.0))
    engine = VLLMEngine(UpstreamPool([vllm_server.url]), client=client, upstream_model=vllm_server.model)
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True),
                           model_names=[vllm_server.model])
    for running in serve(service):
        yield EngineProxy(running.url, service, transport, vllm_server)


SGLANG_HINT = ("needs a running SGLang server (GPU only): on a GPU node run `python -m sglang.launch_server "
               "--model-path Qwen/Qwen3-0.6B --port 30000 --tool-call-parser qwen25 --reasoning-parser qwen3`, then "
               "`POLAR_SGLANG_URL=http://127.0.0.1:30000 POLAR_SGLANG_MODEL=Qwen/Qwen3-0.6B "
               "pytest -m engine tests/engine/test_sglang_real.py`")


@pytest.fixture
def sglang_proxy() -> Iterator[EngineProxy]:
    """The proxy with an SGLangEngine on the server at $POLAR_SGLANG_URL (never started here: SGLang is GPU-only)."""
    from polar_gym.proxy.engines.sglang import SGLangEngine

    url = os.environ.get("POLAR_SGLANG_URL")
    if not url:
        pytest.skip(f"POLAR_SGLANG_URL is not set: this test {SGLANG_HINT}")
    model = os.environ.get("POLAR_SGLANG_MODEL", "default")
    server = VLLMServer(url.rstrip("/"), model, Path(), tokenizer_dir(), Path(), 0.0)
    transport = RecordingTransport()
    client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(120.0, connect=5.0))
    engine = SGLangEngine(UpstreamPool([server.url]), client=client, upstream_model=model)
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True), model_names=[model])
    for running in serve(service):
        yield EngineProxy(running.url, service, transport, server)
