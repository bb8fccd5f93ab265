"""Large request values a harness sends unchanged on every call, parsed once.

Every model call of a Claude Code, Codex or Gemini CLI session repeats the same tools (~60 KB, 90 % of the body) and
system prompt. Parsing, validating, translating, dumping and journaling them again on every call was most of the
proxy's CPU at 64 concurrent calls (issue 18), and keeping 64 parsed copies alive at once made every other step
slower too (the caches stay cold). :class:`KnownValues` remembers such a top-level value by its exact bytes: a body
that holds those bytes again is parsed without them, and the value parsed the first time is put in their place. What
is computed from a known value (its validation, its translation) is kept with it (:meth:`KnownValues.derive`), and
the journal names its blob from the bytes it was parsed from (:meth:`KnownValues.json_of`).

Known values are shared by every call that sent them: nothing may change them in place (tests check that a session
of calls leaves them as parsed).

The engine's answer repeats too: its prompt token IDs (vLLM's and SGLang's ``prompt_token_ids``) start with the
previous call's prompt, since an agent's conversation only grows. :class:`KnownPromptIds` keeps each session's last
prompt IDs as their JSON text and parsed, so a new answer's IDs are parsed from where they differ: 2,000 IDs cost
~25 us to parse and 30,000 ~400 us, on every call. Pure: no I/O.
"""

from __future__ import annotations

import collections
import secrets
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

__all__ = ["KNOWN", "REPEATED_FIELDS", "KnownPromptIds", "KnownValues", "PromptIds"]

T = TypeVar("T")

#: the top-level fields that repeat call after call in the protocols the proxy speaks
REPEATED_FIELDS = ("tools", "system", "instructions", "systemInstruction")


@dataclass(eq=False)
class _Entry:
    value: Any
    #: the value's compact JSON (orjson's), as found in a body; None for a derived value
    json: bytes | None = None
    derived: dict[Any, Any] = field(default_factory=dict)
    #: the entries of what was derived from this one (dropped with it)
    children: list[_Entry] = field(default_factory=list)


