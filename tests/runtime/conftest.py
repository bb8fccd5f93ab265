"""Fixtures of this folder; they and the helpers behind them live in ``_runtime_kit.py``, which test files import as
``tests.runtime._runtime_kit`` (conftest modules are not imported by name)."""

from tests.runtime._runtime_kit import *  # noqa: F403
