"""The capture journal: every completion of a session, durably and in order, with prefix-shared token storage.

A journal stream (a session, or one dispatch attempt of a gateway session under ``<session>/attempts/<id>/``)
holds three append-only files:

- ``tokens.bin``: uint32 token IDs; ``logprobs.bin``: float64 logprobs of sampled tokens;
- ``records.jsonl``: one line per completion. Token fields are references into the binary files, and a prompt is
  stored as "the first ``keep`` tokens of record ``base``'s prompt+response, then this tail". The conversation
  lists of the request as received and of the normalized request are stored the same way, element by element.

An append-only chat of N turns therefore costs about its unique tokens, not N x context. Binary data is written
before the line that points at it, so a torn write never yields a record with missing tokens. A writer thread does
the file I/O; appends wait for it (bounded), so under pressure the proxy slows down instead of dropping records.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import queue
import threading
from array import array
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from polar_gym.dirnames import dirname_for
from polar_gym.schema import CompletionRecord

__all__ = ["ATTEMPTS_DIR", "CURRENT_ATTEMPT", "CaptureJournal", "SessionStore", "common_prefix", "read_session"]

_RECENT = 16  # earlier records searched for a shared prefix
_CONVERSATION_FIELDS = ("messages", "input", "contents")
_TOKEN_FIELDS = ("prompt_ids", "response_ids", "response_logprobs")


def common_prefix(a: bytes, b: bytes) -> int:
    """Number of shared leading uint32 tokens of two little-endian token byte strings. The usual case (one is a
    prefix of the other) is a single memcmp; otherwise a binary search over slices."""
    n = min(len(a), len(b)) // 4
    if a.startswith(b[: 4 * n]):
        return n
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[4 * lo: 4 * mid] == b[4 * lo: 4 * mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _list_prefix(a: list[Any], b: list[Any]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class _Recent:
    index: int
    tokens: bytes
    lists: dict[str, list[Any]] = field(default_factory=dict)


class SessionStore:
    """The encoder/decoder of one session's journal, over any byte sink (files or memory)."""

    def __init__(self) -> None:
        self.count = 0
        self.token_count = 0
        self.logprob_count = 0
        self._recent: collections.deque[_Recent] = collections.deque(maxlen=_RECENT)

    # -- encoding -------------------------------------------------------------------------------------------
    def encode(self, record: CompletionRecord) -> tuple[bytes, bytes, bytes]:
        """(record line, token bytes, logprob bytes) for ``record``; updates the store's state."""
        prompt = array("I", record.prompt_ids)
        prompt_bytes = prompt.tobytes()
        base, keep = -1, 0
        for recent in self._recent:
            if len(recent.tokens) // 4 <= keep:
                continue  # cannot share more than the best so far
            shared = common_prefix(prompt_bytes, recent.tokens)
            if shared > keep:
                base, keep = recent.index, shared
        tail = prompt[keep:]
        response = array("I", record.response_ids)
        logprobs = array("d", record.response_logprobs)
        # The record's fields are plain JSON data already; copying them shallowly avoids walking the request tree.
        data = {k: v for k, v in record.__dict__.items() if k not in _TOKEN_FIELDS}
        data["prompt_ids"] = {"base": base, "keep": keep, "off": self.token_count, "len": len(tail)}
        data["response_ids"] = {"off": self.token_count + len(tail), "len": len(response)}
        data["response_logprobs"] = {"off": self.logprob_count, "len": len(logprobs)}
        lists: dict[str, list[Any]] = {}
        for key in ("request", "normalized_request"):
            data[key], conv = self._encode_lists(key, dict(data[key]))
            if conv is not None:
                lists[key] = conv
        self.token_count += len(tail) + len(response)
        self.logprob_count += len(logprobs)
        self._recent.appendleft(_Recent(record.index, prompt_bytes + response.tobytes(), lists))
        self.count += 1
        line = orjson.dumps(data) + b"\n"
        return line, tail.tobytes() + response.tobytes(), logprobs.tobytes()

    def _encode_lists(self, key: str, body: dict[str, Any]) -> tuple[dict[str, Any], list[Any] | None]:
        for name in _CONVERSATION_FIELDS:
            conv = body.get(name)
            if not isinstance(conv, list):
                continue
            base, keep = -1, 0
            for recent in self._recent:
                if len(recent.lists.get(key, ())) <= keep:
                    continue  # cannot share more than the best so far
                shared = _list_prefix(conv, recent.lists.get(key, []))
                if shared > keep:
                    base, keep = recent.index, shared
            body[name] = {"$shared": {"base": base, "keep": keep}, "tail": conv[keep:]}
            return body, conv
        return body, None


