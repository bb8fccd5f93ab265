"""A session result's compact binary form: what gateways send the rollout server and what its store keeps.

As JSON a 30k-token result is about 1.6 MB (a logprob is ``{"token", "token_id", "logprob"}``, ~50 bytes a token)
and turning it into Python objects and back cost the server ~205 ms of CPU (docs/scaling.md). Packed:

- token ids are uint32, zlib-compressed (to about a third on code: their high bytes are zero and code repeats); a
  trace's prompt that starts with an earlier trace's prompt+response (every call of a growing session, under
  ``per_request``) is stored as "the first ``keep`` tokens of trace ``base``, then this tail", as the capture
  journal stores prompts;
- logprobs are float64 (exact: a trainer's ratio needs the engine's own values), stored only where they are not
  +0.0 (``prefix_merging`` gives every tool-output token a 0.0 placeholder: most of a long trace), with one bit a
  position saying which; loss masks are one bit a token;
- everything else (messages, tools, metadata, the evaluation) is JSON, zlib-compressed.

Layout (little-endian): ``MAGIC``, then five uint32 lengths (head bytes, body bytes, token-id bytes, stored
logprobs, bit bytes), then the sections in that order; the bits are every loss mask, then every logprob position's
"stored" bit. The head is a small JSON object (:class:`~polar_gym.schema.ResultHead`): what the server needs to
file a result (ids, status, attempt, reward, sizes) without decoding the rest, so its event loop never parses a
large result. Pure: no I/O.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from polar_gym.schema import ResultHead, SessionResult, SessionStatus

__all__ = ["MAGIC", "MEDIA_TYPE", "PackedResult", "frame_results", "head", "is_packed", "pack",
           "read_frame", "unique_token_bytes", "unpack", "without_tokens"]

MAGIC = b"PGR\x01"
#: the media type of a frame of packed results (:func:`frame_results`): a poll answer, a task's results, a callback
MEDIA_TYPE = "application/vnd.polar-gym.result"
_LENGTHS = struct.Struct("<5I")
_PREFIX = len(MAGIC) + _LENGTHS.size
_TOKEN_FIELDS = ("prompt_ids", "response_ids", "loss_mask", "response_logprobs")


@dataclass(frozen=True)
class PackedResult:
    """A packed result and its head: what the rollout server files, stores and hands on without decoding."""

    data: bytes
    head: ResultHead

    @classmethod
    def of(cls, data: bytes) -> PackedResult:
        """ValueError when ``data`` is not a whole packed result."""
        return cls(data, head(data))

    @property
    def session_id(self) -> str:
        return self.head.session_id

    @property
    def task_id(self) -> str:
        return self.head.task_id

    @property
    def status(self) -> SessionStatus:
        return self.head.status

    @property
    def reason(self) -> str | None:
        return self.head.reason


def is_packed(data: bytes | memoryview) -> bool:
    return bytes(data[:len(MAGIC)]) == MAGIC


def _lengths(data: bytes | memoryview) -> tuple[int, int, int, int, int]:
    if len(data) < _PREFIX or not is_packed(data):
        raise ValueError("not a packed session result (bad magic or too short)")
    lengths: tuple[int, int, int, int, int] = _LENGTHS.unpack_from(data, len(MAGIC))
    head_len, body_len, ids, logprobs, mask = lengths
    if _PREFIX + head_len + body_len + ids + 8 * logprobs + mask != len(data):
        raise ValueError("a packed session result whose sections do not add up to its length (truncated?)")
    return lengths


def head(data: bytes | memoryview) -> ResultHead:
    """The head alone: a few hundred bytes read, whatever the result's size."""
    head_len = _lengths(data)[0]
    return ResultHead.model_validate_json(bytes(data[_PREFIX:_PREFIX + head_len]))


