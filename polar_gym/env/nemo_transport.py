"""polar_gym's capture journal as a NeMo Gym 0.7 token-capture transport: ``TokenSink``, ``TokenSource`` and
``LineageResolver`` (``nemo_gym.token_id_capture.protocols``) over one directory of journal streams.

Runs in NeMo Gym's interpreter (it imports ``nemo_gym``) with polar_gym importable (the directory holding the
``polar_gym`` package on ``sys.path``); the journal's codec is :mod:`polar_gym.journal`'s, not a copy. A rollout is
the stream ``<root>/<rollout dir>/`` (``polar_gym.dirnames``), or, for a gateway session, its current attempt:

- ``put`` appends a ``TokenEntry`` as a journal record (its token arrays in the binary files, every other field in
  the record's ``response``), fsynced, under an exclusive file lock, before it returns: a fresh client on any
  process of the machine (or of a shared file system with working ``flock``) sees it. The same payload again is a
  no-op; another payload under the same call id raises.
- records the proxy wrote (a root pointed at a gateway's or proxy's captures) read back as ``TokenEntry`` records
  with their lineage (:mod:`polar_gym.env.token_lineage`): every chain, sub-agents and post-compaction contexts as
  roots, retries as branches with their parent links.
- ``freeze`` / ``mark_incomplete`` / ``drop`` keep a small state file per stream (frozen, snapshot id, version,
  incomplete calls, retired). A write after a freeze bumps the version, so a stale ``drop`` fails. ``drop`` retires
  the rollout and keeps its journal (polar_gym owns retention: its journals are its evidence).

NeMo RL wiring (``env.nemo_gym.token_id_capture``): ``sink: polar_gym.env.nemo_transport:PolarTokenSink``,
``lineage_store: polar_gym.env.nemo_transport:PolarLineageResolver``, both with ``root`` in their kwargs; the consumer
builds ``PolarTokenSource(root)``. See polar_gym/env/README.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import hashlib
import json
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from nemo_gym.token_id_capture.lineage import RolloutLineage, stamp_continuation
from nemo_gym.token_id_capture.protocols import TokenCaptureSnapshot
from nemo_gym.token_id_capture.records import (
    ParentResolutionStatus,
    TokenEntry,
    response_to_output_items,
    stamp_lineage,
)

from polar_gym.dirnames import dirname_for
from polar_gym.env.token_lineage import CallTokens, calls_from_nemo_payload, calls_from_records, link_calls
from polar_gym.journal import (
    ATTEMPTS_DIR,
    JOURNAL_FILES,
    LOGPROBS_FILE,
    RECORDS_FILE,
    TOKENS_FILE,
    SessionStore,
    decode,
    read_current_attempt,
    read_file,
    truncate_torn_tail,
)
from polar_gym.schema import CompletionRecord

__all__ = ["ENTRY_FIELD", "STATE_FILE", "JournalTokenStore", "PolarLineageResolver", "PolarTokenSink",
           "PolarTokenSource", "deliver_session", "entries_from_calls", "entries_from_nemo_payload", "every_chain",
           "output_items"]

#: the key of a record's ``response`` holding a sink-written entry's fields (all but its token arrays)
ENTRY_FIELD = "nemo_token_entry"
STATE_FILE = "nemo-capture-state.json"
_LOCK_FILE = ".nemo-capture.lock"
_CACHED_STREAMS = 64  # streams an instance keeps its append state for
_TOKEN_ARRAYS = frozenset({"prompt_token_ids", "generation_token_ids", "generation_log_probs"})


def output_items(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A call's answer as Responses output items: the assistant message in chat form, as the proxy journals it
    (``{"message": {...}}``) and the ``/nemo`` payload carries it, is one ``message`` item (what Gym's own
    normalizer makes of a Chat Completions answer); a provider body goes through that normalizer."""
    if isinstance(response.get("message"), dict):
        message = dict(response["message"])
        return [{**message, "type": "message", "role": message.get("role") or "assistant"}]
    items: list[dict[str, Any]] = response_to_output_items(response)
    return items


def entries_from_calls(rollout_id: str, calls: Sequence[CallTokens]) -> list[TokenEntry]:
    """Calls as ``TokenEntry`` records with Gym's lineage (parent link, decision, digest) and lookup metadata, plus
    ``polar_chain`` / ``polar_parent_chain`` naming the chain each belongs to."""
    entries = []
    for call, link in zip(calls, link_calls(calls), strict=True):
        items = output_items(call.response)
        entry = TokenEntry(
            rollout_id=rollout_id, model_call_id=call.call_id, model=call.model, prompt_token_ids=call.prompt,
            generation_token_ids=call.generation, generation_log_probs=call.logprobs, output_items=items,
            token_item_index=len(items) - 1 if items else None, created_at=call.created_at,
            response_id=call.response.get("id") if isinstance(call.response.get("id"), str) else None,
            polar_chain=link.chain, polar_parent_chain=link.parent_chain,
            **{k: v for k, v in call.extras.items() if v is not None})
        if call.request_items:
            stamp_continuation(entry, list(call.request_items))
        stamp_lineage(entry, link.parent_call_id, parent_resolution=ParentResolutionStatus(link.resolution))
        entries.append(entry)
    return entries


