"""Every SDK client a test opened (``_sdk_kit.closing``) is closed after it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sdk._sdk_kit import close_all


@pytest.fixture(autouse=True)
def _close_sdk_clients() -> Iterator[None]:
    yield
    close_all()
