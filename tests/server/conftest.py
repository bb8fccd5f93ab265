"""Fixtures of this folder live in ``_server_kit.py`` (a uniquely named module, importable by the tests)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _server_kit import harness  # noqa: F401