def unique_token_bytes(h: ResultHead) -> int:
    """The bytes the result's unique tokens take at their native widths (uint32 ids, float64 logprobs): the floor
    a packed result is measured against."""
    return 4 * h.token_ids + 8 * h.logprobs


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def pack(result: SessionResult, *, retained: str | None = None) -> bytes:
    """``result`` packed (see the module docstring); ``retained`` marks a result a retention policy cut down."""
    data = result.model_dump(mode="json", exclude={"trajectory": {"traces": {"__all__": set(_TOKEN_FIELDS)}}})
    traces = result.trajectory.traces if result.trajectory is not None else []
    ids: list[np.ndarray] = []
    logprobs: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    sequences: list[np.ndarray] = []  # each trace's prompt+response, for the later traces' prefixes
    for trace, shape in zip(traces, data["trajectory"]["traces"] if traces else [], strict=True):
        prompt = np.asarray(trace.prompt_ids, dtype=np.uint32)
        response = np.asarray(trace.response_ids, dtype=np.uint32)
        base, keep = -1, 0
        for j, earlier in enumerate(sequences):
            n = _common(earlier, prompt)
            if n > keep:
                base, keep = j, n
        tail = prompt[keep:]
        ids += [tail, response]
        shape["$tokens"] = {"base": base, "keep": keep, "tail": len(tail), "response": len(response),
                            "logprobs": len(trace.response_logprobs)}
        logprobs.append(np.asarray(trace.response_logprobs, dtype="<f8"))
        masks.append(np.asarray(trace.loss_mask, dtype=np.uint8))
        sequences.append(np.concatenate([prompt, response]))
    token_ids = np.concatenate(ids).astype("<u4") if ids else np.zeros(0, "<u4")
    every_logprob = np.concatenate(logprobs) if logprobs else np.zeros(0, "<f8")
    stored = every_logprob.view("<u8") != 0  # +0.0 is all zero bits; -0.0 and every other value are kept
    all_logprobs = every_logprob[stored]
    mask_bits = np.packbits(np.concatenate([*masks, stored.astype(np.uint8)])) if masks else np.zeros(0, np.uint8)
    evaluation = result.evaluation
    found = result.metadata.get("artifacts")
    artifacts: dict[str, Any] = found if isinstance(found, dict) else {}
    diagnostics = result.trajectory.diagnostics if result.trajectory is not None else {}
    seconds = result.timings.get("total")
    head_bytes = ResultHead(
        session_id=result.session_id, task_id=result.task_id, status=result.status, reason=result.reason,
        attempt_id=_str(result.metadata.get("attempt_id")), reward=evaluation.reward if evaluation else None,
        error_cause=_str(artifacts.get("error_cause")), traces=len(traces),
        completions=diagnostics.get("completions") if isinstance(diagnostics.get("completions"), int) else None,
        seconds=seconds if isinstance(seconds, int | float) else None, token_ids=len(token_ids),
        logprobs=len(all_logprobs), retained=retained).model_dump_json(exclude_defaults=True).encode()
    body = zlib.compress(orjson.dumps(data), 6)
    packed_ids = zlib.compress(token_ids.tobytes(), 6)
    return b"".join((MAGIC, _LENGTHS.pack(len(head_bytes), len(body), len(packed_ids), len(all_logprobs),
                                          len(mask_bits)),
                     head_bytes, body, packed_ids, all_logprobs.tobytes(), mask_bits.tobytes()))


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _body(data: bytes | memoryview, head_len: int, body_len: int) -> Any:
    at = _PREFIX + head_len
    try:
        return orjson.loads(zlib.decompress(data[at:at + body_len]))
    except (zlib.error, orjson.JSONDecodeError) as exc:
        raise ValueError(f"a packed session result with an unreadable body: {exc}") from exc


def without_tokens(data: bytes | memoryview) -> dict[str, Any]:
    """The result as JSON without its traces' token arrays (statuses, timings, metadata, the evaluation): a few
    KB decoded, for readers that need no tokens."""
    head_len, body_len, *_ = _lengths(data)
    body = _body(data, head_len, body_len)
    if not isinstance(body, dict):
        raise ValueError("a packed session result whose body is not an object")
    return body


