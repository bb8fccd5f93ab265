"""Fixtures for the rollout server tests: real gateways (oracle engine, curl harness in bubblewrap sandboxes) and
the real server app, all served by uvicorn on loopback inside the test's event loop. A gateway can be stopped
mid-test (its HTTP server first, so the rollout server sees it vanish) and the server restarted on the same db."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import uvicorn

from polar_gym.gateway import GatewayConfig, GatewayNode, build_gateway
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.base import Engine
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.runtime.base import GatewayEndpoint
from polar_gym.schema import AgentSpec, BuilderSpec, EvaluatorSpec, OracleScript, RuntimeSpec, TaskRequest
from polar_gym.server import RolloutServer, Store, create_server_app
from tests._fakes import ByteTokenizer
from tests._postgres import fresh_database
from tests._serving import ADMIN, QuietServer, free_port
from tests.gateway._gateway_kit import DOUBLES, no_processes_with

__all__ = ["BOTH_STORES", "SERVER_TOKEN", "Handler", "Harness", "RunningGateway", "RunningServer", "harness",
           "make_server", "make_task", "wait_for"]

SERVER_TOKEN = "server-admin-token"
MARKER = f"polarsrv{uuid.uuid4().hex[:12]}"


async def _serve(app: Any, port: int, lifespan: str = "off") -> tuple[QuietServer, asyncio.Task[None]]:
    server = QuietServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan,
                                    timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    return server, task


def make_task(task_id: str, num_samples: int = 1, *, sleep: float = 0, calls: int = 1, gap: float = 0,
              callback_url: str | None = None) -> TaskRequest:
    """A task of the curl harness, scored by the pass evaluator; its sandboxes carry this module's marker. The
    harness makes ``calls`` model calls ``gap`` seconds apart, then sleeps ``sleep`` seconds."""
    return TaskRequest(
        task_id=task_id, instruction="say hello", num_samples=num_samples, timeout_seconds=120,
        runtime=RuntimeSpec(backend="local", network="gateway", env={"POLAR_TEST_MARKER": MARKER}),
        agent=AgentSpec(harness=f"{DOUBLES}:CurlHarness", config={"calls": calls, "sleep": sleep, "gap": gap}),
        builder=BuilderSpec(strategy="per_request"), evaluator=EvaluatorSpec(strategy=f"{DOUBLES}:PassEvaluator"),
        callback_url=callback_url)


@dataclass
class RunningGateway:
    node: GatewayNode
    service: ProxyService
    url: str
    server: QuietServer
    task: asyncio.Task[None]
    stopped: bool = False

    async def stop(self) -> None:
        """Die: the HTTP server goes first (clients see refused connections), then the sessions are torn down."""
        if self.stopped:
            return
        self.stopped = True
        self.server.should_exit = True
        await self.task
        await self.node.stop()
        await asyncio.sleep(0.2)  # callbacks scheduled by the relay's last connections run before the loop closes
        self.service.journal.close()

        async def torn_down() -> bool:
            return self.node.stages.live_runtimes() == 0

        await wait_for(torn_down, 30, "every runtime of the stopped gateway to be torn down")


@dataclass
class RunningServer:
    core: RolloutServer
    store: Store
    url: str
    server: QuietServer
    task: asyncio.Task[None]
    http: httpx.AsyncClient = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.AsyncClient(base_url=self.url, headers={"x-admin-token": SERVER_TOKEN}, timeout=30)

    async def stop(self) -> None:
        await self.http.aclose()
        self.server.should_exit = True
        await self.task
        self.store.close()

    async def register(self, gw: RunningGateway, capacity: int) -> str:
        resp = await self.http.post("/gateways/register", json={"url": gw.url, "capacity": capacity,
                                                                 "admin_token": ADMIN})
        assert resp.status_code == 201, resp.text
        return str(resp.json()["gateway_id"])

    async def wait_task(self, task_id: str, timeout: float = 60) -> dict[str, Any]:
        async def done() -> dict[str, Any] | None:
            view = (await self.http.get(f"/tasks/{task_id}")).json()
            return view if view["status"] in ("COMPLETED", "ERROR", "CANCELLED") else None

        return await wait_for(done, timeout, f"task {task_id} to finish")


async def wait_for(probe: Callable[[], Awaitable[Any]], timeout: float, what: str) -> Any:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        value = await probe()
        if value:
            return value
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


@dataclass
class Harness:
    """Makes gateways and servers for one test and stops them all afterwards."""

    tmp: Path
    #: where servers keep their store unless a test names one: a SQLite file, or this PostgreSQL database
    database: str | None = None
    gateways: list[RunningGateway] = field(default_factory=list)
    servers: list[RunningServer] = field(default_factory=list)

    async def gateway(self, run_slots: int = 4, engine: Engine | None = None) -> RunningGateway:
        """A gateway on its own port; its proxy runs ``engine`` (default: an oracle that runs ``echo hi``)."""
        port = free_port()
        engine = engine or OracleEngine(ByteTokenizer(),
                                        default_script=OracleScript(commands=["echo hi"], final_answer="ok"))
        service = ProxyService(engine, CaptureJournal(self.tmp / f"capture-{port}"),
                               SessionRegistry(allow_adhoc=False))
        cfg = GatewayConfig(workdir=self.tmp / f"gw-{port}", endpoint=GatewayEndpoint("127.0.0.1", port),
                            run_slots=run_slots, init_workers=run_slots, ready_buffer=run_slots)
        node, app = build_gateway(service, cfg, ADMIN)
        server, task = await _serve(app, port)
        gw = RunningGateway(node, service, f"http://127.0.0.1:{port}", server, task)
        self.gateways.append(gw)
        return gw

    async def server(self, db: Path | str | None = None, app_knobs: dict[str, Any] | None = None,
                     **knobs: Any) -> RunningServer:
        store = Store(db or self.database or self.tmp / "server.sqlite")
        # dead_after leaves room for a loaded machine: a live gateway whose health answers are slowed by two
        # CPU-bound processes must not be declared dead (1.5 s was too tight; see test_drain_heartbeat_and_giving_up)
        knobs = {"heartbeat_interval": 0.25, "dead_after": 5.0, "result_wait": 2.0, "callback_backoff": 0.05,
                 **knobs}
        core = RolloutServer(store, **knobs)
        port = free_port()
        server, task = await _serve(create_server_app(core, SERVER_TOKEN, **(app_knobs or {})), port,
                                    lifespan="on")
        running = RunningServer(core, store, f"http://127.0.0.1:{port}", server, task)
        self.servers.append(running)
        return running

    async def close(self) -> None:
        for srv in self.servers:
            if not srv.server.should_exit:
                await srv.stop()
        for gw in self.gateways:
            await gw.stop()
        left = await no_processes_with(MARKER)
        for line in left:  # fail the test, but leave nothing behind on the host
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
        assert left == []


#: a server test that runs on SQLite and on PostgreSQL (node loss, restarts, partitions: what the store must keep)
BOTH_STORES = pytest.mark.parametrize("harness", ["sqlite", "postgres"], indirect=True)


@pytest_asyncio.fixture(params=["sqlite"])
async def harness(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Harness]:
    """Servers on SQLite; a test parametrized ``@pytest.mark.parametrize("harness", ["sqlite", "postgres"],
    indirect=True)`` runs on both stores (POLAR_TEST_STORE=postgres puts every server test on PostgreSQL)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    backend = os.environ.get("POLAR_TEST_STORE", request.param)
    database = fresh_database(request.getfixturevalue("postgres_url")) if backend == "postgres" else None
    made = Harness(tmp_path, database)
    try:
        yield made
    finally:
        await made.close()


#: what a MockTransport-backed RolloutServer's HTTP goes to
Handler = Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]]


@pytest_asyncio.fixture
async def make_server(tmp_path: Path) -> AsyncIterator[Callable[..., RolloutServer]]:
    """A RolloutServer whose HTTP goes to ``handler`` (its loops are not started)."""
    made: list[RolloutServer] = []

    def make(handler: Handler, **knobs: Any) -> RolloutServer:
        server = RolloutServer(Store(tmp_path / f"db{len(made)}.sqlite"), transport=httpx.MockTransport(handler),
                               **knobs)
        server.links.open()
        made.append(server)
        return server

    yield make
    for server in made:
        await server.stop()
        server.store.close()
