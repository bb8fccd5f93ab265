"""A harness that needs more memory than the sandbox's default gets it (OpenClaw: 2048 MB over the local runtime's
1024), also when a task asks for less (its limit sizes its environment; OpenClaw's agent process was OOM-killed at a
Harbor task's 1024 MB and it exited 0 with its work undone), unless the operator set a default: theirs stands."""

from __future__ import annotations

from pathlib import Path

import pytest

from polar_gym.gateway.config import GatewayConfig
from polar_gym.gateway.sandbox import SandboxStages
from polar_gym.registry import HARNESSES
from polar_gym.runtime.local import LocalRuntime
from polar_gym.schema import RuntimeSpec, SessionSpec
from polar_gym.tasks import demo_task


def memory(tmp_path: Path, harness: str, *, request: int | None = None, operator: int | None = None) -> int | None:
    options = {"memory_mb": operator} if operator is not None else {}
    stages = SandboxStages(service=None, config=GatewayConfig(workdir=tmp_path, runtime_options=options))  # type: ignore[arg-type]
    spec = SessionSpec.from_task(demo_task("demo-calc-add").to_request(
        harness=harness, runtime=RuntimeSpec(backend="local", memory_mb=request)), 0)
    runtime = stages._runtime(spec, tmp_path / "sandbox", HARNESSES.get(harness)())
    assert isinstance(runtime, LocalRuntime)
    return runtime.limit("memory_mb")


@pytest.mark.parametrize(("harness", "request_mb", "operator_mb", "expected"), [
    ("openclaw", None, None, 2048),  # raised from the default for the harness that needs it
    ("pi", None, None, 1024),        # the default for every other harness
    ("openclaw", 4096, None, 4096),  # the request's own limit, over the floor
    ("openclaw", 1024, None, 2048),  # a task's limit under the floor: the floor
    ("pi", 512, None, 512),          # a task's limit, for a harness without a floor
    ("openclaw", None, 1536, 1536),  # the operator's: their machine, their call
])
def test_the_sandbox_memory_a_harness_gets(tmp_path: Path, harness: str, request_mb: int | None,
                                           operator_mb: int | None, expected: int) -> None:
    assert memory(tmp_path, harness, request=request_mb, operator=operator_mb) == expected