def unpack(data: bytes | memoryview) -> SessionResult:
    """The result ``pack`` packed; ValueError when ``data`` is not a whole, consistent packed result."""
    head_len, body_len, ids_len, n_logprobs, n_mask = _lengths(data)
    body = _body(data, head_len, body_len)
    at = _PREFIX + head_len + body_len
    try:
        raw_ids = zlib.decompress(data[at:at + ids_len])
    except zlib.error as exc:
        raise ValueError(f"a packed session result with unreadable token ids: {exc}") from exc
    if len(raw_ids) % 4:
        raise ValueError("a packed session result whose token ids are not whole uint32s")
    token_ids = np.frombuffer(raw_ids, dtype="<u4")
    n_ids = len(token_ids)
    at += ids_len
    all_logprobs = np.frombuffer(data, dtype="<f8", count=n_logprobs, offset=at)
    at += 8 * n_logprobs
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8, count=n_mask, offset=at))
    trajectory = body.get("trajectory") if isinstance(body, dict) else None
    shapes = trajectory.get("traces", []) if isinstance(trajectory, dict) else []
    sequences: list[np.ndarray] = []
    mask_total = sum(int(s["$tokens"]["response"]) for s in shapes if isinstance(s, dict)
                     and isinstance(s.get("$tokens"), dict) and isinstance(s["$tokens"].get("response"), int))
    mask_bits, stored_bits = bits[:mask_total], bits[mask_total:]
    if np.count_nonzero(stored_bits) != n_logprobs:
        raise ValueError("a packed session result whose logprob bits do not match its logprobs")
    value_at = np.cumsum(stored_bits) - 1  # the index of each stored position's value
    ids_at = logprobs_at = mask_at = 0
    for shape in shapes:
        layout = shape.pop("$tokens", None) if isinstance(shape, dict) else None
        if not isinstance(layout, dict):
            raise ValueError("a packed trace without its token layout")
        base, keep, tail, response, logprobs = (int(layout[k]) for k in ("base", "keep", "tail", "response",
                                                                          "logprobs"))
        if not -1 <= base < len(sequences) or (base >= 0 and keep > len(sequences[base])) or (base < 0 and keep) \
                or ids_at + tail + response > n_ids or logprobs_at + logprobs > len(stored_bits) \
                or mask_at + response > len(mask_bits):
            raise ValueError("a packed trace whose token layout points outside the result")
        prefix = sequences[base][:keep] if base >= 0 else token_ids[:0]
        prompt = np.concatenate([prefix, token_ids[ids_at:ids_at + tail]])
        ids_at += tail
        answer = token_ids[ids_at:ids_at + response]
        ids_at += response
        sequences.append(np.concatenate([prompt, answer]))
        shape["prompt_ids"], shape["response_ids"] = prompt.tolist(), answer.tolist()
        present = stored_bits[logprobs_at:logprobs_at + logprobs].astype(bool)
        values = np.zeros(logprobs, "<f8")
        values[present] = all_logprobs[value_at[logprobs_at:logprobs_at + logprobs][present]]
        shape["response_logprobs"] = values.tolist()
        logprobs_at += logprobs
        shape["loss_mask"] = mask_bits[mask_at:mask_at + response].tolist()
        mask_at += response
    return SessionResult.model_validate(body)


_U32 = struct.Struct("<I")


def frame_results(results: list[bytes], rest: dict[str, Any]) -> bytes:
    """Packed results with JSON beside them (a poll answer, a task view, a callback): uint32 length + JSON (``rest``
    and the results' byte lengths), then the results back to back."""
    meta = orjson.dumps({**rest, "results": [len(r) for r in results]})
    return b"".join((_U32.pack(len(meta)), meta, *results))


def read_frame(data: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """``frame_results``'s JSON and results (each still to be checked with :meth:`PackedResult.of`); ValueError when
    the frame does not add up."""
    if len(data) < _U32.size:
        raise ValueError("a frame of packed results shorter than its length field")
    (meta_len,) = _U32.unpack_from(data)
    try:
        meta = orjson.loads(data[_U32.size:_U32.size + meta_len])
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"a frame of packed results whose JSON part is unreadable: {exc}") from exc
    sizes = meta.get("results") if isinstance(meta, dict) else None
    if not isinstance(sizes, list) or not all(isinstance(n, int) and n >= 0 for n in sizes):
        raise ValueError("a frame of packed results without its list of result lengths")
    at = _U32.size + meta_len
    if at + sum(sizes) != len(data):
        raise ValueError("a frame of packed results whose results do not add up to its length")
    results = []
    for n in sizes:
        results.append(data[at:at + n])
        at += n
    return meta, results
