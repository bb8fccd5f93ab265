"""Fixtures of this folder live in ``_server_kit.py`` (importable by the tests as ``tests.server._server_kit``)."""

from tests._postgres import postgres_url  # noqa: F401
from tests.server._server_kit import harness, make_server  # noqa: F401
