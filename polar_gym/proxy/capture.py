"""The capture journal's writer: every completion of a session, durably and in order, with prefix-shared token
storage. The on-disk format (codec, layout, readers) is :mod:`polar_gym.journal`; this module keeps the streams'
encoder state, the attempts of gateway sessions and the file writes.

A writer thread does the file I/O; appends wait for it (bounded), so under pressure the proxy slows down instead of
dropping records.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path

from polar_gym.dirnames import dirname_for
from polar_gym.journal import (
    ATTEMPTS_DIR,
    CURRENT_ATTEMPT,
    LOGPROBS_FILE,
    RECORDS_FILE,
    TOKENS_FILE,
    DigestMemo,
    SessionStore,
    count_attempts,
    decode,
    read_current_attempt,
    read_file,
    read_session,
    stored_bytes,
    truncate_torn_tail,
)
from polar_gym.private_files import private_dir, write_secret
from polar_gym.schema import CompletionRecord

__all__ = ["CaptureJournal"]


class _Session:
    """One journal stream's encoder state and, in memory mode, its bytes. ``users`` counts the calls holding it, so
    eviction never drops a stream that a call is about to write (two encoders on one directory would corrupt it)."""

    def __init__(self, session_id: str, directory: Path | None, memo: DigestMemo) -> None:
        self.session_id = session_id
        self.directory = directory
        self.memo = memo
        self.store = SessionStore(memo)
        self.lock = asyncio.Lock()
        self.users = 0
        self.loaded = directory is None
        self.lines: list[bytes] = []
        self.tokens = bytearray()
        self.logprobs = bytearray()
        #: records encoded and not yet written (tokens, logprobs, lines), and their calls, waiting for the end of
        #: the loop iteration (``CaptureJournal._flush``); a batch the writer thread is writing (``inflight``) goes
        #: before them
        self.pending: list[tuple[bytes, bytes, bytes]] = []
        self.waiting: list[asyncio.Future[None]] = []
        self.inflight: asyncio.Future[None] | None = None

    def reload_later(self) -> None:
        """The encoder counted records the files may not hold (or hold in part): rebuild it from disk before the
        next append, cutting the torn part, so no later record points at missing bytes."""
        self.store, self.loaded = SessionStore(self.memo), False

    def load(self) -> None:
        """Reopen an existing journal (a restarted proxy, or a stream evicted from memory): rebuild the encoder
        state from disk, and cut a torn tail off so the next record's offsets point at its own bytes."""
        assert self.directory is not None
        self.loaded = True
        path = self.directory / RECORDS_FILE
        if not path.exists():
            return
        raw = path.read_bytes()
        lines = raw.splitlines(keepends=True)
        records = decode(lines, read_file(self.directory / TOKENS_FILE), read_file(self.directory / LOGPROBS_FILE))
        for record in records:
            self.store.encode(record)
        truncate_torn_tail(self.directory, lines, len(records), self.store)

    def write(self, line: bytes, tokens: bytes, logprobs: bytes, fsync: bool, files: _OpenFiles | None = None) -> None:
        """Append one record (its tokens, logprobs, then its line: a line never points at missing bytes)."""
        if self.directory is None:
            self.tokens += tokens
            self.logprobs += logprobs
            self.lines.append(line)
            return
        if files is None:
            raise ValueError("an on-disk stream is written through the journal's open files")
        files.write(self.directory, (tokens, logprobs, line), fsync)

    def read(self) -> list[CompletionRecord]:
        if self.directory is None:
            return decode(self.lines, bytes(self.tokens), bytes(self.logprobs))
        return read_session(self.directory)

    def stored_bytes(self) -> int:
        if self.directory is None:
            return sum(map(len, self.lines)) + len(self.tokens) + len(self.logprobs)
        return stored_bytes(self.directory)


def _open_stream(directory: Path) -> tuple[int, int, int]:
    private_dir(directory)  # prompts and completions: the owner's only (0700 directories, 0600 files)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
    opened: list[int] = []
    try:
        for name in (TOKENS_FILE, LOGPROBS_FILE, RECORDS_FILE):
            opened.append(os.open(directory / name, flags, 0o600))
    except BaseException:
        for fd in opened:
            os.close(fd)
        raise
    return opened[0], opened[1], opened[2]


