"""SDK clients a test opens are closed when the test ends (``closing``; ``conftest.py`` closes them). Left to the
garbage collector, a client's pooled keep-alive socket is closed there with a ResourceWarning, and a collection
that happens to run during a later test fails that test (``filterwarnings = error``): when it runs depends on the
server thread's allocations, so on how the machine schedules it (seen on a loaded machine)."""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["close_all", "closing"]

C = TypeVar("C")
_OPEN: list[Any] = []


def closing(client: C) -> C:
    """``client``, closed at the end of the current test."""
    _OPEN.append(client)
    return client


def close_all() -> None:
    while _OPEN:
        _OPEN.pop().close()
