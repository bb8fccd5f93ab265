"""A sandbox reaches its gateway's model routes only (issue 35; docs/security.md "model routes only"): through its
relay, ``/health``, ``/metrics``, ``/gateway/health``, ``/openapi.json``, ``/docs`` and the capture routes are 404,
while the operator reads them from the host on the same port. A real gateway on loopback, a real local sandbox
(bwrap) and its real relay."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from polar_gym.proxy.app import is_model_route
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.runtime.local import LocalRuntime
from polar_gym.schema import RuntimeSpec
from tests._serving import served_gateway

OPERATOR_ONLY = ["/health", "/metrics", "/gateway/health", "/openapi.json", "/docs", "/redoc",
                 "/sessions/s-1/completions", "/sessions/s-1", "/admin/upstreams"]
MODEL_GETS = ["/v1/models", "/"]


@pytest.mark.parametrize(("method", "path", "model"), [
    ("POST", "/v1/chat/completions", True), ("POST", "/v1/messages", True), ("POST", "/v1/responses", True),
    ("POST", "/v1beta/models/policy:generateContent", True), ("POST", "/some/prefix/v1/chat/completions", True),
    ("GET", "/v1/models", True), ("HEAD", "/", True), ("GET", "/v1beta/models/policy", True),
    ("GET", "/health", False), ("GET", "/metrics", False), ("GET", "/openapi.json", False),
    ("GET", "/gateway/health", False), ("POST", "/sessions", False), ("POST", "/sessions/poll", False),
    ("POST", "/gateway/drain", False), ("POST", "/admin/weights", False), ("GET", "/sessions/x/completions", False),
    ("DELETE", "/admin/sessions/x", False), ("PUT", "/v1/models", False),
])
def test_model_routes(method: str, path: str, model: bool) -> None:
    assert is_model_route(method, path) is model


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="the local runtime needs bubblewrap")
async def test_a_sandbox_reaches_only_the_model_routes_while_the_host_reads_them_all(tmp_path: Path) -> None:
    engine = VLLMEngine(UpstreamPool([]), timeout=30)
    service = ProxyService(engine, CaptureJournal(tmp_path / "capture"), SessionRegistry(allow_adhoc=False))
    try:
        async with served_gateway(service, tmp_path / "gw") as node:
            endpoint = node.config.endpoint
            probe = "; ".join(
                f'if busybox timeout 10 busybox wget -q -O /dev/null "$G{path}" 2>/tmp/e; then echo "{path} 200"; '
                f'else echo "{path} $(busybox grep -o "HTTP/1.1 [0-9]*" /tmp/e || busybox cat /tmp/e)"; fi'
                for path in OPERATOR_ONLY + MODEL_GETS)
            async with LocalRuntime(RuntimeSpec(network="gateway"), tmp_path / "session", gateway=endpoint) as rt:
                result = await rt.exec(f'G={rt.gateway_url}; {probe}')
            assert result.ok, result
            seen = dict(line.split(" ", 1) for line in result.stdout.decode().splitlines())
            assert seen == {**{p: "HTTP/1.1 404" for p in OPERATOR_ONLY}, **{p: "200" for p in MODEL_GETS}}, seen
            # the operator, from the host, on the same port
            async with httpx.AsyncClient(base_url=f"http://{endpoint.host}:{endpoint.port}") as host:
                for path in ("/health", "/metrics", "/gateway/health", "/openapi.json"):
                    assert (await host.get(path)).status_code == 200, path
    finally:
        service.journal.close()
        await engine.aclose()