def _append(fds: tuple[int, int, int], payloads: tuple[bytes, bytes, bytes], fsync: bool) -> None:
    for fd, payload in zip(fds, payloads, strict=True):
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)


def _linked(fds: tuple[int, int, int]) -> bool:
    """Whether none of a stream's open files was removed under it."""
    return bool(os.fstat(fds[0]).st_nlink and os.fstat(fds[1]).st_nlink and os.fstat(fds[2]).st_nlink)


class _OpenFiles:
    """The append descriptors (tokens, logprobs, records) of the streams written last, kept open between calls:
    opening three files and making the directory per call cost more than the writes. Only the writer thread opens
    and closes them (a directory or an open on a network file system can take a while); the event loop may append
    to files already open (``write_if_open``: a few page-cache writes, cheaper than handing them to the thread).
    ``_lock`` makes a write and a close of the same descriptor exclusive, and is never held across an open or a
    close. A stream whose files were removed under it (``st_nlink`` 0) gets fresh ones, as reopening per call did."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._open: collections.OrderedDict[Path, tuple[int, int, int]] = collections.OrderedDict()
        self._closing: list[tuple[int, int, int]] = []  # taken out under the lock, closed by the writer thread
        self._lock = threading.Lock()

    def write_if_open(self, directory: Path, payloads: tuple[bytes, bytes, bytes]) -> bool:
        """Append ``payloads`` if the stream's files are open and still linked (no fsync); False: nothing written,
        hand the write to the writer thread."""
        with self._lock:
            fds = self._open.get(directory)
            if fds is None or not _linked(fds):
                return False
            try:
                _append(fds, payloads, fsync=False)
            except BaseException:
                del self._open[directory]  # the writer thread closes them; the reload cuts the torn part
                self._closing.append(fds)
                raise
            self._open.move_to_end(directory)
            return True

    def write(self, directory: Path, payloads: tuple[bytes, bytes, bytes], fsync: bool) -> None:
        """Append ``payloads`` through the stream's open files, opening them first if needed (writer thread)."""
        with self._lock:
            fds = self._open.get(directory)
            if fds is not None and not _linked(fds):
                del self._open[directory]
                self._closing.append(fds)
                fds = None
        self._close_pending()
        if fds is None:
            fds = _open_stream(directory)
            with self._lock:
                self._open[directory] = fds
                while len(self._open) > self.keep:
                    self._closing.append(self._open.popitem(last=False)[1])
            self._close_pending()
        try:
            _append(fds, payloads, fsync)
        except BaseException:
            with self._lock:
                if self._open.get(directory) == fds:
                    del self._open[directory]
                    self._closing.append(fds)
            self._close_pending()
            raise
        with self._lock:
            if directory in self._open:
                self._open.move_to_end(directory)

    def _close_pending(self) -> None:
        with self._lock:
            closing, self._closing = self._closing, []
        for fds in closing:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            self._closing.extend(self._open.values())
            self._open.clear()
        self._close_pending()

    def drop(self, directory: Path) -> bool:
        """Take a finished stream's files out (the writer thread closes them next); whether they were open."""
        with self._lock:
            fds = self._open.pop(directory, None)
            if fds is not None:
                self._closing.append(fds)
        return fds is not None

    def close_dropped(self) -> None:
        """Close what :meth:`drop` took out (writer thread)."""
        self._close_pending()


