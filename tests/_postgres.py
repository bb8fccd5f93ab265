"""A private PostgreSQL server per test process (Debian's postgresql-15, started like the project's users start it:
polar_gym.server.postgres_local), and a fresh database per test on it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest

from polar_gym.server.postgres_local import PrivatePostgres, postgres_bin


@pytest.fixture(scope="session")
def postgres_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of this process's private server (skips where PostgreSQL is not installed)."""
    if postgres_bin() is None:
        pytest.skip("PostgreSQL is not installed (bash scripts/setup.sh installs postgresql-15 as root)")
    server = PrivatePostgres(tmp_path_factory.mktemp("postgres"))
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


def fresh_database(url: str) -> str:
    """A new empty database on the server at ``url``; its URL."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(url, autocommit=True) as db:
        db.execute(f"CREATE DATABASE {name}")
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))
