"""The capture journal: every completion of a session, durably and in order, with prefix-shared token storage.

A session's directory holds three append-only files:

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
import json
import os
import queue
import threading
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from polar_gym.schema import CompletionRecord

__all__ = ["CaptureJournal", "SessionStore", "common_prefix", "read_session"]

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
        data = orjson.loads(raw)
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

    def read(name: str) -> bytes:
        path = directory / name
        return path.read_bytes() if path.exists() else b""

    return _decode(read("records.jsonl").splitlines(), read("tokens.bin"), read("logprobs.bin"))


class _Session:
    def __init__(self, session_id: str, directory: Path | None) -> None:
        self.session_id = session_id
        self.directory = directory
        self.store = SessionStore()
        self.lock = asyncio.Lock()
        self.lines: list[bytes] = []
        self.tokens = bytearray()
        self.logprobs = bytearray()
        if directory is not None and (directory / "records.jsonl").exists():
            self._resume(directory)

    def _resume(self, directory: Path) -> None:
        """Reopen an existing journal (a restarted proxy): rebuild the encoder state from what is on disk."""
        for record in read_session(directory):
            self.store.encode(record)

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
        return sum((self.directory / n).stat().st_size for n in ("records.jsonl", "tokens.bin", "logprobs.bin")
                   if (self.directory / n).exists())


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


class CaptureJournal:
    """All sessions' journals. ``root=None`` keeps them in memory with the same prefix-shared encoding."""

    def __init__(self, root: str | Path | None = None, *, fsync: bool = False, max_pending: int = 256) -> None:
        self.root = Path(root) if root is not None else None
        self.fsync = fsync
        self._sessions: dict[str, _Session] = {}
        self._writer = _Writer(max_pending) if self.root is not None else None

    def _session(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            directory = self.root / _safe_name(session_id) if self.root is not None else None
            session = self._sessions[session_id] = _Session(session_id, directory)
        return session

    def next_index(self, session_id: str) -> int:
        return self._session(session_id).store.count

    async def append(self, record: CompletionRecord) -> CompletionRecord:
        """Journal ``record`` as the session's next completion; returns it with its index set. Returns only once
        the record is written (to the OS, or to disk with ``fsync``)."""
        session = self._session(record.session_id)
        async with session.lock:
            record.index = session.store.count
            line, tokens, logprobs = session.store.encode(record)
            if self._writer is None:
                session.write(line, tokens, logprobs, False)
            else:
                await self._writer.submit(lambda: session.write(line, tokens, logprobs, self.fsync))
        return record

    async def records(self, session_id: str) -> list[CompletionRecord]:
        session = self._sessions.get(session_id)
        if session is None:
            if self.root is None or not (self.root / _safe_name(session_id)).exists():
                return []
            session = self._session(session_id)
        async with session.lock:
            if session.directory is None:
                return session.read()
            return await asyncio.to_thread(session.read)

    def sessions(self) -> list[str]:
        return sorted(self._sessions)

    def stored_bytes(self, session_id: str) -> int:
        return self._session(session_id).stored_bytes()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _safe_name(session_id: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in session_id)
    if safe != session_id or safe.startswith("."):
        safe = f"{safe.lstrip('.')}-{json.dumps(session_id).encode().hex()[:16]}"
    return safe
