"""Shared fixtures; the helpers behind them live in ``_serving.py`` and ``_fakes.py``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "merge"))  # _sessions: readable sessions and builder invariants

from _serving import RunningProxy, oracle_service, serve
from _vllm import vllm_server  # noqa: F401  (one real vLLM per session, for every folder that asks)


@pytest.fixture
def proxy_server(tmp_path: Path) -> Iterator[RunningProxy]:
    """The proxy with the oracle engine (byte tokenizer), ad-hoc sessions and a file journal in tmp_path."""
    yield from serve(oracle_service(tmp_path / "capture"))
