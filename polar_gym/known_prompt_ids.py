"""An engine's prompt token IDs, parsed past what the session's last answer shared.

The engine's answer repeats as the request does (:mod:`polar_gym.known_json`): its prompt token IDs (vLLM's and
SGLang's ``prompt_token_ids``) start with the previous call's prompt, since an agent's conversation only grows.
:class:`KnownPromptIds` keeps each session's last prompt IDs as their JSON text and parsed, so a new answer's IDs are
parsed from where they differ: 2,000 IDs cost ~25 us to parse and 30,000 ~400 us, on every call. Pure: no I/O.
"""

from __future__ import annotations

import collections
import secrets
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from polar_gym.known_json import shared_bytes

__all__ = ["KnownPromptIds", "PromptIds"]


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
    """A list of prompt IDs as kept: ~46 bytes a token (its JSON, the list of ints, packed). Making the ints again
    from the packed IDs instead (~10 bytes a token kept) cost 18 us a call at 2,000 tokens, 5 % of a call."""

    #: the IDs' JSON text as the engine wrote it, ``[`` to ``]``
    text: bytes
    ids: PromptIds


class KnownPromptIds:
    """Each session's last prompt token IDs, as the engine wrote them and parsed (``per_scope`` lists a session:
    its agent's and its sub-agents'), ``max_tokens`` of them in all (~92 MB; least recently used session first out).

    :meth:`loads` is ``orjson.loads`` of an engine's answer, with the IDs of ``prompt_token_ids`` (top-level, as
    vLLM's chat answer has them, or in the first choice, as SGLang's and vLLM's completions) parsed only past what
    they share with a known list of the session: the shared items are taken from it. Every result is the same as
    ``orjson.loads`` gives (a test drives random answers against it); the IDs come as :class:`PromptIds` when they
    are all uint32s, else as the plain list ``orjson.loads`` makes. Not thread-safe: one event loop reads answers.
    """

    def __init__(self, *, per_scope: int = 4, max_tokens: int = 2 << 20, min_bytes: int = 2048) -> None:
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
                known = best.ids
                whole = cut == len(best.text) - 1  # all of it: no commas to count
                keep = len(known) if whole else best.text.count(b",", 0, cut) + 1
                if whole and span[cut] != ord(","):
                    ids = known  # the same IDs again (a retry): the same list, never changed in place
                else:
                    tail = orjson.loads(b"[" + span[cut + 1:]) if span[cut] == ord(",") else []
                    packed = known.packed[:keep] if keep < len(known) else known.packed
                    ids = PromptIds(known[:keep] if keep < len(known) else known, packed + array("I", tail))
                    ids.extend(tail)
        except (orjson.JSONDecodeError, TypeError, OverflowError):
            return None  # not an array of uint32s: parsed whole, as it always was
        if best is not None:
            self.hits += 1
            self.reused += keep
        # IDs that go on from all of a known list replace it; ones that share only its start (a sub-agent's
        # prompt, opening with the same system prompt) are kept beside it.
        self._remember(scope, entries, best if best is not None and keep == len(best.ids) else None,
                       _KnownIds(span, ids))
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
    shared = shared_bytes(span, 0, text[:head])
    if shared == head and len(span) > head and span[head] in b",]":
        return head  # the usual case: the new prompt starts with the whole known one
    comma = span.rfind(b",", 0, shared)  # a comma before ``shared`` is in both
    return max(comma, 0)
