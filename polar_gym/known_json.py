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

The engine's answer repeats too: :mod:`polar_gym.known_prompt_ids` does the same for its prompt token IDs. Pure: no
I/O.
"""

from __future__ import annotations

import bisect
import collections
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

__all__ = ["CONVERSATION_FIELDS", "KNOWN", "REPEATED_FIELDS", "KnownValues", "shared_bytes"]

T = TypeVar("T")

#: the top-level fields that repeat call after call in the protocols the proxy speaks
REPEATED_FIELDS = ("tools", "system", "instructions", "systemInstruction")


#: the top-level fields holding a protocol's conversation, which grows call after call
CONVERSATION_FIELDS = ("messages", "input", "contents")


@dataclass(eq=False)
class _Entry:
    value: Any
    #: the value's compact JSON (orjson's), as found in a body; None for a derived value
    json: bytes | None = None
    derived: dict[Any, Any] = field(default_factory=dict)
    #: the entries of what was derived from this one (dropped with it; no entry points back at its parent: a
    #: cycle would leave dropped values to the cyclic collector, which a serving process runs rarely)
    children: list[_Entry] = field(default_factory=list)
    #: conversation prefixes holding this item (it is forgotten with the last)
    holders: int = 0


@dataclass(eq=False)
class _Prefix:
    """A session's conversation as a body held it: ``text`` is the list's JSON from its ``[`` to the end of its last
    item, ``ends[i]`` where item ``i`` ends in it, ``items`` the items' entries."""

    name: str
    text: bytes
    ends: list[int]
    items: list[_Entry]
    #: the repeated fields (of ``KnownValues.fields``) the body held, in its order: the only ones looked for in a
    #: body going on from this one (looking for a field a body lacks scans all of it: ~10 us for 40 KB), each
    #: after the one before it first
    fields: tuple[str, ...] = ()


@dataclass
class _PrefixHit:
    prefix: _Prefix
    at: int  # the list's ``[`` in the body
    keep: int  # items shared


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
                 max_bytes: int = 1024 * 1024, max_total: int = 8 * 1024 * 1024, per_field: int = 4,
                 conversation_fields: Iterable[str] = CONVERSATION_FIELDS, min_conversation_bytes: int = 512,
                 max_conversation_bytes: int = 4 * 1024 * 1024, max_conversation_total: int = 16 * 1024 * 1024,
                 per_scope: int = 4) -> None:
        self.fields = tuple(fields)
        self.conversation_fields = tuple(conversation_fields)
        self.min_conversation_bytes = min_conversation_bytes
        self.max_conversation_bytes = max_conversation_bytes
        self.max_conversation_total = max_conversation_total
        self.per_scope = per_scope
        self._list_markers = {name: orjson.dumps(name) + b":[" for name in self.conversation_fields}
        self._scopes: collections.OrderedDict[str, list[_Prefix]] = collections.OrderedDict()
        self._conversation_total = 0
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
        self._items_placeholder = "\x00polar_gym-items-" + secrets.token_hex(16)
        self._items_placeholder_json = orjson.dumps(self._items_placeholder)
        #: bodies parsed with at least one known value put back, and learned values (for tests and benchmarks)
        self.hits = 0
        self.learned = 0
        #: conversation items taken from a session's known prefix instead of parsed (for tests and benchmarks)
        self.items_reused = 0

    # ------------------------------------------------------------------------------------------------- parsing
    def loads(self, raw: bytes, scope: str | None = None) -> Any:
        """``orjson.loads(raw)``, with the known values' bytes not parsed again (the same result, and the same
        error for a malformed body). Learns the large values of a body parsed whole. With a ``scope`` (the
        session), the items its conversation shares with the session's last bodies are not parsed again either."""
        return self.loads_checked(raw, scope)[0]

    def loads_checked(self, raw: bytes, scope: str | None = None) -> tuple[Any, bool]:
        """:meth:`loads`, and whether ``orjson.dumps`` of the result is known to give ``raw`` back: True when a body
        with known values in it proved so while it was parsed (known values are kept only as orjson writes them,
        so serializing what was not known, the rest of the body, proves it for all); False when not known (not so,
        or not checked: a body parsed whole). The journal then need not serialize the request to find out."""
        prefix = self._find_prefix(raw, scope) if scope is not None and scope in self._scopes else None
        if self._by_field or prefix is not None:
            known = self._loads_known(raw, prefix)
            if known is not None:
                body, as_orjson_writes = known
                self.hits += 1
                self._learn(body, raw)  # the fields that were not known (new tools, the same system prompt)
                if scope is not None:
                    self._learn_conversation(body, raw, scope, prefix)
                return body, as_orjson_writes
        body = orjson.loads(raw)
        if isinstance(body, dict):
            self._learn(body, raw)
            if scope is not None:
                self._learn_conversation(body, raw, scope, None)
        return body, False

    def _loads_known(self, raw: bytes, prefix: _PrefixHit | None = None) -> tuple[dict[str, Any], bool] | None:
        hits: list[tuple[int, int, str, _Entry | _PrefixHit]] = []
        fields: Iterable[str] = self._by_field
        skip_from, skip_to = len(raw), len(raw)  # where no top-level field is: the shared items
        if prefix is not None:  # the shared items, from after the list's "[" to the end of the last one
            skip_from, skip_to = prefix.at + 1, prefix.at + prefix.prefix.ends[prefix.keep - 1]
            hits.append((skip_from, skip_to, prefix.prefix.name, prefix))
            fields = prefix.prefix.fields  # what the session's last body held
        after = 0  # where the last field found ends: the next is looked for after it first (the last body's order)
        for name in fields:
            entries = self._by_field.get(name)
            if not entries:
                continue
            marker = self._markers[name]
            at = _find_outside(raw, marker, after, skip_from, skip_to)
            if at < 0 and after:
                at = _find_outside(raw, marker, 0, skip_from, skip_to)  # not in that order
            for _ in range(4):  # the field's name may also be a nested key: try a few places
                if at < 0:
                    break
                start = at + len(marker)
                found = next((e for e in entries if e.json is not None and raw.startswith(e.json, start)), None)
                if found is not None:
                    after = start + len(found.json or b"")
                    hits.append((start, after, name, found))
                    break
                at = _find_outside(raw, marker, start, skip_from, skip_to)
        if not hits:
            return None
        hits.sort(key=lambda hit: hit[0])
        pieces: list[bytes] = []
        kept: list[tuple[str, _Entry | _PrefixHit]] = []
        pos = 0
        for start, end, name, hit in hits:
            if start < pos:
                continue  # inside another match
            is_items = isinstance(hit, _PrefixHit)
            pieces += [raw[pos:start], self._items_placeholder_json if is_items else self._placeholder_json]
            kept.append((name, hit))
            pos = end
        pieces.append(raw[pos:])
        skeleton = b"".join(pieces)
        try:
            body = orjson.loads(skeleton)
        except orjson.JSONDecodeError:
            return None  # parsed whole, for the error's true position
        if not isinstance(body, dict):
            return None
        for name, hit in kept:
            value = body.get(name)
            if isinstance(hit, _PrefixHit):
                if not (isinstance(value, list) and value and value[0] == self._items_placeholder):
                    return None  # a nested list of the same name matched, not the field itself
            elif value != self._placeholder:
                return None  # a nested key matched, not the field itself
        # the known bytes are orjson's of the values put back (kept only so): the rest decides
        as_orjson_writes = orjson.dumps(body) == skeleton
        for name, hit in kept:
            if isinstance(hit, _PrefixHit):
                items = [item.value for item in hit.prefix.items[:hit.keep]]
                items += body[name][1:]
                body[name] = items
                self.items_reused += hit.keep
            else:
                body[name] = hit.value
                self._lru.move_to_end(id(hit.value))
        return body, as_orjson_writes

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
            self._add(name, _Entry(value, _exact(serialized)))

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
            self._unindex(child)

    def clear(self) -> None:
        """Forget every value (and every session's conversation)."""
        for entry in list(self._lru.values()):
            self._drop(entry)
        self._by_field.clear()
        for scope in list(self._scopes):
            self.forget(scope)

    # ------------------------------------------------------------------------------------------- conversations
    def _find_prefix(self, raw: bytes, scope: str) -> _PrefixHit | None:
        """The scope's known conversation sharing the most whole items with ``raw``'s (None: none shares one); it
        becomes the scope's most recently used."""
        best: _PrefixHit | None = None
        prefixes = self._scopes[scope]
        found: dict[str, int] = {}  # each field's list looked for once
        for prefix in prefixes:
            at = found.get(prefix.name)
            if at is None:
                marker = self._list_markers[prefix.name]
                pos = raw.find(marker)
                start = pos + len(marker) - 1  # the list's "["
                at = found[prefix.name] = start if pos >= 0 else -1
            if at < 0:
                continue  # this body has no such list
            keep = _whole_items_shared(raw, at, prefix)
            if keep and (best is None or keep > best.keep):
                best = _PrefixHit(prefix, at, keep)
        if best is not None and prefixes[0] is not best.prefix:
            prefixes.remove(best.prefix)
            prefixes.insert(0, best.prefix)
        return best

    def _learn_conversation(self, body: dict[str, Any], raw: bytes, scope: str, hit: _PrefixHit | None) -> None:
        """Keep the body's conversation as the scope's newest, when the body holds it as orjson writes it."""
        name = next((n for n in self.conversation_fields if isinstance(body.get(n), list)), None)
        if name is None:
            return
        values: list[Any] = body[name]
        if hit is not None and hit.prefix.name == name and hit.keep == len(values) == len(hit.prefix.items):
            self._scopes.move_to_end(scope)  # the same conversation again (a retry): nothing new to keep
            return
        if hit is not None and hit.prefix.name == name:
            keep, at = hit.keep, hit.at
            text, ends, items = hit.prefix.text[:hit.prefix.ends[keep - 1]], hit.prefix.ends[:keep], \
                hit.prefix.items[:keep]
        else:
            keep, at, text, ends, items = 0, -1, b"[", [], []
        pieces = [text]
        size = len(text)
        new_items: list[_Entry] = []
        for value in values[keep:]:
            serialized = orjson.dumps(value)
            pieces += [b"," if size > 1 else b"", serialized]
            size += len(serialized) + (1 if size > 1 else 0)
            ends.append(size)
            new_items.append(_Entry(value))
        if not self.min_conversation_bytes <= size <= self.max_conversation_bytes:
            return
        text = b"".join(pieces)
        if at < 0:
            at = raw.find(self._list_markers[name][:-1] + text)  # not found: not sent as orjson writes it
            if at < 0:
                return
            at += len(self._list_markers[name]) - 1
        elif not raw.startswith(text[len(pieces[0]):], at + len(pieces[0])):
            return  # the new items were not sent as orjson writes them
        if raw[at + len(text): at + len(text) + 1] != b"]":
            return
        prefix = _Prefix(name, text, ends, [*items, *new_items], tuple(n for n in body if n in self._markers))
        # A conversation that goes on from all of a known one replaces it; one that shares only its start (a
        # sub-agent opening with the same system prompt) is kept beside it.
        whole = hit is not None and hit.keep == len(hit.prefix.items)
        self._remember_prefix(scope, prefix, hit.prefix if whole and hit is not None else None)

    def _remember_prefix(self, scope: str, prefix: _Prefix, replaced: _Prefix | None) -> None:
        for item in prefix.items:
            if item.holders == 0:
                self._index[id(item.value)] = item
            item.holders += 1
        prefixes = self._scopes.setdefault(scope, [])
        if replaced is not None and replaced in prefixes:
            prefixes.remove(replaced)  # the conversation moved on: its new body replaces the old one
            self._release(replaced)
        prefixes.insert(0, prefix)
        self._conversation_total += len(prefix.text)
        while len(prefixes) > self.per_scope:
            self._release(prefixes.pop())
        self._scopes.move_to_end(scope)
        while self._conversation_total > self.max_conversation_total and self._scopes:
            self.forget(next(iter(self._scopes)))

    def _release(self, prefix: _Prefix) -> None:
        self._conversation_total -= len(prefix.text)
        for item in prefix.items:
            item.holders -= 1
            if item.holders == 0:
                self._unindex(item)

    def _unindex(self, entry: _Entry) -> None:
        if self._index.get(id(entry.value)) is entry:
            del self._index[id(entry.value)]
        for child in entry.children:
            self._unindex(child)

    def forget(self, scope: str) -> None:
        """The session is over: drop its conversations."""
        for prefix in self._scopes.pop(scope, []):
            self._release(prefix)

    # ------------------------------------------------------------------------------------------------ derived
    def json_of(self, value: Any) -> bytes | None:
        """The compact JSON ``value`` was parsed from when it is a known value (serialized once, when it was
        derived from one); else None."""
        entry = self._index.get(id(value))
        if entry is None or entry.value is not value:
            return None
        if entry.json is None:
            if entry.holders:
                return None  # a conversation item: its JSON is not kept (it is needed once, when it is new)
            try:
                entry.json = _exact(orjson.dumps(value))  # a derived value: not counted in max_total (its root is)
            except TypeError:
                return None  # not JSON data (a translation's models)
        return entry.json

    def as_fragments(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` (shallowly copied when it holds one) with its known values as :class:`orjson.Fragment` of their
        bytes: what ``orjson.dumps`` writes of it is the same, without serializing them again."""
        out = body
        index = self._index
        for key, value in body.items():
            entry = index.get(id(value))  # a live known value's id is its own (its entry keeps it alive)
            if entry is None or entry.value is not value:
                continue
            serialized = entry.json if entry.json is not None else self.json_of(value)
            if serialized is not None:
                if out is body:
                    out = dict(body)
                out[key] = orjson.Fragment(serialized)
        return out

    def known(self, value: Any) -> bool:
        """Whether ``value`` is a known value or was derived from one (:meth:`derive` keeps what it computes)."""
        entry = self._index.get(id(value))
        return entry is not None and entry.value is value

    def derive(self, value: Any, kind: Any, compute: Callable[[Any], T]) -> T:
        """``compute(value)``, computed once per known ``value`` and ``kind`` (a result that is itself a list, dict
        or model, or such an item of a tuple or of a list in a tuple, is known in turn, so what is computed from it
        is kept too); for any other value, computed now.
        A ``compute`` that raises is not kept: the next call raises again."""
        entry = self._index.get(id(value))
        if entry is None or entry.value is not value:
            return compute(value)
        if kind in entry.derived:
            return entry.derived[kind]  # type: ignore[no-any-return]
        result = entry.derived[kind] = compute(value)
        for item in _with_tuple_items(result):
            if not isinstance(item, (int, float, bool, str, bytes, type(None))) and id(item) not in self._index:
                child = _Entry(item)
                entry.children.append(child)  # dropped with this entry, and so with its root
                self._index[id(item)] = child
        return result


def _exact(serialized: bytes) -> bytes:
    """A copy of ``serialized`` of its own size, to keep: what ``orjson.dumps`` returns keeps its whole write
    buffer (4 KB for 18 bytes, 330 KB for four values of 26 KB in all)."""
    return bytes(memoryview(serialized))


def shared_bytes(raw: bytes, at: int, text: bytes) -> int:
    """How many leading bytes of ``text`` ``raw`` holds from ``at`` on (at most one short of the longest: the search
    stops a byte short when it may): a memcmp when all of it is there, else a binary search, a memcmp a step. Both
    lists compared start with ``[``."""
    if raw.startswith(text, at):
        return len(text)
    lo, hi = 0, min(len(text), len(raw) - at)
    while hi - lo > 1:  # the longest common prefix, by halves
        mid = (lo + hi) // 2
        if raw.startswith(text[lo:mid], at + lo):
            lo = mid
        else:
            hi = mid
    return lo


def _whole_items_shared(raw: bytes, at: int, prefix: _Prefix) -> int:
    """How many whole items of ``prefix`` the list at ``raw[at]`` (its ``[``) starts with."""
    ends = prefix.ends
    keep = bisect.bisect_right(ends, shared_bytes(raw, at, prefix.text))
    # an item is whole in raw too when what follows it there ends it (a number may go on: "12" then "123")
    while keep and raw[at + ends[keep - 1]: at + ends[keep - 1] + 1] not in (b",", b"]"):
        keep -= 1
    return keep


def _find_outside(raw: bytes, marker: bytes, start: int, skip_from: int, skip_to: int) -> int:
    """``raw.find(marker, start)``, not looking in ``raw[skip_from:skip_to]`` (a found marker may not begin
    there)."""
    if start < skip_from:  # before the span first: only a marker that begins there fits
        at = raw.find(marker, start, skip_from + len(marker) - 1)
        if at >= 0:
            return at
    return raw.find(marker, max(start, skip_to))


def _with_tuple_items(value: Any, in_tuple: bool = False) -> list[Any]:
    """``value``; when it is a tuple, its items (those of nested tuples too); when it is a list in a tuple (a
    translation's messages, beside its notes), the list's items."""
    if in_tuple and isinstance(value, list):
        return [value, *value]
    if not isinstance(value, tuple):
        return [value]
    return [value, *(item for part in value for item in _with_tuple_items(part, True))]


#: the process's known values: the proxy parses with it, the providers derive from it, the journal reads it
KNOWN = KnownValues()
