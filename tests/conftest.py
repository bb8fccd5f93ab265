"""Shared fixtures; the helpers behind them live in ``_serving.py`` and ``_fakes.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._serving import RunningProxy, oracle_service, serve
from tests._vllm import vllm_server  # noqa: F401  (one real vLLM per session, for every folder that asks)


@pytest.fixture
def proxy_server(tmp_path: Path) -> Iterator[RunningProxy]:
    """The proxy with the oracle engine (byte tokenizer), ad-hoc sessions and a file journal in tmp_path."""
    yield from serve(oracle_service(tmp_path / "capture"))
