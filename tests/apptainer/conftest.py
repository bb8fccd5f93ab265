"""Fixtures of this folder; they and the helpers behind them live in ``_apptainer_kit.py``, which test files import as
``tests.apptainer._apptainer_kit`` (conftest modules are not imported by name)."""

from tests.apptainer._apptainer_kit import *  # noqa: F403