class KnownValues:
    """Top-level values of ``fields`` of at least ``min_bytes`` (and at most ``max_bytes``), kept parsed, the most
    recently used first, ``max_total`` bytes of them in all. A value is learned from a body whose bytes hold it
    as orjson writes it (compact JSON, as every harness measured sends it); other bodies are parsed as they always
    were.

    The bounds are on JSON bytes; what is kept of them parsed, validated and translated is a few times that (a
    parsed tools list takes ~2.4x its JSON), so ``max_total`` keeps a hostile caller's retained memory near 100 MB
    while the largest tool list measured (Claude Code's, 63-81 KB) is far below ``max_bytes``.

    Looked up by identity: a value is known while it is kept here (the entries hold it, so its ``id`` is not reused
    meanwhile). Not thread-safe for writers: one event loop parses; readers (the journal's writer threads) only
    look up."""

    def __init__(self, fields: Iterable[str] = REPEATED_FIELDS, *, min_bytes: int = 4096,
                 max_bytes: int = 1024 * 1024, max_total: int = 8 * 1024 * 1024, per_field: int = 4) -> None:
        self.fields = tuple(fields)
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self.max_total = max_total
        self.per_field = per_field
        self._markers = {name: orjson.dumps(name) + b":" for name in self.fields}
        self._by_field: dict[str, list[_Entry]] = {}
        self._lru: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # learned values only
        self._index: dict[int, _Entry] = {}  # id -> entry, learned and derived values
        self._total = 0
        # What a matched value is replaced with before parsing: a string no client can guess, so a match that was
        # not the top-level field (a nested key of the same name) is told apart and parsed as sent.
        self._placeholder = "\x00polar_gym-known-" + secrets.token_hex(16)
        self._placeholder_json = orjson.dumps(self._placeholder)
        #: bodies parsed with at least one known value put back, and learned values (for tests and benchmarks)
        self.hits = 0
        self.learned = 0

    # ------------------------------------------------------------------------------------------------- parsing
    def loads(self, raw: bytes) -> Any:
        """``orjson.loads(raw)``, with the known values' bytes not parsed again (the same result, and the same
        error for a malformed body). Learns the large values of a body parsed whole."""
        if self._by_field:
            body = self._loads_known(raw)
            if body is not None:
                self.hits += 1
                self._learn(body, raw)  # the fields that were not known (new tools, the same system prompt)
                return body
        body = orjson.loads(raw)
        if isinstance(body, dict):
            self._learn(body, raw)
        return body

    def _loads_known(self, raw: bytes) -> dict[str, Any] | None:
        hits: list[tuple[int, int, str, _Entry]] = []
        for name, entries in self._by_field.items():
            marker = self._markers[name]
            at = raw.find(marker)
            for _ in range(4):  # the field's name may also be a nested key: try a few places
                if at < 0:
                    break
                start = at + len(marker)
                entry = next((e for e in entries if e.json is not None and raw.startswith(e.json, start)), None)
                if entry is not None:
                    hits.append((start, start + len(entry.json or b""), name, entry))
                    break
                at = raw.find(marker, start)
        if not hits:
            return None
        hits.sort(key=lambda hit: hit[0])
        pieces: list[bytes] = []
        kept: list[tuple[str, _Entry]] = []
        pos = 0
        for start, end, name, entry in hits:
            if start < pos:
                continue  # inside another match
            pieces += [raw[pos:start], self._placeholder_json]
            kept.append((name, entry))
            pos = end
        pieces.append(raw[pos:])
        try:
            body = orjson.loads(b"".join(pieces))
        except orjson.JSONDecodeError:
            return None  # parsed whole, for the error's true position
        if not isinstance(body, dict) or any(body.get(name) != self._placeholder for name, _ in kept):
            return None  # a nested key matched, not the field itself
        for name, entry in kept:
            body[name] = entry.value
            self._lru.move_to_end(id(entry.value))
        return body

    def _learn(self, body: dict[str, Any], raw: bytes) -> None:
        for name in self.fields:
            value = body.get(name)
            if not isinstance(value, (list, dict, str)) or id(value) in self._index:
                continue
            if isinstance(value, str) and len(value) < self.min_bytes // 4:
                continue  # too short to serialize to min_bytes
            serialized = orjson.dumps(value)
            if not self.min_bytes <= len(serialized) <= self.max_bytes:
                continue
            if raw.find(self._markers[name] + serialized) < 0:
                continue  # not sent as orjson writes it: it could never be matched
            self._add(name, _Entry(value, serialized))

    def _add(self, name: str, entry: _Entry) -> None:
        entries = self._by_field.setdefault(name, [])
        entries.insert(0, entry)
        if len(entries) > self.per_field:
            self._drop(entries[-1])
        self._lru[id(entry.value)] = entry
        self._index[id(entry.value)] = entry
        self._total += len(entry.json or b"")
        self.learned += 1
        while self._total > self.max_total and self._lru:
            self._drop(next(iter(self._lru.values())))

    def _drop(self, entry: _Entry) -> None:
        self._lru.pop(id(entry.value), None)
        self._index.pop(id(entry.value), None)
        self._total -= len(entry.json or b"")
        for entries in self._by_field.values():
            if entry in entries:
                entries.remove(entry)
        for child in entry.children:
            self._index.pop(id(child.value), None)

    def clear(self) -> None:
        """Forget every value."""
        for entry in list(self._lru.values()):
            self._drop(entry)
        self._by_field.clear()

    # ------------------------------------------------------------------------------------------------ derived
    def json_of(self, value: Any) -> bytes | None:
        """The compact JSON ``value`` was parsed from when it is a known value (serialized once, when it was
        derived from one); else None."""
        entry = self._index.get(id(value))
        if entry is None or entry.value is not value:
            return None
        if entry.json is None:
            try:
                entry.json = orjson.dumps(value)  # a derived value: not counted in max_total (its root is)
            except TypeError:
                return None  # not JSON data (a translation's models)
        return entry.json

    def as_fragments(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` (shallowly copied) with its known values as :class:`orjson.Fragment` of their bytes: what
        ``orjson.dumps`` writes of it is the same, without serializing them again."""
        out = dict(body)
        for key, value in body.items():
            if not isinstance(value, (list, dict, str)):
                continue  # a scalar is never known
            serialized = self.json_of(value)
            if serialized is not None:
                out[key] = orjson.Fragment(serialized)
        return out

    def known(self, value: Any) -> bool:
        """Whether ``value`` is a known value or was derived from one (:meth:`derive` keeps what it computes)."""
        entry = self._index.get(id(value))
        return entry is not None and entry.value is value

    def derive(self, value: Any, kind: Any, compute: Callable[[Any], T]) -> T:
        """``compute(value)``, computed once per known ``value`` and ``kind`` (a result that is itself a list, dict
        or model, or such an item of a tuple, is known in turn, so what is computed from it is kept too); for any other
        value, computed now.
        A ``compute`` that raises is not kept: the next call raises again."""
        entry = self._index.get(id(value))
        if entry is None or entry.value is not value:
            return compute(value)
        if kind in entry.derived:
            return entry.derived[kind]  # type: ignore[no-any-return]
        result = entry.derived[kind] = compute(value)
        root = self._root(entry)
        for item in _with_tuple_items(result):
            if not isinstance(item, (int, float, bool, str, type(None))) and id(item) not in self._index:
                child = _Entry(item)
                root.children.append(child)
                self._index[id(item)] = child
        return result

    def _root(self, entry: _Entry) -> _Entry:
        if self._lru.get(id(entry.value)) is entry:
            return entry
        return next(e for e in self._lru.values() if entry in e.children)


def _with_tuple_items(value: Any) -> list[Any]:
    """``value``, and when it is a tuple, its items (those of nested tuples too)."""
    if not isinstance(value, tuple):
        return [value]
    return [value, *(item for part in value for item in _with_tuple_items(part))]


#: the process's known values: the proxy parses with it, the providers derive from it, the journal reads it
KNOWN = KnownValues()


class PromptIds(list[int]):
    """Token IDs known to be uint32s, with their packed bytes (``packed``, as the journal stores them): neither
    checked nor packed again. Built by :class:`KnownPromptIds`; never changed in place."""

    __slots__ = ("packed",)

    def __init__(self, ids: Iterable[int], packed: array[int]) -> None:
        super().__init__(ids)
        self.packed = packed


_IDS_KEY = "prompt_token_ids"
_IDS_MARKER = b'"prompt_token_ids":['


@dataclass(eq=False)
class _KnownIds:
    #: the IDs' JSON text as the engine wrote it, ``[`` to ``]``
    text: bytes
    ids: PromptIds


class KnownPromptIds:
    """Each session's last prompt token IDs, as the engine wrote them and parsed (``per_scope`` lists a session:
    its agent's and a sub-agent's), ``max_tokens`` of them in all (least recently used session first out).

    :meth:`loads` is ``orjson.loads`` of an engine's answer, with the IDs of ``prompt_token_ids`` (top-level, as
    vLLM's chat answer has them, or in the first choice, as SGLang's and vLLM's completions) parsed only past what
    they share with a known list of the session: the shared items are taken from it. Every result is the same as
    ``orjson.loads`` gives (a test drives random answers against it); the IDs come as :class:`PromptIds` when they
    are all uint32s, else as the plain list ``orjson.loads`` makes. Not thread-safe: one event loop reads answers.
    """

    def __init__(self, *, per_scope: int = 2, max_tokens: int = 1 << 20, min_bytes: int = 2048) -> None:
        self.per_scope = per_scope
        self.max_tokens = max_tokens
        self.min_bytes = min_bytes
        self._scopes: collections.OrderedDict[str, list[_KnownIds]] = collections.OrderedDict()
        self._tokens = 0
        self._placeholder = "\x00polar_gym-ids-" + secrets.token_hex(16)
        self._placeholder_json = orjson.dumps(self._placeholder)
        #: answers whose IDs were parsed past a known prefix, and the IDs taken from one (for tests and benchmarks)
        self.hits = 0
        self.reused = 0

    def loads(self, raw: bytes, scope: str | None) -> Any:
        """``orjson.loads(raw)``, the prompt IDs parsed from where they differ from the session's known ones."""
        at = raw.find(_IDS_MARKER) if scope is not None else -1
        if at < 0:
            return orjson.loads(raw)
        start = at + len(_IDS_MARKER) - 1
        end = raw.find(b"]", start) + 1
        if end - start < self.min_bytes:
            return orjson.loads(raw)  # none, or too few to be worth it
        try:
            body = orjson.loads(b"".join((raw[:start], self._placeholder_json, raw[end:])))
        except orjson.JSONDecodeError:
            return orjson.loads(raw)  # parsed whole, for the error's true position
        holder = self._holder(body)
        ids = self._ids(raw[start:end], scope) if holder is not None and scope is not None else None
        if holder is None or ids is None:
            return orjson.loads(raw)  # the key matched elsewhere, or the list is not all uint32s
        holder[_IDS_KEY] = ids
        return body

    def _holder(self, body: Any) -> dict[str, Any] | None:
        """The object whose ``prompt_token_ids`` is the placeholder: the body, or its first choice."""
        if not isinstance(body, dict):
            return None
        if body.get(_IDS_KEY) == self._placeholder:
            return body
        choices = body.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict) \
                and choices[0].get(_IDS_KEY) == self._placeholder:
            return choices[0]
        return None

    def _ids(self, span: bytes, scope: str) -> PromptIds | None:
        """The IDs of ``span`` (a JSON array's text), reusing the longest known prefix of the session's lists."""
        entries = self._scopes.get(scope, [])
        best, keep, cut = None, 0, 0
        for entry in entries:
            at = _items_shared(span, entry.text)
            if at > cut:
                best, cut = entry, at
        try:
            if best is None:
                values = orjson.loads(span)
                ids = PromptIds(values, array("I", values))
            else:
                keep = len(best.ids) if cut == len(best.text) - 1 else best.text.count(b",", 0, cut) + 1
                tail = orjson.loads(b"[" + span[cut + 1:]) if span[cut] == ord(",") else []
                packed = best.ids.packed[:keep] if keep < len(best.ids) else best.ids.packed
                ids = PromptIds(best.ids[:keep] if keep < len(best.ids) else best.ids, packed + array("I", tail))
                ids.extend(tail)
        except (orjson.JSONDecodeError, TypeError, OverflowError):
            return None  # not an array of uint32s: parsed whole, as it always was
        if best is not None:
            self.hits += 1
            self.reused += keep
        self._remember(scope, entries, best, _KnownIds(span, ids))
        return ids

    def _remember(self, scope: str, entries: list[_KnownIds], replaced: _KnownIds | None, entry: _KnownIds) -> None:
        if replaced is not None:
            entries.remove(replaced)  # the conversation moved on: its new prompt replaces the old one
            self._tokens -= len(replaced.ids)
        entries.insert(0, entry)
        self._tokens += len(entry.ids)
        while len(entries) > self.per_scope:
            self._tokens -= len(entries.pop().ids)
        self._scopes[scope] = entries
        self._scopes.move_to_end(scope)
        while self._tokens > self.max_tokens and self._scopes:
            _, dropped = self._scopes.popitem(last=False)
            self._tokens -= sum(len(e.ids) for e in dropped)

    def forget(self, scope: str) -> None:
        """The session is over: drop its lists."""
        for entry in self._scopes.pop(scope, []):
            self._tokens -= len(entry.ids)


def _items_shared(span: bytes, text: bytes) -> int:
    """Where the items two JSON arrays of numbers (``span``, ``text``) share end: the index of the ``,`` or ``]``
    after the last item both hold whole (0: none shared)."""
    head = len(text) - 1  # text without its closing bracket
    if span.startswith(text[:head]) and len(span) > head and span[head] in b",]":
        return head  # the usual case: the new prompt starts with the whole known one
    lo, hi = 0, min(len(span), head)
    while hi - lo > 1:  # the longest common prefix, by halves
        mid = (lo + hi) // 2
        if span.startswith(text[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    return max(span.rfind(b",", 0, lo), 0)  # a comma before ``lo`` is in both
