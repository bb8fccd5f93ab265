"""Fixtures and helpers of this folder live in ``_env_kit.py`` and ``_capture_kit.py`` (importable by the tests as
``tests.env._env_kit`` and ``tests.env._capture_kit``)."""

from tests.env._capture_kit import capture, proxy  # noqa: F401
from tests.env._env_kit import *  # noqa: F403
