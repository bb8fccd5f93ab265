"""Fixtures the unit tests share."""

from __future__ import annotations

import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.proxy.tokenizer import HFChatTokenizer


@pytest.fixture(scope="session")
def tok() -> HFChatTokenizer:
    """The real Qwen tokenizer (scripts/setup.sh builds it)."""
    if not (tokenizer_dir() / ".complete").exists():
        pytest.skip("the Qwen tokenizer is not built (bash scripts/setup.sh)")
    return HFChatTokenizer(tokenizer_dir())