class _Writer:
    """One thread doing all journal file I/O, so the event loop never blocks on disk. It keeps the files it wrote
    last open (``files``, touched by this thread alone)."""

    def __init__(self, max_pending: int) -> None:
        self.files = _OpenFiles()
        self._queue: queue.Queue[tuple[Callable[[], None], asyncio.Future[None]] | None] = queue.Queue(max_pending)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="polar-capture-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self.files.close()
                return
            job, fut = item
            loop = fut.get_loop()
            try:
                job()
            except BaseException as exc:  # delivered to the awaiting request
                loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                loop.call_soon_threadsafe(_set_result, fut)

    async def submit(self, job: Callable[[], None]) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        while True:
            self._check_open()
            try:
                self._queue.put_nowait((job, fut))
                break
            except queue.Full:
                await asyncio.sleep(0.005)  # back-pressure: the request waits, nothing is dropped
        await fut

    def submit_nowait(self, job: Callable[[], None]) -> asyncio.Future[None]:
        """``job`` queued from a loop callback, which cannot wait: a full queue blocks until the thread takes one
        (it never waits on the loop); the future is done when the job is."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._check_open()
        self._queue.put((job, fut))
        return fut

    def _check_open(self) -> None:
        if self._closed or not self._thread.is_alive():
            raise RuntimeError("the capture journal is closed: nothing writes it any more")

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=10)


def _set_result(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future[None], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


_Key = tuple[str, str | None]


class CaptureJournal:
    """All sessions' journals. ``root=None`` keeps them in memory with the same prefix-shared encoding.

    A stream is a session (``attempt=None``: ``<root>/<session>/``) or one dispatch attempt of it
    (``<root>/<session>/attempts/<attempt>/``), so a retried session never appends to a dead attempt's journal.
    Reading a session without naming the attempt reads its latest attempt (set by :meth:`begin_attempt`).

    Memory is bounded: at most ``max_open`` streams keep their encoder state (least recently used first out, never
    one a call is using); :meth:`release` drops a finished stream at once. An on-disk stream evicted from memory
    reads back from disk and reopens on its next append; an in-memory one is gone (the in-memory journal is for
    tests and short runs).
    """

    def __init__(self, root: str | Path | None = None, *, fsync: bool = False, max_pending: int = 256,
                 max_open: int | None = None) -> None:
        self.root = Path(root) if root is not None else None
        self.fsync = fsync
        self.max_open = max_open if max_open is not None else (256 if self.root is not None else 10_000)
        if self.max_open < 1:
            raise ValueError("max_open must be at least 1")
        self._sessions: collections.OrderedDict[_Key, _Session] = collections.OrderedDict()
        #: the latest attempt of recently begun sessions (on disk it is also in CURRENT_ATTEMPT)
        self._latest: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._writer = _Writer(max_pending) if self.root is not None else None
        self._memo = DigestMemo()  # shared by the streams: sessions of one harness send the same tools
        self._due: list[_Session] = []  # streams with records to write at the end of this loop iteration

    # -- layout ----------------------------------------------------------------------------------------------

    def session_dir(self, session_id: str) -> Path | None:
        return self.root / dirname_for(session_id) if self.root is not None else None

    def stream_dir(self, session_id: str, attempt: str | None = None) -> Path | None:
        base = self.session_dir(session_id)
        if base is None or attempt is None:
            return base
        return base / ATTEMPTS_DIR / dirname_for(attempt)

    # -- streams in memory -----------------------------------------------------------------------------------

    def _open(self, key: _Key) -> _Session:
        session = self._sessions.get(key)
        if session is None:
            session = self._sessions[key] = _Session(key[0], self.stream_dir(*key), self._memo)
        else:
            self._sessions.move_to_end(key)
        return session

    def _trim(self) -> None:
        if len(self._sessions) <= self.max_open:  # nothing to evict (the common case)
            return
        for key in [k for k, s in self._sessions.items() if s.users == 0]:
            if len(self._sessions) <= self.max_open:
                break
            del self._sessions[key]

    def release(self, session_id: str, attempt: str | None = None) -> None:
        """The stream is final (its session's result is out): drop its state from memory. On disk it stays
        readable; in memory it is kept only until ``max_open`` newer streams push it out."""
        key = (session_id, attempt)
        session = self._sessions.get(key)
        if session is None or session.users == 0:
            self._close_files(key)
        if session is None:
            return
        if self.root is not None and session.users == 0:
            del self._sessions[key]
        else:
            self._sessions.move_to_end(key, last=False)  # first in line for eviction
        if self.root is not None and self._latest.get(session_id) == attempt:
            self._latest.pop(session_id, None)  # the pointer file on disk still names it

    def _close_files(self, key: _Key) -> None:
        """Close a released stream's append files now (on the writer thread, after what is queued before: nothing
        of the stream is, as no call holds it), not when 64 newer streams push them out."""
        directory = self.stream_dir(*key)
        if self._writer is None or directory is None or not self._writer.files.drop(directory):
            return
        try:
            done = self._writer.submit_nowait(self._writer.files.close_dropped)
        except RuntimeError:  # no running loop, or the journal is closed: its close closes them
            return
        done.add_done_callback(lambda fut: fut.cancelled() or fut.exception())

    def open_streams(self) -> int:
        """Streams whose state is held in memory (bounded by ``max_open``)."""
        return len(self._sessions)

    # -- attempts --------------------------------------------------------------------------------------------

    def mark_latest(self, session_id: str, attempt: str) -> None:
        """Make ``attempt`` the session's latest in memory (what reading the session without an attempt returns),
        at once: :meth:`begin_attempt` also writes it to disk."""
        self._latest[session_id] = attempt
        self._latest.move_to_end(session_id)
        while len(self._latest) > self.max_open:
            self._latest.popitem(last=False)

    async def begin_attempt(self, session_id: str, attempt: str) -> None:
        """Make ``attempt`` the session's latest: what reading the session without an attempt returns."""
        self.mark_latest(session_id, attempt)
        base = self.session_dir(session_id)
        if base is not None and self._writer is not None:
            await self._writer.submit(lambda: _write_pointer(base, attempt))

    async def latest_attempt(self, session_id: str) -> str | None:
        attempt = self._latest.get(session_id)
        base = self.session_dir(session_id)
        if attempt is None and base is not None:
            attempt = await asyncio.to_thread(read_current_attempt, base)
        return attempt

    async def attempts(self, session_id: str) -> dict[str, int]:
        """Every attempt of the session on disk (or in memory), with its number of records."""
        base = self.session_dir(session_id)
        if base is None:
            return {a: s.store.count for (sid, a), s in self._sessions.items() if sid == session_id and a}
        return await asyncio.to_thread(count_attempts, base)

    # -- records ---------------------------------------------------------------------------------------------

    async def append(self, record: CompletionRecord, attempt: str | None = None, *,
                     received: bytes | None = None, received_is_orjson: bool = False) -> CompletionRecord:
        """Journal ``record`` as the next completion of its session's stream (``attempt``); returns it with its index
        set. Returns only once the record is written (to the OS, or to disk with ``fsync``); a failed write (disk
        full, permissions) raises here. ``received``: the request body as the harness sent it, kept so the journal
        gives it back byte for byte (:func:`polar_gym.journal.read_received`); ``received_is_orjson``: it is known to
        be what ``orjson.dumps`` writes of ``record.request`` (:meth:`polar_gym.journal.SessionStore.encode`)."""
        session = self._open((record.session_id, attempt))
        session.users += 1  # held: never evicted while this call uses it, or while its record waits to be written
        queued = False
        try:
            async with session.lock:
                if not session.loaded:
                    await asyncio.to_thread(session.load)
                record.index = session.store.count
                line, tokens, logprobs = session.store.encode(record, received, received_is_orjson)
                if self._writer is None:
                    session.write(line, tokens, logprobs, False)
                    return record
                if self.fsync:
                    files = self._writer.files
                    try:
                        await self._writer.submit(lambda: session.write(line, tokens, logprobs, True, files))
                    except BaseException:
                        session.reload_later()
                        raise
                    return record
                written, queued = self._queue(session, (tokens, logprobs, line)), True
            await written  # outside the lock: the session's next call encodes meanwhile and joins the batch
        finally:
            if not queued:  # else its batch lets go of the stream, written or not (also when this call is cancelled)
                session.users -= 1
                self._trim()
        return record

    # -- group commit ----------------------------------------------------------------------------------------

    def _queue(self, session: _Session, payload: tuple[bytes, bytes, bytes]) -> asyncio.Future[None]:
        """Queue an encoded record for the end of this loop iteration: every record encoded in one iteration (at
        64 concurrent calls, ~25) is written with one write per file, not three writes and three checks each."""
        loop = asyncio.get_running_loop()
        written: asyncio.Future[None] = loop.create_future()
        session.pending.append(payload)
        session.waiting.append(written)
        if len(session.pending) == 1 and session.inflight is None:
            self._due_now(session, loop)
        return written

    def _due_now(self, session: _Session, loop: asyncio.AbstractEventLoop) -> None:
        if not self._due:
            loop.call_soon(self._flush)
        self._due.append(session)

    def _flush(self) -> None:
        """Write each due stream's batch, in order: to its open files at once, else (not open yet, evicted, removed
        under it) through the writer thread, whose batch the stream's next ones wait for."""
        due, self._due = self._due, []
        for session in due:
            if session.inflight is not None or not session.pending:
                continue
            batch, waiting = session.pending, session.waiting
            session.pending, session.waiting = [], []
            payloads = batch[0] if len(batch) == 1 else (
                b"".join(p[0] for p in batch), b"".join(p[1] for p in batch), b"".join(p[2] for p in batch))
            assert self._writer is not None and session.directory is not None
            files = self._writer.files
            try:
                if files.write_if_open(session.directory, payloads):
                    self._settle(session, waiting)
                    continue
                tokens, logprobs, lines = payloads
                session.inflight = self._writer.submit_nowait(
                    functools.partial(session.write, lines, tokens, logprobs, False, files))
            except BaseException as exc:
                self._failed(session, waiting, exc)
                continue
            session.inflight.add_done_callback(functools.partial(self._written, session, waiting))

    def _written(self, session: _Session, waiting: list[asyncio.Future[None]], done: asyncio.Future[None]) -> None:
        session.inflight = None
        exc = done.exception() if not done.cancelled() else asyncio.CancelledError()
        if exc is not None:
            self._failed(session, waiting, exc)
            return
        if session.pending:  # queued while the thread wrote
            self._due_now(session, done.get_loop())
        self._settle(session, waiting)

    def _failed(self, session: _Session, waiting: list[asyncio.Future[None]], exc: BaseException) -> None:
        """A batch the files may not hold (or hold in part): its calls and those queued behind it get the error, and
        the encoder is rebuilt from disk before the next append (cutting the torn part), so no later record points
        at missing bytes."""
        queued, session.pending, session.waiting = session.waiting, [], []
        session.reload_later()
        self._settle(session, [*waiting, *queued], exc)

    def _settle(self, session: _Session, waiting: list[asyncio.Future[None]], exc: BaseException | None = None) -> None:
        """A batch's calls hear how it went; the stream is theirs no longer (it may be evicted once nobody holds it)."""
        for fut in waiting:
            if exc is None:
                _set_result(fut)
            else:
                _set_exception(fut, exc)
        session.users -= len(waiting)
        self._trim()

    async def records(self, session_id: str, attempt: str | None = None, *,
                      latest: bool = True) -> list[CompletionRecord]:
        """The stream's records. With ``attempt=None`` and ``latest``, the session's latest attempt when it has
        one (a gateway session), else its own stream (a standalone proxy's session)."""
        if attempt is None and latest:
            attempt = await self.latest_attempt(session_id)
        key = (session_id, attempt)
        session = self._sessions.get(key)
        if session is None:
            directory = self.stream_dir(session_id, attempt)
            if directory is None or not await asyncio.to_thread((directory / RECORDS_FILE).exists):
                return []
            return await asyncio.to_thread(read_session, directory)  # evicted or never opened: from disk
        session.users += 1
        try:
            async with session.lock:
                if session.directory is None:
                    return session.read()
                return await asyncio.to_thread(session.read)
        finally:
            session.users -= 1

    def sessions(self) -> list[str]:
        return sorted({sid for sid, _ in self._sessions})

    def stored_bytes(self, session_id: str, attempt: str | None = None) -> int:
        session = self._sessions.get((session_id, attempt))
        if session is not None:
            return session.stored_bytes()
        directory = self.stream_dir(session_id, attempt)
        return stored_bytes(directory) if directory is not None and directory.exists() else 0

    def close(self) -> None:
        if self._writer is not None:
            if self._due:  # what this loop iteration encoded: written (or queued to the thread) before it stops
                with contextlib.suppress(RuntimeError):  # its loop is gone: nobody waits for those calls any more
                    self._flush()
            self._writer.close()


def _write_pointer(base: Path, attempt: str) -> None:
    private_dir(base)
    write_secret(base / CURRENT_ATTEMPT, attempt)
