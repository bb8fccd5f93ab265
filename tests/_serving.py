"""Running the real proxy app for tests: uvicorn on a loopback port in a thread, so official SDKs talk to it over
HTTP exactly as a harness would. A plain module rather than a conftest, so any test or nested conftest imports it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from polar_gym.proxy.app import create_app
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.base import Engine
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.schema import OracleScript
from polar_gym.serving import EmbeddedServer, free_port
from tests._fakes import ByteTokenizer

ADMIN = "test-admin-token"
SCRIPT = OracleScript(commands=["echo hello > out.txt", "cat out.txt"], final_answer="All done: out.txt holds hello.")


@dataclass
class RunningProxy:
    url: str
    service: ProxyService
    admin_token: str

    def completions(self, session_id: str) -> list[dict]:
        resp = httpx.get(f"{self.url}/sessions/{session_id}/completions",
                         headers={"authorization": f"Bearer {session_id}"})
        resp.raise_for_status()
        return resp.json()["completions"]


class QuietServer(EmbeddedServer):
    """uvicorn on a test's own event loop or thread: the test runner keeps its signal handlers."""


def serve(service: ProxyService, admin_token: str = ADMIN) -> Iterator[RunningProxy]:
    port = free_port()
    config = uvicorn.Config(create_app(service, admin_token), host="127.0.0.1", port=port, log_level="warning",
                            lifespan="off")
    server = QuietServer(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.time() + 60  # generous: CI may be loaded
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("proxy did not start")
        time.sleep(0.01)
    try:
        yield RunningProxy(f"http://127.0.0.1:{port}", service, admin_token)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def oracle_service(tmp_path: Path | None = None, engine: Engine | None = None, **kwargs: object) -> ProxyService:
    engine = engine or OracleEngine(ByteTokenizer(), default_script=SCRIPT)
    journal = CaptureJournal(tmp_path) if tmp_path is not None else CaptureJournal()
    return ProxyService(engine, journal, SessionRegistry(allow_adhoc=True), **kwargs)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def served_gateway(service: ProxyService, workdir: Path, **config: Any) -> AsyncIterator[Any]:
    """A gateway node on this event loop, its app served on a loopback port; stopped (and checked to leave no
    runtime behind) on exit. Yields the GatewayNode."""
    from polar_gym.gateway import GatewayConfig, build_gateway
    from polar_gym.runtime.base import GatewayEndpoint

    port = free_port()
    cfg = GatewayConfig(workdir=workdir, endpoint=GatewayEndpoint("127.0.0.1", port), **config)
    node, app = build_gateway(service, cfg, ADMIN)
    server = QuietServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield node
    finally:
        await node.stop()
        server.should_exit = True
        await task
        assert node.stages.live_runtimes() == 0


@contextlib.contextmanager
def json_server(answer: Callable[[str, str], tuple[int, Any]], port: int = 0) -> Iterator[str]:
    """A plain HTTP server on loopback (a stand-in inference server): ``answer(method, path)`` gives each request's
    status and body (bytes are sent as they are, anything else as JSON); yields its URL. ``port``: 0 for any."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, method: str) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            status, body = answer(method, self.path)
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self._answer("POST")

        def log_message(self, *args: object) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
