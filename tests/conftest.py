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
SHARED_GROUP = "engine-slurm-user"
VISION_GROUP = "vlm"


def xdist_group_of(item: pytest.Item) -> str:
    """Under pytest-xdist's ``--dist loadgroup`` (scripts/test.sh's heavy run), the worker group of a test: every
    test of the session's Qwen3 vLLMs, the local Slurm or the unprivileged user on one worker, as they share those
    session resources (one vLLM per dtype, one cluster, one user clone) across kinds: the Slurm GRPO test trains
    against the engine tier's vLLM, the user's Slurm test needs both the cluster and the user. Apart, the Slurm
    worker started a vLLM of its own (49 s of its time) and kept it to the end. The tiny VLM's tests share their own
    vLLM in a group of their own; the rest goes by file (a file's module fixtures built once), an ``engine`` test
    that starts its own engine too. xdist sends the shared group first, as it has the most tests, and the other
    groups fill the other worker, then both."""
    fixtures = set(getattr(item, "fixturenames", ()))
    if (item.get_closest_marker("slurm") is not None or f"{os.sep}unprivileged{os.sep}" in str(item.path)
            or _ENGINE_FIXTURES & fixtures):
        return SHARED_GROUP
    if "vllm_vlm_server" in fixtures:
        return VISION_GROUP
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            item.add_marker(pytest.mark.xdist_group(xdist_group_of(item)))


@pytest.fixture
def proxy_server(tmp_path: Path) -> Iterator[RunningProxy]:
    """The proxy with the oracle engine (byte tokenizer), ad-hoc sessions and a file journal in tmp_path."""
    yield from serve(oracle_service(tmp_path / "capture"))
