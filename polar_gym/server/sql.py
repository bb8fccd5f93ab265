"""The two databases the rollout server's Store runs on, behind one small surface: SQLite (one file, no service: the
default for one machine) and PostgreSQL (a database server several server workers share, ``postgresql://...``).

The Store writes its SQL once, with ``?`` placeholders; the few places the dialects differ (column types, reading a
JSON field) are methods here. Each is used the same way: one connection per process, serialized by a lock, called
from a worker thread (``asyncio.to_thread``), so the event loop never waits on the database."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

__all__ = ["CHANNEL", "Database", "PostgresDatabase", "SqliteDatabase", "is_database_url", "open_database"]

log = logging.getLogger(__name__)

#: the tables, with the two types the dialects spell differently
_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    task_id TEXT PRIMARY KEY, request TEXT NOT NULL, created {real} NOT NULL,
    cancelled INTEGER NOT NULL DEFAULT 0, callback_state TEXT, callback_error TEXT);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, task_id TEXT NOT NULL, sample_index INTEGER NOT NULL, spec TEXT NOT NULL,
    status TEXT NOT NULL, gateway_id TEXT, attempts INTEGER NOT NULL DEFAULT 0, reason TEXT, result TEXT,
    created {real} NOT NULL, dispatched {real}, finished {real}, packed {blob}, result_head TEXT);
CREATE INDEX IF NOT EXISTS sessions_task ON sessions(task_id);
CREATE INDEX IF NOT EXISTS sessions_status ON sessions(status);
CREATE INDEX IF NOT EXISTS sessions_open ON sessions(gateway_id) WHERE finished IS NULL;
CREATE TABLE IF NOT EXISTS gateways (
    gateway_id TEXT PRIMARY KEY, url TEXT NOT NULL UNIQUE, capacity INTEGER NOT NULL, admin_token TEXT,
    state TEXT NOT NULL, owner TEXT);
CREATE TABLE IF NOT EXISTS fleet (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
#: columns a store of an older version lacks: added on open
_ADDED_COLUMNS = (("sessions", "packed", "{blob}"), ("sessions", "result_head", "TEXT"), ("gateways", "owner", "TEXT"),
                  ("sessions", "given_up_on", "TEXT"))
#: the channel server workers on one PostgreSQL database tell each other of changes on
CHANNEL = "polar_gym_changes"


def is_database_url(target: str) -> bool:
    """A PostgreSQL connection URL (anything else is a SQLite file path)."""
    return target.startswith(("postgresql://", "postgres://"))


class Database:
    """One connection, one lock (re-entrant: a transaction runs statements while holding it)."""

    #: what a duplicate primary key raises
    IntegrityError: type[Exception] = Exception
    #: whether other server workers may use the same database (then they tell each other of changes)
    shared = False

    def __init__(self) -> None:
        self.lock = threading.RLock()

    def run(self, sql: str, args: Sequence[Any] = ()) -> list[Mapping[str, Any]]:
        """Run one statement (in its own transaction unless inside ``transaction()``); its rows, if any."""
        raise NotImplementedError

    def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        raise NotImplementedError

    def transaction(self) -> contextlib.AbstractContextManager[None]:
        """Everything run inside commits together, or not at all."""
        raise NotImplementedError

    def json(self, column: str, *path: str) -> str:
        """A SQL expression reading one field of a JSON text column (null when absent)."""
        raise NotImplementedError

    def json_length(self, column: str, *path: str) -> str:
        """A SQL expression: the length of a JSON array in a text column."""
        raise NotImplementedError

    def publish(self, payload: str) -> None:
        """Tell the other workers of a change (nothing to do where none can exist)."""

    def listen(self, heard: Callable[[str], None]) -> Callable[[], None]:
        """Call ``heard`` (in a thread of its own) with each payload the other workers publish; returns the stop."""
        return lambda: None

    def try_lock(self, key: int) -> bool:
        """Take a lock all workers share, without waiting; True when taken (always, where no other worker exists)."""
        return True

    def unlock(self, key: int) -> None:
        """Give back a lock ``try_lock`` took."""

    def close(self) -> None:
        raise NotImplementedError


class SqliteDatabase(Database):
    """A file in WAL mode: a commit survives a crash of the server process (what a restart needs)."""

    IntegrityError = sqlite3.IntegrityError

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        _private_file(path)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: only a power loss can lose the last commits. FULL fsynced every submit and result.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA.format(real="REAL", blob="BLOB"))
        for table, column, kind in _ADDED_COLUMNS:
            if column not in {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind.format(blob='BLOB')}")

    def run(self, sql: str, args: Sequence[Any] = ()) -> list[Mapping[str, Any]]:
        with self.lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self.lock:
            self._db.executemany(sql, rows)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with self.lock, self._db:
            self._db.execute("BEGIN")
            yield

    def trace(self, callback: Callable[[str], None] | None) -> None:
        """Call ``callback`` with each SQL statement the connection runs (a benchmark counts them); None stops."""
        with self.lock:
            self._db.set_trace_callback(callback)

    def json(self, column: str, *path: str) -> str:
        return f"json_extract({column}, '$.{'.'.join(path)}')"

    def json_length(self, column: str, *path: str) -> str:
        return f"json_array_length({column}, '$.{'.'.join(path)}')"

    def close(self) -> None:
        with self.lock:
            self._db.close()


class PostgresDatabase(Database):
    """A PostgreSQL server (psycopg 3, autocommit: each statement commits unless inside ``transaction()``).

    Statements run at READ COMMITTED: a conditional ``UPDATE ... WHERE status = ?`` that two workers race on waits for
    the first, re-checks its condition, and so changes the row once (what claiming a session relies on)."""

    shared = True

    def __init__(self, url: str) -> None:
        super().__init__()
        import psycopg
        from psycopg.rows import dict_row

        self.url = url
        self.IntegrityError = psycopg.errors.UniqueViolation
        self._db = psycopg.connect(url, autocommit=True, row_factory=dict_row)
        self._sql: dict[str, str] = {}
        with self.lock, self._db.transaction():
            # one worker creates the tables; others starting at the same time wait here for it
            self._db.execute("SELECT pg_advisory_xact_lock(7040001)")
            for statement in _SCHEMA.format(real="DOUBLE PRECISION", blob="BYTEA").split(";"):
                if statement.strip():
                    self._db.execute(statement)
            for table, column, kind in _ADDED_COLUMNS:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {kind.format(blob='BYTEA')}")

    def _postgres(self, sql: str) -> str:
        """The statement with psycopg's placeholders (the Store's SQL has no literal ``?`` or ``%``)."""
        out = self._sql.get(sql)
        if out is None:
            out = self._sql[sql] = sql.replace("?", "%s")
        return out

    def run(self, sql: str, args: Sequence[Any] = ()) -> list[Mapping[str, Any]]:
        with self.lock:
            cursor = self._db.execute(self._postgres(sql), _text_safe(args))
            return list(cursor.fetchall()) if cursor.description is not None else []

    def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self.lock, self._db.cursor() as cursor:
            cursor.executemany(self._postgres(sql), [_text_safe(row) for row in rows])

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with self.lock, self._db.transaction():
            yield

    def json(self, column: str, *path: str) -> str:
        return f"(({column})::json #> '{{{','.join(path)}}}')"

    def json_length(self, column: str, *path: str) -> str:
        # json, like ``json`` (the Store COALESCEs the two)
        return f"to_json(json_array_length(({column})::json #> '{{{','.join(path)}}}'))"

    def publish(self, payload: str) -> None:
        self.run("SELECT pg_notify(?, ?)", (CHANNEL, payload))

    def listen(self, heard: Callable[[str], None]) -> Callable[[], None]:
        """A second connection that LISTENs, in a daemon thread (a notification arrives only between statements of
        the connection that listens, so it cannot be the one the Store uses). A lost connection is made again."""
        import psycopg

        stopped = threading.Event()

        def run() -> None:
            while not stopped.is_set():
                try:
                    with psycopg.connect(self.url, autocommit=True) as listener:
                        listener.execute(f"LISTEN {CHANNEL}")
                        while not stopped.is_set():
                            for note in listener.notifies(timeout=0.5):
                                heard(note.payload)
                except psycopg.Error as exc:
                    if not stopped.is_set():
                        log.warning("listening to the other server workers failed (%s); again in 1 s", exc)
                        stopped.wait(1.0)

        thread = threading.Thread(target=run, name="polar-store-listen", daemon=True)
        thread.start()

        def stop() -> None:
            stopped.set()
            thread.join(timeout=5)

        return stop

    def try_lock(self, key: int) -> bool:
        return bool(self.run("SELECT pg_try_advisory_lock(?) AS taken", (key,))[0]["taken"])

    def unlock(self, key: int) -> None:
        self.run("SELECT pg_advisory_unlock(?)", (key,))

    def close(self) -> None:
        with self.lock:
            self._db.close()


def open_database(target: str) -> Database:
    """PostgreSQL for a ``postgresql://`` URL, else a SQLite file at that path."""
    return PostgresDatabase(target) if is_database_url(target) else SqliteDatabase(target)


#: a JSON escape of NUL (not one whose backslash is itself escaped)
_JSON_NUL = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")


def _text_safe(args: Sequence[Any]) -> tuple[Any, ...]:
    """PostgreSQL text cannot hold NUL, nor can its JSON reads take a ``\\u0000`` escape, which a hostile gateway's
    reason may bring (as the character, or escaped in a result's JSON head): both are stored as U+FFFD."""
    return tuple(_without_nul(a) if isinstance(a, str) and ("\x00" in a or "\\u0000" in a) else a for a in args)


def _without_nul(text: str) -> str:
    return _JSON_NUL.sub(r"\1\\ufffd", text.replace("\x00", "\ufffd"))


def _private_file(path: str) -> None:
    """Create (or narrow) a file to mode 0600: the db holds gateway admin tokens, which the server must keep in clear
    to call its gateways. SQLite gives the -wal and -shm files the mode of the db file."""
    if path == ":memory:" or path.startswith("file:"):
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    for suffix in ("-wal", "-shm", "-journal"):  # left by an older version with the old mode
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.chmod(path + suffix, 0o600)
