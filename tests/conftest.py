"""Shared fixtures; the helpers behind them live in ``_serving.py`` and ``_fakes.py``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests._serving import RunningProxy, oracle_service, serve
from tests._vllm import vllm_server, vllm_train_server, vllm_vlm_server  # noqa: F401  (one each per session, on demand)

pytest_plugins = ["tests._cpu_time"]  # --cpu-durations N: the tests that used the most CPU

# CI (scripts/test.sh sets POLAR_HYPOTHESIS=ci) runs the same examples every time, so its verdict is reproducible;
# a bare pytest explores new ones, which is where a property finds a new bug (then pinned as an explicit case).
# scripts/mutate.py runs the tests once per mutant: the same examples every run, fewer of them (a mutant most tests
# notice fails on the first few), no example database carried from one mutant's run to the next.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("mutate", derandomize=True, max_examples=25, database=None)
if os.environ.get("POLAR_HYPOTHESIS") in ("ci", "mutate"):
    settings.load_profile(os.environ["POLAR_HYPOTHESIS"])


#: tests that share one expensive session resource, by the fixtures they use
_ENGINE_FIXTURES = {"vllm_server", "vllm_train_server"}
ENGINE_GROUP = "engine"
CLUSTER_GROUP = "slurm-user"
VISION_GROUP = "vlm"
_HEAVY_MARKERS = ("engine", "slurm", "slow")


def xdist_group_of(item: pytest.Item) -> str:
    """Under pytest-xdist's ``--dist loadgroup`` (scripts/test.sh), the worker group of a test: every test of the
    local Slurm or the unprivileged user on one worker (one cluster, whose node-failure tests stop nodes, and one user
    clone, which the user's Slurm test needs with the cluster); every other test of the session's Qwen3 vLLMs (one
    per dtype) on one worker; the tiny VLM's tests together; the rest by file (a file's module fixtures built once).
    The Slurm GRPO test trains against a vLLM of the cluster worker's own (a start of 45 s of CPU): with the engine
    tests on the same worker, that one group was the run's critical path (22 minutes of 30)."""
    fixtures = set(getattr(item, "fixturenames", ()))
    if item.get_closest_marker("slurm") is not None or f"{os.sep}unprivileged{os.sep}" in str(item.path):
        return CLUSTER_GROUP
    if _ENGINE_FIXTURES & fixtures:
        return ENGINE_GROUP
    if "vllm_vlm_server" in fixtures:
        return VISION_GROUP
    return item.nodeid.split("::", 1)[0]


def schedule_rank(item: pytest.Item, group: str) -> int:
    """The order in which xdist hands out the groups (scripts/test.sh runs it with ``--no-loadscope-reorder``): the two
    long shared groups first, each on a worker of its own, then the tiny VLM's, then the files of the other heavy
    tests, the quick tests' files last: short, they fill the workers' ends instead of a long test starting late."""
    if group in (CLUSTER_GROUP, ENGINE_GROUP):
        return 0
    if group == VISION_GROUP:
        return 1
    return 2 if any(item.get_closest_marker(marker) is not None for marker in _HEAVY_MARKERS) else 3


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        groups = {id(item): xdist_group_of(item) for item in items}
        for item in items:
            item.add_marker(pytest.mark.xdist_group(groups[id(item)]))
        items.sort(key=lambda item: schedule_rank(item, groups[id(item)]))  # stable: a file keeps its order


@pytest.fixture
def proxy_server(tmp_path: Path) -> Iterator[RunningProxy]:
    """The proxy with the oracle engine (byte tokenizer), ad-hoc sessions and a file journal in tmp_path."""
    yield from serve(oracle_service(tmp_path / "capture"))
