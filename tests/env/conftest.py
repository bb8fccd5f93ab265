"""Fixtures and helpers of this folder live in ``_env_kit.py`` (a uniquely named module, importable by the tests)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _env_kit import *  # noqa: F403
