"""Fixtures and helpers of this folder live in ``_env_kit.py`` (importable by the tests as ``tests.env._env_kit``)."""

from tests.env._env_kit import *  # noqa: F403
