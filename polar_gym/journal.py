"""The capture journal's on-disk format: its codec, its layout and its readers. The proxy writes journals
(:mod:`polar_gym.proxy.capture`); the offline merge, bridges and tests read them with :func:`read_session`.

A journal stream (a session, or one dispatch attempt of a gateway session under ``<session>/attempts/<id>/``)
holds three append-only files:

- ``tokens.bin``: uint32 token IDs; ``logprobs.bin``: float64 logprobs of sampled tokens;
- ``records.jsonl``: one line per completion. Token fields are references into the binary files, and a prompt is
  stored as "the first ``keep`` tokens of record ``base``'s prompt+response, then this tail". The conversation
  lists of the request as received and of the normalized request are stored the same way, element by element.

An append-only chat of N turns therefore costs about its unique tokens, not N x context. Binary data is written
before the line that points at it, so a torn write never yields a record with missing tokens: :func:`decode`
stops at the first line whose data is incomplete.

Pure but for the small readers at the end; it imports only wire types, so merge reads journals without the proxy.
"""

from __future__ import annotations

import collections
import os
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from polar_gym.schema import CompletionRecord

__all__ = [
    "ATTEMPTS_DIR",
    "CURRENT_ATTEMPT",
    "JOURNAL_FILES",
    "LOGPROBS_FILE",
    "RECORDS_FILE",
    "TOKENS_FILE",
    "SessionStore",
    "call_log_entry",
    "common_prefix",
    "count_attempts",
    "decode",
    "is_superseded_attempt",
    "read_current_attempt",
    "read_file",
    "read_session",
    "stored_bytes",
    "truncate_torn_tail",
]

RECORDS_FILE = "records.jsonl"
TOKENS_FILE = "tokens.bin"
LOGPROBS_FILE = "logprobs.bin"
#: the files of one stream, in the order an append writes them (data before the line pointing at it)
JOURNAL_FILES = (TOKENS_FILE, LOGPROBS_FILE, RECORDS_FILE)
#: a session's journal streams live under ``<root>/<session>/attempts/<attempt>/``; this file names the latest
CURRENT_ATTEMPT = "current-attempt"
ATTEMPTS_DIR = "attempts"

_RECENT = 16  # earlier records searched for a shared prefix
#: a record's fields a call log leaves out: the bodies and the token arrays (counted instead)
_HEAVY_FIELDS = frozenset({"request", "normalized_request", "response", "prompt_ids", "response_ids",
                           "response_logprobs"})
_CALL_ERROR_CHARS = 2000
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
    """The encoder of one journal stream: what it has written so far (counts, recent records to share with)."""

    def __init__(self) -> None:
        self.count = 0
        self.token_count = 0
        self.logprob_count = 0
        self._recent: collections.deque[_Recent] = collections.deque(maxlen=_RECENT)

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


def decode(lines: list[bytes], tokens: bytes, logprobs: bytes) -> list[CompletionRecord]:
    """The records of a stream from its record lines and binary files, up to the first torn one."""
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


# -- readers ---------------------------------------------------------------------------------------------------


def read_file(path: Path) -> bytes:
    """A journal file's bytes; a file not written yet is empty."""
    return path.read_bytes() if path.exists() else b""


def read_session(directory: str | Path) -> list[CompletionRecord]:
    """Read a session's journal (one stream directory) back exactly."""
    directory = Path(directory)
    return decode(read_file(directory / RECORDS_FILE).splitlines(), read_file(directory / TOKENS_FILE),
                  read_file(directory / LOGPROBS_FILE))


def truncate_torn_tail(directory: Path, lines: list[bytes], records: int, store: SessionStore) -> None:
    """Cut what a crash left past the last whole record (binary data no line points at, a cut line), so the next
    append's offsets point at its own bytes. ``lines`` are the stream's record lines (with their ends), ``records``
    how many of them :func:`decode` read, ``store`` an encoder that encoded exactly those records."""
    kept, seen = 0, 0
    for line in lines:
        if seen == records:
            break
        kept += len(line)
        seen += bool(line.strip())
    sizes = {RECORDS_FILE: kept, TOKENS_FILE: 4 * store.token_count, LOGPROBS_FILE: 8 * store.logprob_count}
    for name, size in sizes.items():
        target = directory / name
        if target.exists() and target.stat().st_size > size:
            os.truncate(target, size)


def stored_bytes(directory: Path) -> int:
    """Bytes a stream takes on disk."""
    return sum((directory / n).stat().st_size for n in JOURNAL_FILES if (directory / n).exists())


def read_current_attempt(session_dir: Path) -> str | None:
    """The latest attempt of a gateway session (None: the session has no attempts, or none begun yet)."""
    try:
        return (session_dir / CURRENT_ATTEMPT).read_text().strip() or None
    except FileNotFoundError:
        return None


def count_attempts(session_dir: Path) -> dict[str, int]:
    """Every attempt of a session on disk, with its number of records."""
    attempts_dir = session_dir / ATTEMPTS_DIR
    if not attempts_dir.is_dir():
        return {}
    out = {}
    for directory in sorted(attempts_dir.iterdir()):
        out[directory.name] = sum(1 for line in read_file(directory / RECORDS_FILE).splitlines() if line.strip())
    return out


def is_superseded_attempt(directory: Path) -> bool:
    """Whether a stream directory is an earlier dispatch attempt of a gateway session (``<session>/attempts/<id>/``,
    not the one the session's ``current-attempt`` names): a dead gateway's calls, reported but never trained."""
    if directory.parent.name != ATTEMPTS_DIR:
        return False
    pointer = directory.parent.parent / CURRENT_ATTEMPT
    try:
        return pointer.read_text().strip() != directory.name
    except OSError:
        return False


def call_log_entry(record: CompletionRecord) -> dict[str, Any]:
    """One model call without its bodies and token arrays (a count of each): timings, engine, server, policy
    version, prompt mode, status. A gateway ships a session's call log with its result, so the trace viewer shows
    per-call timings when the journal itself stays on a node's local scratch (or on a live server)."""
    entry = record.model_dump(mode="json", exclude=set(_HEAVY_FIELDS))
    entry["prompt_tokens"], entry["response_tokens"] = len(record.prompt_ids), len(record.response_ids)
    if isinstance(entry.get("error"), str) and len(entry["error"]) > _CALL_ERROR_CHARS:
        entry["error"] = entry["error"][:_CALL_ERROR_CHARS] + "..."
    return entry
