"""Fixtures of this folder; they and the helpers behind them live in ``_engine_kit.py``, which test files import as
``tests.engine._engine_kit`` (conftest modules are not imported by name)."""

from tests.engine._engine_kit import *  # noqa: F403
