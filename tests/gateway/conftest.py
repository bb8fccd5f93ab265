"""Fixtures of this folder; they and the helpers behind them live in ``_gateway_kit.py``, which test files import as
``tests.gateway._gateway_kit`` (conftest modules are not imported by name)."""

from tests.gateway._gateway_kit import *  # noqa: F403
