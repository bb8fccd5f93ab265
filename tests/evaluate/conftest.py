"""Fixtures for the evaluator tests: ``demo_runtime(task, name)`` starts a real LocalRuntime with its session dir
under tmp_path, plays the task's prepare actions (the repository) and yields it; helpers live in ``_evalkit.py``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from polar_gym.runtime.base import Runtime
from polar_gym.runtime.local import LocalRuntime
from polar_gym.schema import RuntimeSpec
from polar_gym.tasks import DemoTask, run_prepare

DemoRuntime = Callable[..., contextlib.AbstractAsyncContextManager[Runtime]]


@pytest.fixture
def demo_runtime(tmp_path: Path) -> DemoRuntime:
    @contextlib.asynccontextmanager
    async def make(task: DemoTask, name: str = "live") -> AsyncIterator[Runtime]:
        spec = RuntimeSpec(network="none")
        session_dir = tmp_path / name
        session_dir.mkdir()
        async with LocalRuntime(spec, session_dir) as rt:
            await run_prepare(rt, task.prepare_actions(spec.workdir))
            yield rt

    return make
