"""Fixtures for the gateway tests: a real gateway (oracle engine with the byte tokenizer, file journal, registered
keys only) served by uvicorn inside the test's own event loop, so sandboxes reach it through the gateway relay."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import uvicorn

from polar_gym.gateway import GatewayConfig, GatewayNode, build_gateway
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.runtime.base import GatewayEndpoint
from polar_gym.schema import (
    AgentSpec,
    BuilderSpec,
    EvaluatorSpec,
    OracleScript,
    PrepareAction,
    RuntimeSpec,
    SessionSpec,
)
from tests._fakes import ByteTokenizer
from tests._procs import processes_with
from tests._serving import ADMIN, QuietServer, free_port

DOUBLES = "tests.gateway._gw_doubles"


@dataclass
class LiveGateway:
    node: GatewayNode
    service: ProxyService
    url: str
    admin: str
    marker: str
    workdir: Path

    def spec(self, session_id: str | None = None, *, calls: int = 1, sleep: float = 0, exit_code: int = 0,
             timeout: float = 60, evaluator: str = "PassEvaluator", prepare: list[PrepareAction] | None = None,
             builder: str = "per_request", **metadata: Any) -> SessionSpec:
        """A session of the curl harness, tagged with this test's marker (in every sandbox process's env)."""
        return SessionSpec(
            session_id=session_id or f"s-{uuid.uuid4().hex[:8]}", task_id="gateway-test",
            instruction="say hello", timeout_seconds=timeout,
            runtime=RuntimeSpec(backend="local", network="gateway", workdir="/workspace",
                                env={"POLAR_TEST_MARKER": self.marker}, prepare=prepare or []),
            agent=AgentSpec(harness=f"{DOUBLES}:CurlHarness", model_name="policy",
                            config={"calls": calls, "sleep": sleep, "exit_code": exit_code}),
            builder=BuilderSpec(strategy=builder), evaluator=EvaluatorSpec(strategy=f"{DOUBLES}:{evaluator}"),
            metadata=metadata,
        )


async def no_processes_with(marker: str, wait: float = 30.0) -> list[str]:
    """The processes left with ``marker`` after up to ``wait`` seconds (killed trees take a moment to vanish)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + wait
    while True:
        left = processes_with(marker)
        if not left or loop.time() > end:
            return left
        await asyncio.sleep(0.05)


MakeGateway = Callable[..., Awaitable[LiveGateway]]


@pytest_asyncio.fixture
async def make_gateway(tmp_path: Path) -> AsyncIterator[MakeGateway]:
    """``await make_gateway(**GatewayConfig fields)``: a served gateway; stopped after the test, with a leak check."""
    import shutil

    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    made: list[tuple[LiveGateway, QuietServer, asyncio.Task[None]]] = []

    async def make(**config: Any) -> LiveGateway:
        port = free_port()
        engine = OracleEngine(ByteTokenizer(), default_script=OracleScript(commands=["echo hi"], final_answer="ok"))
        service = ProxyService(engine, CaptureJournal(tmp_path / f"capture-{port}"),
                               SessionRegistry(allow_adhoc=False))
        workdir = tmp_path / f"gw-{port}"
        cfg = GatewayConfig(workdir=workdir, endpoint=GatewayEndpoint("127.0.0.1", port), **config)
        node, app = build_gateway(service, cfg, ADMIN)
        server = QuietServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                        timeout_graceful_shutdown=5))
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        gw = LiveGateway(node, service, f"http://127.0.0.1:{port}", ADMIN, f"polargw{uuid.uuid4().hex[:12]}",
                         workdir)
        made.append((gw, server, task))
        return gw

    yield make
    for gw, server, task in made:
        await gw.node.stop()
        server.should_exit = True
        await task
        # A relay connection accepted just as its runtime stopped closes through a call_soon callback: let it run
        # before pytest closes the loop (GatewayRelay.stop does not see handlers that had not started yet).
        await asyncio.sleep(0.2)
        gw.service.journal.close()
        assert gw.node.stages.live_runtimes() == 0
        left = await no_processes_with(gw.marker)
        for line in left:  # fail the test, but leave nothing behind on the host
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
        assert left == []