def every_chain(entries: Sequence[TokenEntry]) -> list[list[dict[str, Any]]]:
    """Every chain of a snapshot (:func:`polar_gym.env.token_lineage.link_calls` on its tokens) as one contiguous
    output-item list each, the chain with the most sampled tokens first: each call's output items, the one that
    carried its tokens with ``prompt_token_ids`` (the call's whole prompt: it starts with everything before it in
    the chain), ``generation_token_ids`` and ``generation_log_probs``. Gym's consumer delivers only one of them."""
    deltas = [e.model_call_id for e in entries if e.prompt_is_delta]
    if deltas:
        raise ValueError(f"calls {deltas} store delta prompts (delta_records): chains need whole prompts")
    ordered = sorted(entries, key=lambda e: len(e.prompt_token_ids))  # parents before children
    calls = [CallTokens(e.model_call_id, list(e.prompt_token_ids), list(e.generation_token_ids), []) for e in ordered]
    chains: dict[int, list[TokenEntry]] = {}
    for entry, link in zip(ordered, link_calls(calls), strict=True):
        chains.setdefault(link.chain, []).append(entry)
    out = []
    for members in sorted(chains.values(), key=lambda c: -sum(len(e.generation_token_ids) for e in c)):
        items: list[dict[str, Any]] = []
        for entry in members:
            own = [dict(item) for item in entry.output_items] or [{"type": "message", "role": "assistant",
                                                                   "content": []}]
            index = entry.token_item_index if entry.token_item_index is not None else len(own) - 1
            own[index].update(prompt_token_ids=list(entry.prompt_token_ids),
                              generation_token_ids=list(entry.generation_token_ids),
                              generation_log_probs=list(entry.generation_log_probs))
            items += own
        out.append(items)
    return out


def entries_from_nemo_payload(rollout_id: str, payload: dict[str, Any]) -> list[TokenEntry]:
    """The entries of a finished Polar session's ``/nemo`` payload (every chain): what the agent puts."""
    return entries_from_calls(rollout_id, calls_from_nemo_payload(payload))


async def deliver_session(sink: Any, rollout_id: str, payload: dict[str, Any]) -> dict[str, str]:
    """Put every chain's calls of a finished session (its ``/nemo`` payload) through ``sink`` (any ``TokenSink``);
    a session that did not complete is marked incomplete, so a consumer masks it. A repeated delivery puts the same
    bytes (a no-op). Returns the response metadata the agent adds: where the entries went."""
    entries = entries_from_nemo_payload(rollout_id, payload)
    for entry in entries:
        await sink.put(entry)
    if payload.get("status") != "COMPLETED":
        await sink.mark_incomplete(rollout_id, "")
    chains = {getattr(entry, "polar_chain", 0) for entry in entries}
    return {"polar_token_rollout_id": rollout_id, "polar_token_entries": str(len(entries)),
            "polar_token_chains": str(len(chains))}


def _entry_record(entry: TokenEntry, index: int) -> CompletionRecord:
    fields = entry.model_dump(mode="json", exclude=set(_TOKEN_ARRAYS))
    return CompletionRecord(
        completion_id=entry.model_call_id, session_id=entry.rollout_id, index=index, provider="nemo_gym",
        engine="nemo_gym_token_sink", model=entry.model or None, response={ENTRY_FIELD: fields},
        prompt_ids=entry.prompt_token_ids, response_ids=entry.generation_token_ids,
        response_logprobs=entry.generation_log_probs, started_at=entry.created_at)


def _record_entry(record: CompletionRecord) -> TokenEntry:
    return TokenEntry.model_validate({**record.response[ENTRY_FIELD], "prompt_token_ids": record.prompt_ids,
                                      "generation_token_ids": record.response_ids,
                                      "generation_log_probs": record.response_logprobs})


def _journal_size(stream: Path) -> int:
    """Bytes of the stream's record lines: any record appended (by a sink or by the proxy) changes it."""
    try:
        return (stream / RECORDS_FILE).stat().st_size
    except FileNotFoundError:
        return 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class _Tail:
    """An instance's view of a stream it appended to: the files' sizes it left, its encoder, and every call id
    there with the digest of its payload (None: a record the proxy wrote)."""

    sizes: tuple[int, int, int]
    encoder: SessionStore
    payloads: dict[str, str | None]


