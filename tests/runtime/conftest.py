"""Fixtures of this folder; they and the helpers behind them live in ``_runtime_kit.py`` (a uniquely named module,
so test files import helpers from it without clashing with other folders' conftest modules)."""

from _runtime_kit import *  # noqa: F403
