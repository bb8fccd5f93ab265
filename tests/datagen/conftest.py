"""Fixtures of the datagen tests; the helpers live in ``_datagen_kit.py``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _datagen_kit import *  # noqa: F403