def _sizes(stream: Path) -> tuple[int, int, int]:
    out = []
    for name in JOURNAL_FILES:
        try:
            out.append((stream / name).stat().st_size)
        except FileNotFoundError:
            out.append(0)
    return out[0], out[1], out[2]


def _digest(entry: TokenEntry) -> str:
    """The entry's serialized payload, hashed: equal exactly when the entries dump the same."""
    return hashlib.sha256(orjson.dumps(entry.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)).hexdigest()


class JournalTokenStore:
    """The shared backend: journal streams under ``root``. Every method works under the stream's lock and reads the
    disk (an append reuses what it knows only while the files are as it left them), so separate instances
    (separate workers) agree."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._tails: collections.OrderedDict[Path, _Tail] = collections.OrderedDict()
        #: called with the rollout id of every operation (the conformance runner names its checks from them)
        self.observer: Callable[[str], None] | None = None

    # -- layout ----------------------------------------------------------------------------------------------

    def rollout_dir(self, rollout_id: str) -> Path:
        return self.root / dirname_for(rollout_id)

    def stream_dir(self, rollout_id: str) -> Path:
        """The rollout's journal stream: its current attempt for a gateway session, else its own directory."""
        base = self.rollout_dir(rollout_id)
        attempt = read_current_attempt(base)
        return base / ATTEMPTS_DIR / dirname_for(attempt) if attempt else base

    @contextlib.contextmanager
    def locked(self, rollout_id: str) -> Iterator[Path]:
        if self.observer is not None:
            self.observer(rollout_id)
        base = self.rollout_dir(rollout_id)
        base.mkdir(parents=True, exist_ok=True)
        with open(base / _LOCK_FILE, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield self.stream_dir(rollout_id)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # -- state -----------------------------------------------------------------------------------------------

    def read_state(self, stream: Path) -> dict[str, Any]:
        try:
            state: dict[str, Any] = json.loads((stream / STATE_FILE).read_text())
        except FileNotFoundError:
            return {"version": 0}
        return state

    def write_state(self, stream: Path, state: dict[str, Any]) -> None:
        stream.mkdir(parents=True, exist_ok=True)
        tmp = stream / f".{STATE_FILE}.{uuid.uuid4().hex}"
        with open(tmp, "w") as fh:
            json.dump(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, stream / STATE_FILE)
        _fsync_dir(stream)

    def bump(self, stream: Path, state: dict[str, Any]) -> None:
        state["version"] = int(state.get("version", 0)) + 1
        self.write_state(stream, state)

    # -- records ---------------------------------------------------------------------------------------------

    def read_records(self, stream: Path) -> tuple[list[CompletionRecord], list[bytes]]:
        lines = read_file(stream / RECORDS_FILE).splitlines(keepends=True)
        return decode(lines, read_file(stream / TOKENS_FILE), read_file(stream / LOGPROBS_FILE)), lines

    def read_entries(self, rollout_id: str, stream: Path) -> tuple[list[TokenEntry], list[str]]:
        """The stream's entries (sink-written ones exactly as put; proxy-written ones mapped with their lineage)
        and the ids of proxy calls that cannot be entries."""
        records, _ = self.read_records(stream)
        written = [_record_entry(r) for r in records if ENTRY_FIELD in r.response]
        calls, holes = calls_from_records(r for r in records if ENTRY_FIELD not in r.response)
        return written + entries_from_calls(rollout_id, calls), holes

    def _tail(self, stream: Path) -> _Tail:
        """What is needed to append to ``stream``: from memory when this instance wrote last (the files' sizes
        are still the ones it left), else read afresh (another writer, or none yet), torn tail cut."""
        sizes = _sizes(stream)
        tail = self._tails.get(stream)
        if tail is not None and tail.sizes == sizes:
            self._tails.move_to_end(stream)
            return tail
        records, lines = self.read_records(stream)
        encoder = SessionStore()
        for record in records:
            encoder.encode(record)
        truncate_torn_tail(stream, lines, len(records), encoder)
        payloads = {r.completion_id: _digest(_record_entry(r)) if ENTRY_FIELD in r.response else None
                    for r in records}
        tail = self._tails[stream] = _Tail(_sizes(stream), encoder, payloads)
        while len(self._tails) > _CACHED_STREAMS:
            self._tails.popitem(last=False)
        return tail

    def append(self, stream: Path, entry: TokenEntry) -> bool:
        """Append ``entry`` durably; False when the same payload is there already; ValueError on a conflict."""
        tail = self._tail(stream)
        digest = _digest(entry)
        if entry.model_call_id in tail.payloads:
            if tail.payloads[entry.model_call_id] == digest:
                return False
            raise ValueError(f"model call {entry.model_call_id} of rollout {entry.rollout_id} is already captured "
                             "with a different payload")
        line, tokens, logprobs = tail.encoder.encode(_entry_record(entry, tail.encoder.count))
        tail.sizes = (-1, -1, -1)  # until the write is done: a failed one makes the next append read afresh
        created = not stream.exists()
        stream.mkdir(parents=True, exist_ok=True)
        for name, payload in zip(JOURNAL_FILES, (tokens, logprobs, line), strict=True):
            with open(stream / name, "ab") as fh:
                fh.write(payload)
                fh.flush()
                os.fsync(fh.fileno())
        if created:
            _fsync_dir(stream.parent)
        _fsync_dir(stream)
        tail.payloads[entry.model_call_id] = digest
        tail.sizes = _sizes(stream)
        return True


class _Client:
    """One client of the shared store (what Gym's factories construct, one per worker)."""

    def __init__(self, root: str | os.PathLike[str], *, store: JournalTokenStore | None = None) -> None:
        self.store = store if store is not None else JournalTokenStore(root)

    async def close(self) -> None:
        return None


class PolarTokenSink(_Client):
    """``TokenSink``: durable, visible to every client when ``put`` returns."""

    async def put(self, entry: TokenEntry) -> None:
        await asyncio.to_thread(self._put, entry)

    def _put(self, entry: TokenEntry) -> None:
        with self.store.locked(entry.rollout_id) as stream:
            state = self.store.read_state(stream)
            if state.get("retired"):
                raise RuntimeError(f"rollout {entry.rollout_id} is retired")
            if self.store.append(stream, entry) and state.get("frozen"):
                state["journal_size"] = _journal_size(stream)
                self.store.bump(stream, state)  # a write that raced a freeze stales the consumed snapshot

    async def put_many(self, entries: Sequence[TokenEntry]) -> None:
        for entry in entries:
            await self.put(entry)

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        await asyncio.to_thread(self._mark_incomplete, rollout_id, model_call_id)

    def _mark_incomplete(self, rollout_id: str, model_call_id: str) -> None:
        with self.store.locked(rollout_id) as stream:
            state = self.store.read_state(stream)
            state["incomplete"] = True
            state["incomplete_calls"] = [*state.get("incomplete_calls", []), model_call_id]
            self.store.bump(stream, state)


class PolarTokenSource(_Client):
    """``TokenSource``: an atomic snapshot of every entry of a rollout (every chain), conditional retirement."""

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        return await asyncio.to_thread(self._freeze, rollout_id)

    def _freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        with self.store.locked(rollout_id) as stream:
            state = self.store.read_state(stream)
            if state.get("retired"):
                raise RuntimeError(f"token capture of rollout {rollout_id} is retired")
            # measured before reading: a record the proxy appends meanwhile (it does not take our lock) makes the
            # journal longer than the snapshot says, so the next freeze moves the version and a drop fails
            size = _journal_size(stream)
            if not state.get("frozen"):
                state.update(frozen=True, snapshot_id=uuid.uuid4().hex, journal_size=size)
                self.store.bump(stream, state)
            elif state.get("journal_size") != size:
                state["journal_size"] = size  # records arrived after the freeze (the proxy still writing)
                self.store.bump(stream, state)
            entries, holes = self.store.read_entries(rollout_id, stream)
            return TokenCaptureSnapshot(rollout_id=rollout_id, entries=tuple(entries),
                                        incomplete=bool(state.get("incomplete")) or bool(holes),
                                        snapshot_id=str(state["snapshot_id"]), version=int(state["version"]))

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        return await asyncio.to_thread(self._drop, rollout_id, snapshot_id, version)

    def _drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        with self.store.locked(rollout_id) as stream:
            state = self.store.read_state(stream)
            if not state.get("frozen") or state.get("retired") or state.get("snapshot_id") != snapshot_id \
                    or int(state.get("version", 0)) != version or state.get("journal_size") != _journal_size(stream):
                return False
            state["retired"] = True
            self.store.write_state(stream, state)
            return True

    async def chains(self, rollout_id: str) -> list[list[dict[str, Any]]]:
        """Every chain of the rollout's snapshot as contiguous output items (see :func:`every_chain`)."""
        return every_chain((await self.freeze(rollout_id)).entries)


class PolarLineageResolver(_Client):
    """``LineageResolver``: Gym's own matcher (``RolloutLineage``) over the entries on disk now."""

    async def resolve(self, rollout_id: str, request_items: list[dict[str, Any]]) -> Any:
        return await asyncio.to_thread(self._resolve, rollout_id, request_items)

    def _resolve(self, rollout_id: str, request_items: list[dict[str, Any]]) -> Any:
        with self.store.locked(rollout_id) as stream:
            entries, _ = self.store.read_entries(rollout_id, stream)
        lineage = RolloutLineage()
        for entry in entries:
            lineage.add_entry(entry)
        return lineage.resolve(list(request_items))

    def is_process_shared(self) -> bool:
        return True