def _decode(lines: list[bytes], tokens: bytes, logprobs: bytes) -> list[CompletionRecord]:
    all_tokens = array("I")
    all_tokens.frombytes(tokens[: len(tokens) - len(tokens) % 4])
    all_logprobs = array("d")
    all_logprobs.frombytes(logprobs[: len(logprobs) - len(logprobs) % 8])
    fulls: dict[int, list[int]] = {}
    convs: dict[tuple[int, str], list[Any]] = {}
    out = []
    for raw in lines:
        if not raw.strip():
            continue
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            break  # a torn tail: the line itself was cut short
        p, r, lp = data["prompt_ids"], data["response_ids"], data["response_logprobs"]
        prefix = fulls[p["base"]][: p["keep"]] if p["base"] >= 0 else []
        prompt = prefix + all_tokens[p["off"]: p["off"] + p["len"]].tolist()
        response = all_tokens[r["off"]: r["off"] + r["len"]].tolist()
        if len(prompt) != p["keep"] + p["len"] or len(response) != r["len"]:
            break  # a torn tail: binary data missing for this line
        data["prompt_ids"], data["response_ids"] = prompt, response
        data["response_logprobs"] = all_logprobs[lp["off"]: lp["off"] + lp["len"]].tolist()
        index = data["index"]
        for key in ("request", "normalized_request"):
            body = data[key]
            for name in _CONVERSATION_FIELDS:
                packed = body.get(name)
                if isinstance(packed, dict) and "$shared" in packed:
                    shared = packed["$shared"]
                    head = convs[(shared["base"], key)][: shared["keep"]] if shared["base"] >= 0 else []
                    body[name] = head + packed["tail"]
                    convs[(index, key)] = body[name]
                    break
        fulls[index] = prompt + response
        out.append(CompletionRecord.model_validate(data))
    return out


def read_session(directory: str | Path) -> list[CompletionRecord]:
    """Read a session's journal back exactly, from its directory."""
    directory = Path(directory)

    return _decode(_read(directory / "records.jsonl").splitlines(), _read(directory / "tokens.bin"),
                   _read(directory / "logprobs.bin"))


class _Session:
    """One journal stream's encoder state and, in memory mode, its bytes. ``users`` counts the calls holding it, so
    eviction never drops a stream that a call is about to write (two encoders on one directory would corrupt it)."""

    def __init__(self, session_id: str, directory: Path | None) -> None:
        self.session_id = session_id
        self.directory = directory
        self.store = SessionStore()
        self.lock = asyncio.Lock()
        self.users = 0
        self.loaded = directory is None
        self.lines: list[bytes] = []
        self.tokens = bytearray()
        self.logprobs = bytearray()

    def load(self) -> None:
        """Reopen an existing journal (a restarted proxy, or a stream evicted from memory): rebuild the encoder
        state from disk, and cut a torn tail off so the next record's offsets point at its own bytes."""
        assert self.directory is not None
        self.loaded = True
        path = self.directory / "records.jsonl"
        if not path.exists():
            return
        raw = path.read_bytes()
        lines = raw.splitlines(keepends=True)
        records = _decode(lines, _read(self.directory / "tokens.bin"), _read(self.directory / "logprobs.bin"))
        for record in records:
            self.store.encode(record)
        kept, seen = 0, 0
        for line in lines:
            if seen == len(records):
                break
            kept += len(line)
            seen += bool(line.strip())
        sizes = {"records.jsonl": kept, "tokens.bin": 4 * self.store.token_count,
                 "logprobs.bin": 8 * self.store.logprob_count}
        for name, size in sizes.items():
            target = self.directory / name
            if target.exists() and target.stat().st_size > size:
                os.truncate(target, size)

    def write(self, line: bytes, tokens: bytes, logprobs: bytes, fsync: bool) -> None:
        if self.directory is None:
            self.tokens += tokens
            self.logprobs += logprobs
            self.lines.append(line)
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        for name, payload in (("tokens.bin", tokens), ("logprobs.bin", logprobs), ("records.jsonl", line)):
            with open(self.directory / name, "ab") as fh:
                fh.write(payload)
                fh.flush()
                if fsync:
                    os.fsync(fh.fileno())

    def read(self) -> list[CompletionRecord]:
        if self.directory is None:
            return _decode(self.lines, bytes(self.tokens), bytes(self.logprobs))
        return read_session(self.directory)

    def stored_bytes(self) -> int:
        if self.directory is None:
            return sum(map(len, self.lines)) + len(self.tokens) + len(self.logprobs)
        return _stored_bytes(self.directory)


def _read(path: Path) -> bytes:
    return path.read_bytes() if path.exists() else b""


def _stored_bytes(directory: Path) -> int:
    return sum((directory / n).stat().st_size for n in ("records.jsonl", "tokens.bin", "logprobs.bin")
               if (directory / n).exists())


