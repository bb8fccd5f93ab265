"""Fixtures of the datagen tests; the helpers live in ``_datagen_kit.py``."""

from __future__ import annotations

from tests.datagen._datagen_kit import *  # noqa: F403
