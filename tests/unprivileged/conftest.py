"""Fixtures of this folder; they live in ``_user_kit.py`` (imported as ``tests.unprivileged._user_kit``)."""

from tests.unprivileged._user_kit import user_clone  # noqa: F401