class _Writer:
    """One thread doing all journal file I/O, so the event loop never blocks on disk."""

    def __init__(self, max_pending: int) -> None:
        self._queue: queue.Queue[tuple[Callable[[], None], asyncio.Future[None]] | None] = queue.Queue(max_pending)
        self._thread = threading.Thread(target=self._run, name="polar-capture-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
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
            try:
                self._queue.put_nowait((job, fut))
                break
            except queue.Full:
                await asyncio.sleep(0.005)  # back-pressure: the request waits, nothing is dropped
        await fut

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)


def _set_result(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future[None], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


#: a session's journal streams live under ``<root>/<session>/attempts/<attempt>/``; this file names the latest
CURRENT_ATTEMPT = "current-attempt"
ATTEMPTS_DIR = "attempts"

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
            session = self._sessions[key] = _Session(key[0], self.stream_dir(*key))
        else:
            self._sessions.move_to_end(key)
        return session

    def _trim(self) -> None:
        if len(self._sessions) <= self.max_open:
            return
        for key in [k for k, s in self._sessions.items() if s.users == 0]:
            if len(self._sessions) <= self.max_open:
                break
            del self._sessions[key]

    @contextlib.asynccontextmanager
    async def _use(self, key: _Key) -> AsyncIterator[_Session]:
        session = self._open(key)
        session.users += 1
        try:
            async with session.lock:
                if not session.loaded:
                    await asyncio.to_thread(session.load)
                yield session
        finally:
            session.users -= 1
            self._trim()

    def release(self, session_id: str, attempt: str | None = None) -> None:
        """The stream is final (its session's result is out): drop its state from memory. On disk it stays
        readable; in memory it is kept only until ``max_open`` newer streams push it out."""
        key = (session_id, attempt)
        session = self._sessions.get(key)
        if session is None:
            return
        if self.root is not None and session.users == 0:
            del self._sessions[key]
        else:
            self._sessions.move_to_end(key, last=False)  # first in line for eviction
        if self.root is not None and self._latest.get(session_id) == attempt:
            self._latest.pop(session_id, None)  # the pointer file on disk still names it

    def open_streams(self) -> int:
        """Streams whose state is held in memory (bounded by ``max_open``)."""
        return len(self._sessions)

    # -- attempts --------------------------------------------------------------------------------------------

    async def begin_attempt(self, session_id: str, attempt: str) -> None:
        """Make ``attempt`` the session's latest: what reading the session without an attempt returns."""
        self._latest[session_id] = attempt
        self._latest.move_to_end(session_id)
        while len(self._latest) > self.max_open:
            self._latest.popitem(last=False)
        base = self.session_dir(session_id)
        if base is not None and self._writer is not None:
            await self._writer.submit(lambda: _write_pointer(base, attempt))

    async def latest_attempt(self, session_id: str) -> str | None:
        attempt = self._latest.get(session_id)
        base = self.session_dir(session_id)
        if attempt is None and base is not None:
            attempt = await asyncio.to_thread(_read_pointer, base)
        return attempt

    async def attempts(self, session_id: str) -> dict[str, int]:
        """Every attempt of the session on disk (or in memory), with its number of records."""
        base = self.session_dir(session_id)
        if base is None:
            return {a: s.store.count for (sid, a), s in self._sessions.items() if sid == session_id and a}
        return await asyncio.to_thread(_count_attempts, base / ATTEMPTS_DIR)

    # -- records ---------------------------------------------------------------------------------------------

    async def append(self, record: CompletionRecord, attempt: str | None = None) -> CompletionRecord:
        """Journal ``record`` as the next completion of its session's stream (``attempt``); returns it with its index
        set. Returns only once the record is written (to the OS, or to disk with ``fsync``)."""
        async with self._use((record.session_id, attempt)) as session:
            record.index = session.store.count
            line, tokens, logprobs = session.store.encode(record)
            if self._writer is None:
                session.write(line, tokens, logprobs, False)
            else:
                await self._writer.submit(lambda: session.write(line, tokens, logprobs, self.fsync))
        return record

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
            if directory is None or not await asyncio.to_thread((directory / "records.jsonl").exists):
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
        return _stored_bytes(directory) if directory is not None and directory.exists() else 0

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _write_pointer(base: Path, attempt: str) -> None:
    base.mkdir(parents=True, exist_ok=True)
    tmp = base / f".{CURRENT_ATTEMPT}.tmp"
    tmp.write_text(attempt)
    os.replace(tmp, base / CURRENT_ATTEMPT)


def _read_pointer(base: Path) -> str | None:
    try:
        return (base / CURRENT_ATTEMPT).read_text().strip() or None
    except FileNotFoundError:
        return None


def _count_attempts(attempts_dir: Path) -> dict[str, int]:
    if not attempts_dir.is_dir():
        return {}
    out = {}
    for directory in sorted(attempts_dir.iterdir()):
        records = directory / "records.jsonl"
        out[directory.name] = sum(1 for line in _read(records).splitlines() if line.strip())
    return out


