"""Fixtures of this folder; they and the helpers behind them live in ``_engine_kit.py`` (a uniquely named module,
so test files import helpers from it without clashing with other folders' conftest modules)."""

from _engine_kit import *  # noqa: F403
