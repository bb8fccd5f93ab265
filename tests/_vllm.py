"""The real vLLM CPU server (tiny random Qwen3, real Qwen tokenizer), one for the whole test session and shared by
every folder that needs it (engine tier, NeMo Gym policy test): the root conftest registers the fixture once, so it
starts at most once (35-60 s here); ``vllm_train_server`` is a second one as a training loop runs it (float32, open
to weight updates), started only when a test asks for it. Each logs to a file named on the terminal and is torn
down with its whole process group however the session ends. A missing vLLM venv or model is a failure, not a skip:
run ``bash scripts/setup.sh --engine``. ``POLAR_SKIP_ENGINE=1`` skips it on purpose.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from polar_gym.assets import (
    TINY_MODEL_NAME,
    TINY_VLM_NAME,
    tiny_model_dir,
    tiny_vlm_dir,
    tokenizer_dir,
    torchvision_dir,
    vllm_python,
    vllm_server_command,
    vllm_server_env,
)

__all__ = ["SETUP_HINT", "VLLMServer", "vllm_server", "vllm_train_server", "vllm_vlm_server"]

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


def _serve_vllm(tmp_path_factory: pytest.TempPathFactory, config: pytest.Config, *, name: str, dtype: str = "bfloat16",
                weight_updates: bool = False, vision: bool = False) -> Iterator[VLLMServer]:
    """Start vLLM on the tiny model (``vision``: the tiny Qwen2-VL), yield it once it answers /health, stop its
    process group."""
    if os.environ.get("POLAR_SKIP_ENGINE") == "1":
        pytest.skip("POLAR_SKIP_ENGINE=1: the real vLLM engine tier is skipped on purpose")
    python, model = vllm_python(), tiny_vlm_dir() if vision else tiny_model_dir()
    if not python.exists():
        pytest.fail(f"vLLM's CPU venv is missing ({python}): {SETUP_HINT}", pytrace=False)
    if not (model / ".complete").exists():
        pytest.fail(f"the tiny {'Qwen2-VL' if vision else 'Qwen3'} model is missing ({model}): {SETUP_HINT}",
                    pytrace=False)
    if vision and not (torchvision_dir() / ".complete").exists():
        pytest.fail(f"torchvision beside the vLLM venv is missing ({torchvision_dir()}): {SETUP_HINT}", pytrace=False)
    if not (tokenizer_dir() / "tokenizer.json").exists():
        pytest.fail(f"the Qwen tokenizer is missing ({tokenizer_dir()}): {SETUP_HINT}", pytrace=False)

    port = _free_port()
    log_path = Path(os.environ.get("POLAR_ENGINE_LOG") or tmp_path_factory.mktemp("vllm") / "vllm-server.log")
    if name != "vllm":
        log_path = log_path.with_name(f"{name}-server.log")
    served = TINY_VLM_NAME if vision else TINY_MODEL_NAME
    cmd = vllm_server_command(port, model_dir=model, served_name=served, dtype=dtype, weight_updates=weight_updates,
                              vision=vision, **({"max_model_len": 8192} if vision else {}))
    _say(config, f"starting {name} on 127.0.0.1:{port} (up to {READY_TIMEOUT:.0f} s); log: {log_path}")
    started = time.monotonic()
    with open(log_path, "wb") as log:
        log.write((" ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**vllm_server_env(weight_updates=weight_updates, vision=vision),
                                     "TMPDIR": str(log_path.parent)},  # its IPC sockets, left when it is killed
                                cwd=str(log_path.parent),
                                start_new_session=True)
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
        _say(config, f"{name} ready after {ready:.1f} s")
        yield VLLMServer(url, served, model, model if vision else tokenizer_dir(), log_path, ready)
    finally:
        _kill_group(proc)
        _say(config, f"{name} stopped")


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[VLLMServer]:
    yield from _serve_vllm(tmp_path_factory, pytestconfig, name="vllm")


@pytest.fixture(scope="session")
def vllm_train_server(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[VLLMServer]:
    """A second server, as a training loop runs it: float32 (its logprobs match a float32 trainer's) and open to
    weight updates (VLLM_SERVER_DEV_MODE, polar_vllm_worker). Started only by the tests that ask for it, once
    per session (~40-60 s here, alongside the bf16 one). A test that loads other weights into it loads the tiny
    model's own back before it ends."""
    yield from _serve_vllm(tmp_path_factory, pytestconfig, name="vllm-train", dtype="float32", weight_updates=True)


@pytest.fixture(scope="session")
def vllm_vlm_server(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[VLLMServer]:
    """The tiny Qwen2-VL (``polar_gym.tiny_vlm``) in float32, for the multimodal tests: its tokenizer and processor
    files are in its model folder."""
    yield from _serve_vllm(tmp_path_factory, pytestconfig, name="vllm-vlm", dtype="float32", vision=True)


def load_stock_weights(server: VLLMServer) -> None:
    """The session's training server back on the tiny model's own weights, for the tests after one that loaded
    others into it."""
    import asyncio

    from polar_gym.proxy.engines.vllm import VLLMEngine
    from polar_gym.proxy.upstreams import UpstreamPool

    async def load() -> None:
        engine = VLLMEngine(UpstreamPool([server.url]))
        try:
            await engine.update_weights(server.url, str(server.model_dir), "stock")
        finally:
            await engine.aclose()

    asyncio.run(load())
