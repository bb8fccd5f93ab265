"""The capture journal's on-disk format: its codec, its layout and its readers. The proxy writes journals
(:mod:`polar_gym.proxy.capture`); the offline merge, bridges and tests read them with :func:`read_session`.

A journal stream (a session, or one dispatch attempt of a gateway session under ``<session>/attempts/<id>/``)
holds three append-only files:

- ``tokens.bin``: uint32 token IDs; ``logprobs.bin``: float64 logprobs of sampled tokens;
- ``records.jsonl``: one line per completion, and before it the blob lines it needs. Token fields are references
  into the binary files, and a prompt is stored as "the first ``keep`` tokens of record ``base``'s
  prompt+response, then this tail". The conversation lists of the request as received and of the normalized
  request are stored the same way, element by element.
- Everything else that repeats without being a prefix (tool lists, system prompts, Responses ``instructions``,
  Google ``systemInstruction``, a message of an edited or compacted history) is stored once per stream: a value
  of at least ``_BLOB_MIN`` serialized bytes (a body's top-level field, or one element of a conversation tail)
  becomes ``{"$ref": <hash>}``, and the first record that needs it is preceded by a blob line
  ``{"$blob": <hash>, "v": <value>}``. The hash is of the value's serialized bytes (SHA-256, first 128 bits).
- An image of a record (``CompletionRecord.images``) is stored once per stream, whatever form each body holds it in
  (a data URL, Anthropic's bare base64): a blob named by the image's SHA-256 (64 hex digits, the record's own
  name for it), and ``{"$img": sha256, "head": "data:...;base64,"}`` in its place inside the conversation item,
  which is stored as ``{"$lift": item, "$imgs": [sha256, ...]}``. A trainer finds an image's pixels by its hash.
- ``$recv`` on a record line says how to rebuild the request body exactly as the harness sent it (byte for byte):
  the name of a serializer that reproduces it from the parsed request, or a ref to the raw body as a blob when
  none does (:func:`read_received`).

An append-only chat of N turns therefore costs about its unique content, not N x context. Data is written before
the line that points at it (binary files first, blob lines before their record line), so a torn write never
yields a record with missing data: :func:`decode` stops at the first line whose data is incomplete. Journals
written before blobs (no ``$blob`` lines, no ``$ref``, no ``$recv``) read unchanged.

Pure but for the small readers at the end; it imports only wire types, so merge reads journals without the proxy.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import threading
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from polar_gym.known_json import CONVERSATION_FIELDS, KNOWN
from polar_gym.known_prompt_ids import PromptIds
from polar_gym.schema import CompletionRecord

__all__ = [
    "ATTEMPTS_DIR",
    "CURRENT_ATTEMPT",
    "JOURNAL_FILES",
    "LOGPROBS_FILE",
    "RECORDS_FILE",
    "TOKENS_FILE",
    "DigestMemo",
    "SessionStore",
    "call_log_entry",
    "common_prefix",
    "count_attempts",
    "decode",
    "decode_received",
    "is_blob_line",
    "is_superseded_attempt",
    "read_current_attempt",
    "read_file",
    "read_received",
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
#: a value this large (serialized) is stored once per stream and referred to by hash
_BLOB_MIN = 256
#: blob hashes an encoder remembers (least recently used first out): its state stays bounded, and a blob it forgot
#: is only written again, never lost
_BLOB_INDEX = 512
#: a body's fields but its conversation this large (serialized, large values as refs) are one blob, its frame
_FRAME_MIN = 64
_BLOB_PREFIX = b'{"$blob":'
_REF, _SHARED, _RECV = "$ref", "$shared", "$recv"
#: a conversation item whose images were lifted out (``{"$lift": item, "$imgs": [sha256, ...]}``; ``"$imgs": null``:
#: the item is kept verbatim, a harness's value that reads as one), and in it an image's place (``{"$img": sha256,
#: "head": "data:image/png;base64,"}``; no head: the bare base64, as Anthropic sends it)
_LIFT, _IMGS, _IMG = "$lift", "$imgs", "$img"
#: a record's fields a call log leaves out: the bodies and the token arrays (counted instead)
_HEAVY_FIELDS = frozenset({"request", "normalized_request", "response", "prompt_ids", "response_ids",
                           "response_logprobs"})
_CALL_ERROR_CHARS = 2000
_CONVERSATION_FIELDS = CONVERSATION_FIELDS
_TOKEN_FIELDS = ("prompt_ids", "response_ids", "response_logprobs")
#: serializers that may reproduce a request body as a harness sent it, tried in order (orjson: Node's
#: JSON.stringify and Rust's serde_json write the same compact UTF-8; the others: Python's json module as clients
#: call it)
_DIALECTS: dict[str, Callable[[Any], bytes]] = {
    # known values (a harness's repeated tools) as the bytes they were parsed from, not serialized again
    "orjson": lambda v: orjson.dumps(KNOWN.as_fragments(v) if isinstance(v, dict) else v),
    "json": lambda v: json.dumps(v).encode(),
    "json_compact": lambda v: json.dumps(v, ensure_ascii=False, separators=(",", ":")).encode(),
    "json_compact_ascii": lambda v: json.dumps(v, separators=(",", ":")).encode(),
    "json_utf8": lambda v: json.dumps(v, ensure_ascii=False).encode(),
}


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
    """How many leading items two lists share: the same objects (a session's known items) or equal ones."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x is not y and x != y:
            break
        n += 1
    return n


def is_blob_line(line: bytes) -> bool:
    """Whether a line of ``records.jsonl`` is a blob (a value records refer to), not a record."""
    return line.lstrip().startswith(_BLOB_PREFIX)


#: what a known value's blob name is kept under (polar_gym.known_json.KnownValues.derive)
_DIGEST = "journal.blob-digest"


def _digest(serialized: bytes) -> bytes:
    """A blob's name: the first 16 bytes of its serialized value's SHA-256."""
    return hashlib.sha256(serialized).digest()[:16]


def _known_digest(value: Any) -> bytes:
    """A known value's blob name (its JSON is known: :meth:`KnownValues.json_of`)."""
    return _digest(KNOWN.json_of(value) or orjson.dumps(value))


def _is_marker(value: Any) -> bool:
    """A dict a decoder would read as a reference: such a value is always stored as a blob, so it reads back as
    itself."""
    return isinstance(value, dict) and (_REF in value or _SHARED in value or _LIFT in value)


def _image_payloads(record: CompletionRecord) -> dict[str, str]:
    """The base64 text of each image of ``record`` (its normalized request's data URLs, in the order of
    ``record.images``) -> the image's SHA-256."""
    if not record.images:
        return {}
    urls = [part["image_url"].get("url", "") for message in record.normalized_request.get("messages") or []
            if isinstance(message, dict) and isinstance(message.get("content"), list)
            for part in message["content"] if isinstance(part, dict) and part.get("type") == "image_url"
            and isinstance(part.get("image_url"), dict)]
    return {url.partition(",")[2]: image["sha256"] for url, image in zip(urls, record.images, strict=False)
            if isinstance(url, str) and url.startswith("data:")}


def _lift_images(value: Any, payloads: dict[str, str], found: list[tuple[str, str]]) -> Any:
    """``value`` with each string that is (or is a data URL of) an image payload replaced by its place; ``found``
    gets (sha256, payload) of each. Raises ValueError on a dict that already looks like a place (kept whole)."""
    if isinstance(value, str):
        head, comma, tail = value.partition(",")
        if value in payloads:
            found.append((payloads[value], value))
            return {_IMG: payloads[value]}
        if comma and head.startswith("data:") and tail in payloads:
            found.append((payloads[tail], tail))
            return {_IMG: payloads[tail], "head": head + comma}
        return value
    if isinstance(value, dict):
        if _IMG in value:
            raise ValueError("a value that reads as an image's place")
        return {k: _lift_images(v, payloads, found) for k, v in value.items()}
    if isinstance(value, list):
        return [_lift_images(v, payloads, found) for v in value]
    return value


def _place_images(value: Any, blobs: dict[str, Any]) -> Any:
    """The inverse of :func:`_lift_images`."""
    if isinstance(value, dict):
        if _IMG in value and isinstance(value[_IMG], str):
            return value.get("head", "") + blobs[value[_IMG]]
        return {k: _place_images(v, blobs) for k, v in value.items()}
    if isinstance(value, list):
        return [_place_images(v, blobs) for v in value]
    return value


class DigestMemo:
    """The blob names of the last large values serialized, keyed by their length: a harness sends the same tools
    and system prompt on every call, so comparing bytes (memcmp) replaces hashing them (SHA-256, ~20x the cost).
    Bounded (``entries`` values of at least ``min_bytes``); one memo serves every stream of a journal, so sessions
    of one harness share it. Thread-safe: a stream reloaded from disk encodes in a worker thread."""

    def __init__(self, entries: int = 32, min_bytes: int = 4096) -> None:
        self.entries = entries
        self.min_bytes = min_bytes
        self._known: collections.OrderedDict[int, tuple[bytes, bytes]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def digest(self, serialized: bytes) -> bytes:
        """The first 16 bytes of ``serialized``'s SHA-256."""
        size = len(serialized)
        if size < self.min_bytes:
            return _digest(serialized)
        with self._lock:
            known = self._known.get(size)
        if known is not None and known[0] == serialized:
            return known[1]
        digest = _digest(serialized)
        with self._lock:
            self._known[size] = (serialized, digest)
            self._known.move_to_end(size)
            if len(self._known) > self.entries:
                self._known.popitem(last=False)
        return digest


@dataclass
class _Recent:
    index: int
    tokens: bytes
    lists: dict[str, list[Any]] = field(default_factory=dict)


class SessionStore:
    """The encoder of one journal stream: what it has written so far (counts, recent records to share with, the
    hashes of its blobs)."""

    def __init__(self, memo: DigestMemo | None = None) -> None:
        self.memo = memo if memo is not None else DigestMemo(entries=4)
        self.count = 0
        self.token_count = 0
        self.logprob_count = 0
        self._recent: collections.deque[_Recent] = collections.deque(maxlen=_RECENT)
        self._blobs: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # digests, 16 bytes each
        self._dialect = "orjson"

    def encode(self, record: CompletionRecord, received: bytes | None = None,
               received_is_orjson: bool = False) -> tuple[bytes, bytes, bytes]:
        """(record lines, token bytes, logprob bytes) for ``record``; updates the store's state. The record lines
        are the blob lines the record needs, then its own line. ``received``: the request body as the harness sent
        it, so :func:`read_received` can give it back byte for byte; ``received_is_orjson``: it is known to be what
        ``orjson.dumps`` writes of the request (:meth:`polar_gym.known_json.KnownValues.loads_checked` proved it),
        so the request is not serialized again to find out."""
        ids = record.prompt_ids
        prompt = ids.packed if type(ids) is PromptIds else array("I", ids)  # packed as the engine's answer was read
        prompt_bytes = prompt.tobytes()
        base, keep = -1, 0
        for recent in self._recent:
            if len(recent.tokens) // 4 <= keep:
                continue  # cannot share more than the best so far
            shared = common_prefix(prompt_bytes, recent.tokens)
            if shared > keep:
                base, keep = recent.index, shared
                if keep == len(prompt):
                    break  # all of it: none can share more (a retry, or a sub-agent's same opening)
        tail = prompt[keep:]
        response = array("I", record.response_ids)
        logprobs = array("d", record.response_logprobs)
        # The record's fields are plain JSON data already; copying them shallowly avoids walking the request tree.
        data = {k: v for k, v in record.__dict__.items() if k not in _TOKEN_FIELDS}
        data["prompt_ids"] = {"base": base, "keep": keep, "off": self.token_count, "len": len(tail)}
        data["response_ids"] = {"off": self.token_count + len(tail), "len": len(response)}
        data["response_logprobs"] = {"off": self.logprob_count, "len": len(logprobs)}
        blobs: list[bytes] = []
        lists: dict[str, list[Any]] = {}
        payloads = _image_payloads(record)
        for key in ("request", "normalized_request"):
            data[key], conv = self._encode_body(key, data[key], blobs, payloads)
            if conv is not None:
                lists[key] = conv
        if received is not None:
            data[_RECV] = "orjson" if received_is_orjson else self._received(record.request, received, blobs)
        self.token_count += len(tail) + len(response)
        self.logprob_count += len(logprobs)
        self._recent.appendleft(_Recent(record.index, prompt_bytes + response.tobytes(), lists))
        self.count += 1
        blobs.append(orjson.dumps(data) + b"\n")
        return b"".join(blobs), tail.tobytes() + response.tobytes(), logprobs.tobytes()

    def _encode_body(self, key: str, body: dict[str, Any], blobs: list[bytes],
                     payloads: dict[str, str]) -> tuple[dict[str, Any] | list[Any], list[Any] | None]:
        """The body with its conversation list prefix-shared, its large values as blob refs, and the rest (what
        repeats call after call: model, limits, metadata, the refs of tools and system prompt) as one blob, the
        body's frame: ``[frame hash, conversation field, packed conversation]`` (key order kept). A new
        conversation item's images (``payloads``) are stored once per stream, as blobs named by their SHA-256,
        whichever form the item holds them in."""
        out: dict[str, Any] = {}
        conv: list[Any] | None = None
        conv_name: str | None = None
        for name, value in body.items():
            if conv is None and name in _CONVERSATION_FIELDS and isinstance(value, list):
                conv, conv_name = value, name
                base, keep = -1, 0
                for recent in self._recent:
                    earlier = recent.lists.get(key)
                    if earlier is None or len(earlier) <= keep:
                        continue  # no list, or it cannot share more than the best so far
                    shared = _list_prefix(value, earlier)
                    if shared > keep:
                        base, keep = recent.index, shared
                        if keep == len(value):
                            break  # the whole list: no record can share more of it
                out[name] = {_SHARED: {"base": base, "keep": keep},
                             "tail": [self._blob_ref(self._lifted(item, payloads, blobs), blobs, repeated=False)
                                      for item in value[keep:]]}
            else:
                out[name] = self._blob_ref(value, blobs)
        frame = orjson.dumps({name: None if name == conv_name else value for name, value in out.items()})
        if len(frame) < _FRAME_MIN:
            return out, conv
        framed = [self._blob(frame, blobs)]
        if conv_name is not None:
            framed += [conv_name, out[conv_name]]
        return framed, conv

    def _lifted(self, item: Any, payloads: dict[str, str], blobs: list[bytes]) -> Any:
        """``item`` itself, or ``{"$lift": item with its images' places}`` when it holds images (each written as a
        blob the first time)."""
        if isinstance(item, dict) and _LIFT in item:
            return {_LIFT: item, _IMGS: None}  # a harness's value that reads as a lifted item: kept verbatim
        if not payloads:
            return item
        found: list[tuple[str, str]] = []
        try:
            lifted = _lift_images(item, payloads, found)
        except ValueError:
            return item  # it holds a value that reads as a place: its images stay in it
        if not found:
            return item
        for sha256, payload in found:
            name = bytes.fromhex(sha256)
            if name in self._blobs:
                self._blobs.move_to_end(name)
                continue
            self._blobs[name] = None
            if len(self._blobs) > _BLOB_INDEX:
                self._blobs.popitem(last=False)
            blobs.append(b'{"$blob":"%s","v":%s}\n' % (sha256.encode(), orjson.dumps(payload)))
        return {_LIFT: lifted, _IMGS: sorted({sha256 for sha256, _ in found})}

    def _blob_ref(self, value: Any, blobs: list[bytes], repeated: bool = True) -> Any:
        """``value`` itself when small, else a ref to its blob (written into ``blobs`` the first time). Not
        ``repeated`` (a conversation's new item, journaled once): its JSON is not asked of the known values, which
        would keep it."""
        if not isinstance(value, (dict, list, str)) or (isinstance(value, str) and len(value) < _BLOB_MIN // 4):
            return value
        known = KNOWN.json_of(value) if repeated else None
        serialized = known or orjson.dumps(value)
        if len(serialized) < _BLOB_MIN and not _is_marker(value):
            return value
        if known is not None:  # a harness's repeated value: its blob's name is computed once
            return {_REF: self._blob(known, blobs, KNOWN.derive(value, _DIGEST, _known_digest))}
        return {_REF: self._blob(serialized, blobs)}

    def _blob(self, serialized: bytes, blobs: list[bytes], digest: bytes | None = None) -> str:
        if digest is None:
            digest = self.memo.digest(serialized)
        name = digest.hex()
        if digest in self._blobs:
            self._blobs.move_to_end(digest)
        else:
            self._blobs[digest] = None
            if len(self._blobs) > _BLOB_INDEX:
                self._blobs.popitem(last=False)
            blobs.append(b'{"$blob":"%s","v":%s}\n' % (name.encode(), serialized))
        return name

    def _received(self, request: dict[str, Any], received: bytes, blobs: list[bytes]) -> Any:
        """How to rebuild ``received`` from the parsed request: a serializer's name (the one that matched last is
        tried first), else the raw body as a blob."""
        for name in sorted(_DIALECTS, key=lambda n: n != self._dialect):
            try:
                if _DIALECTS[name](request) == received:
                    self._dialect = name
                    return name
            except (TypeError, ValueError):
                continue  # a body this serializer cannot write
        try:
            text = received.decode()
        except UnicodeDecodeError:
            return None
        return {"raw": {_REF: self._blob(orjson.dumps(text), blobs)}}


@dataclass
class _Decoded:
    record: CompletionRecord
    received: Any = None


def _resolve(value: Any, blobs: dict[str, Any]) -> Any:
    if isinstance(value, dict) and len(value) == 1 and isinstance(value.get(_REF), str) and value[_REF] in blobs:
        value = blobs[value[_REF]]
    if isinstance(value, dict) and len(value) == 2 and _LIFT in value and _IMGS in value:
        return value[_LIFT] if value[_IMGS] is None else _place_images(value[_LIFT], blobs)
    return value


def _decode(lines: Iterable[bytes], tokens: bytes, logprobs: bytes) -> list[_Decoded]:
    all_tokens = array("I")
    all_tokens.frombytes(tokens[: len(tokens) - len(tokens) % 4])
    all_logprobs = array("d")
    all_logprobs.frombytes(logprobs[: len(logprobs) - len(logprobs) % 8])
    fulls: dict[int, list[int]] = {}
    convs: dict[tuple[int, str], list[Any]] = {}
    blobs: dict[str, Any] = {}
    out = []
    for raw in (line for chunk in lines for line in chunk.splitlines()):  # an append's chunk: blobs + record
        if not raw.strip():
            continue
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            break  # a torn tail: the line itself was cut short
        if "$blob" in data and "completion_id" not in data:
            blobs[data["$blob"]] = data["v"]
            continue
        p, r, lp = data["prompt_ids"], data["response_ids"], data["response_logprobs"]
        prefix = fulls[p["base"]][: p["keep"]] if p["base"] >= 0 else []
        prompt = prefix + all_tokens[p["off"]: p["off"] + p["len"]].tolist()
        response = all_tokens[r["off"]: r["off"] + r["len"]].tolist()
        lps = all_logprobs[lp["off"]: lp["off"] + lp["len"]].tolist()
        if len(prompt) != p["keep"] + p["len"] or len(response) != r["len"] or len(lps) != lp["len"]:
            break  # a torn tail: binary data missing for this line
        data["prompt_ids"], data["response_ids"], data["response_logprobs"] = prompt, response, lps
        index = data["index"]
        for key in ("request", "normalized_request"):
            body = data[key]
            if isinstance(body, list):  # a framed body (a request body itself is always an object)
                framed, body = body, dict(blobs[body[0]])
                if len(framed) == 3:
                    body[framed[1]] = framed[2]
                data[key] = body
            for name, value in body.items():
                if name in _CONVERSATION_FIELDS and isinstance(value, dict) and _SHARED in value:
                    shared = value[_SHARED]
                    head = convs[(shared["base"], key)][: shared["keep"]] if shared["base"] >= 0 else []
                    body[name] = head + [_resolve(item, blobs) for item in value["tail"]]
                    convs[(index, key)] = body[name]
                else:
                    body[name] = _resolve(value, blobs)
        received = data.pop(_RECV, None)
        if isinstance(received, dict):
            received = {"raw": _resolve(received.get("raw"), blobs)}
        fulls[index] = prompt + response
        out.append(_Decoded(CompletionRecord.model_validate(data), received))
    return out


def decode(lines: Iterable[bytes], tokens: bytes, logprobs: bytes) -> list[CompletionRecord]:
    """The records of a stream from its record lines (or appended chunks of them) and binary files, up to the
    first torn one."""
    return [d.record for d in _decode(lines, tokens, logprobs)]


def decode_received(lines: Iterable[bytes], tokens: bytes, logprobs: bytes) -> list[bytes | None]:
    """Per record (as :func:`decode` reads them), the request body exactly as the harness sent it; None where the
    journal does not know it (written before this format, or by a writer that did not pass the raw body)."""
    out: list[bytes | None] = []
    for d in _decode(lines, tokens, logprobs):
        if isinstance(d.received, str) and d.received in _DIALECTS:
            out.append(_DIALECTS[d.received](d.record.request))
        elif isinstance(d.received, dict) and isinstance(d.received.get("raw"), str):
            out.append(d.received["raw"].encode())
        else:
            out.append(None)
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


def read_received(directory: str | Path) -> list[bytes | None]:
    """Per record of a stream directory, the request body exactly as the harness sent it (see
    :func:`decode_received`)."""
    directory = Path(directory)
    return decode_received(read_file(directory / RECORDS_FILE).splitlines(), read_file(directory / TOKENS_FILE),
                           read_file(directory / LOGPROBS_FILE))


def truncate_torn_tail(directory: Path, lines: list[bytes], records: int, store: SessionStore) -> None:
    """Cut what a crash left past the last whole record (binary data no line points at, a cut line), so the next
    append's offsets point at its own bytes. ``lines`` are the stream's record lines (with their ends), ``records``
    how many of them :func:`decode` read, ``store`` an encoder that encoded exactly those records. Blob lines
    after the last whole record go too (their record never made it; the next one that needs them writes them
    again)."""
    kept, seen, end = 0, 0, 0
    for line in lines:
        if seen == records:
            break
        kept += len(line)
        if line.strip() and not is_blob_line(line):
            seen += 1
            end = kept
    sizes = {RECORDS_FILE: end, TOKENS_FILE: 4 * store.token_count, LOGPROBS_FILE: 8 * store.logprob_count}
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
        out[directory.name] = sum(1 for line in read_file(directory / RECORDS_FILE).splitlines()
                                  if line.strip() and not is_blob_line(line))
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
