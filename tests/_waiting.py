"""Waiting for a condition, never for a fixed time: a test that must see "X happened" polls X with a generous
bound (a loaded CI machine can be many times slower than a laptop) and fails loudly, naming X, when it never comes."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

__all__ = ["BOUND", "until", "until_sync"]

#: seconds a test waits for something that takes well under a second on an idle machine
BOUND = 60.0


async def until(probe: Callable[[], Any], timeout: float = BOUND, what: str = "the condition",
                interval: float = 0.02) -> Any:
    """The first truthy value of ``probe()`` (a plain or an async function), polled every ``interval`` seconds;
    AssertionError after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)


def until_sync(probe: Callable[[], Any], timeout: float = BOUND, what: str = "the condition",
               interval: float = 0.05) -> Any:
    """``until`` for plain threads and subprocess tests."""
    end = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
