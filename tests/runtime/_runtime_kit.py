"""Fixtures for the runtime conformance suite: one ``backend`` fixture parametrized over every backend name.

A backend here is a :class:`Backend`: how to make a runtime for a spec, the image its tests use, and a leak check
(``leftovers``) beyond the process scan every backend gets. The docker backend's factory lives in ``_docker.py``
(expected: ``docker_backend() -> Backend``, or raise ``pytest.skip`` when no engine runs); when that module is
missing, the docker parameters skip and say so.

Commands in the suite use only ``sh`` and ``busybox`` applets, which the host root (local) and the busybox test
image (docker) both provide.
"""

from __future__ import annotations

import importlib
import os
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio

from polar_gym.runtime.base import GatewayEndpoint, Runtime
from polar_gym.schema import RuntimeSpec
from tests._procs import processes_with

BACKENDS = ["local", "docker"]


def _no_leftovers(marker: str) -> list[str]:
    return []


@dataclass
class Backend:
    name: str
    make: Callable[[RuntimeSpec, Path, GatewayEndpoint | None], Runtime]
    image: str | None = None
    #: backend-specific leak check (containers, mounts) for a marker: descriptions of what is left
    leftovers: Callable[[str], list[str]] = field(default=_no_leftovers)
    #: what the backend enforces: "max_processes", "memory_mb"
    limits: frozenset[str] = frozenset({"max_processes", "memory_mb"})

    def spec(self, marker: str, **kwargs: object) -> RuntimeSpec:
        env = {"POLAR_TEST_MARKER": marker, **kwargs.pop("env", {})}  # type: ignore[dict-item]
        kwargs.setdefault("network", "none")
        return RuntimeSpec(backend=self.name, image=self.image, env=env, **kwargs)  # type: ignore[arg-type]


def local_backend() -> Backend:
    from polar_gym.runtime.local import LocalRuntime

    if not _which("bwrap"):
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    return Backend("local", lambda spec, path, gw: LocalRuntime(spec, path, gateway=gw))


def _which(name: str) -> bool:
    return any(os.access(os.path.join(d, name), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep))


def docker_backend() -> Backend:
    try:
        module = importlib.import_module("tests.runtime._docker")
    except ModuleNotFoundError as exc:
        if exc.name != "tests.runtime._docker":
            raise
        pytest.skip("tests/runtime/_docker.py (the docker backend's test factory) is missing")
    return module.docker_backend()  # type: ignore[no-any-return]


_FACTORIES: dict[str, Callable[[], Backend]] = {"local": local_backend, "docker": docker_backend}


@pytest.fixture(params=BACKENDS, scope="session")
def backend(request: pytest.FixtureRequest) -> Backend:
    return _FACTORIES[request.param]()


def mounts_with(text: str) -> list[str]:
    return [line for line in Path("/proc/mounts").read_text().splitlines() if text in line]


@pytest.fixture
def marker() -> str:
    return f"polarmark{uuid.uuid4().hex[:12]}"


@pytest.fixture
def session_dir(tmp_path: Path) -> Path:
    path = tmp_path / "session"
    path.mkdir()
    return path


@pytest_asyncio.fixture
async def make_runtime(backend: Backend, session_dir: Path, marker: str) -> AsyncIterator[Callable[..., Runtime]]:
    """``make_runtime(gateway=None, **spec_fields)``; every runtime made is stopped and checked for leaks after."""
    made: list[Runtime] = []

    def make(gateway: GatewayEndpoint | None = None, **kwargs: object) -> Runtime:
        runtime = backend.make(backend.spec(marker, **kwargs), session_dir, gateway)
        made.append(runtime)
        return runtime

    yield make
    for runtime in made:
        await runtime.stop()
    assert processes_with(marker) == []
    assert backend.leftovers(marker) == []
