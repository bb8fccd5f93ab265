"""Token-in prompts: per session, the chains of exact token IDs the proxy itself sent and the engine sampled.

A new call that extends one of them at the message level (the same messages, the last assistant turn being the one
that chain sampled) reuses its exact token IDs and renders only the new suffix with the chat template; the engine
then sees one contiguous token sequence per conversation, whatever it sampled (a non-canonical tokenization of its
own text, thinking later dropped from history). Anything else (a new context, compaction, an edited history) is
rendered whole and starts a new chain, labelled with its cause.

The suffix is the full rendering's text after the n-th end-of-turn marker, n being how many the chain's messages
render to (kept with the chain, so the prefix is never rendered again). That is exact when the tokenizer splits at
the end-of-turn token (a special token: true for Qwen); :func:`boundary_is_stable` checks it once per tokenizer and
the renderer falls back to full renders when it does not hold.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from polar_gym.proxy.chat import ChatMessage, ChatRequest
from polar_gym.proxy.tokenizer import template_messages

__all__ = ["ChainNode", "PrefixRenderer", "PromptPlan", "TemplateTokenizer", "boundary_is_stable",
           "same_message", "short_suffix_is_exact", "short_suffix_text"]

#: new turns up to this size are rendered on the event loop (well under a millisecond); larger ones in a thread, so
#: a huge tool result cannot hold every other session's calls
INLINE_SUFFIX_BYTES = 64 * 1024
#: chain nodes kept per session (oldest dropped first); a session with more live branches renders them whole
MAX_NODES = 256
_PROBE: list[dict[str, Any]] = [
          {"role": "system", "content": "You are a probe."}, {"role": "user", "content": "List the files."},
          {"role": "assistant", "content": "Sure.\n",
           "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": {"p": "."}}}]},
          {"role": "tool", "tool_call_id": "c1", "content": " a.txt\n\nb.txt "},
          {"role": "user", "content": "  thanks\n"}]


class TemplateTokenizer(Protocol):
    end_of_turn_ids: list[int]

    @property
    def end_of_turn_text(self) -> str: ...

    def render_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
                    add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> str: ...

    def encode(self, text: str) -> list[int]: ...


def boundary_is_stable(tokenizer: TemplateTokenizer) -> bool:
    """Whether tokenizing a rendered conversation in two pieces cut right after an end-of-turn marker gives the
    tokens of the whole (what suffix rendering relies on)."""
    eot = tokenizer.end_of_turn_text
    text = tokenizer.render_text(_PROBE, None)
    whole = tokenizer.encode(text)
    cut = 0
    while (at := text.find(eot, cut)) >= 0:
        cut = at + len(eot)
        if tokenizer.encode(text[:cut]) + tokenizer.encode(text[cut:]) != whole:
            return False
    return cut > 0


_STUB_USER: dict[str, Any] = {"role": "user", "content": "."}


def short_suffix_text(tokenizer: TemplateTokenizer, assistant: dict[str, Any], suffix: list[dict[str, Any]],
                      template_kwargs: dict[str, Any]) -> str | None:
    """The template's text for ``suffix`` after ``assistant``, rendered without the rest of the history, the system
    prompt or the tools (a stub user turn, the assistant turn, the suffix): the cost grows with the new messages
    only."""
    text = tokenizer.render_text([_STUB_USER, assistant, *suffix], None, template_kwargs=template_kwargs)
    eot = tokenizer.end_of_turn_text
    at = 0
    for _ in range(2):
        found = text.find(eot, at)
        if found < 0:
            return None
        at = found + len(eot)
    return text[at:]


def short_suffix_is_exact(tokenizer: TemplateTokenizer) -> bool:
    """Whether :func:`short_suffix_text` gives the full rendering's suffix on a probe conversation (system prompt,
    tools, a tool round trip, a new user turn): the template renders each new turn from local context only."""
    eot = tokenizer.end_of_turn_text
    tools = [{"type": "function", "function": {"name": "ls", "description": "list", "parameters": {
        "type": "object", "properties": {"p": {"type": "string"}}}}}]
    markers = tokenizer.render_text(_PROBE[:3], tools, add_generation_prompt=False).count(eot)
    for end in (4, 5):
        full = tokenizer.render_text(_PROBE[:end], tools)
        at = 0
        for _ in range(markers):
            at = full.index(eot, at) + len(eot)
        if short_suffix_text(tokenizer, _PROBE[2], _PROBE[3:end], {}) != full[at:]:
            return False
    return True


def _calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]


def same_message(sent: dict[str, Any], known: dict[str, Any]) -> bool:
    """Whether a template message of a request is the chain's, tolerating what harnesses legitimately change in an
    assistant turn: thinking dropped (or kept), surrounding whitespace, tool-call IDs."""
    if sent is known:
        return True
    if sent.get("role") != known.get("role"):
        return False
    if known.get("role") != "assistant":
        return sent == known
    return (str(sent.get("content") or "").strip() == str(known.get("content") or "").strip()
            and _calls(sent) == _calls(known))


@dataclass(frozen=True)
class ChainNode:
    """One completion the proxy sent: the messages through the assistant turn it sampled, and their exact tokens.
    A node keeps only the tokens it added to its parent's (suffix + sampled), so a long session costs memory in
    proportion to its unique tokens, not to the sum of its prompts."""

    chain_id: str
    messages: tuple[dict[str, Any], ...]
    tools_key: bytes
    parent: ChainNode | None
    tail: tuple[int, ...]
    ended: bool          # the sampled response ended with an end-of-turn token
    markers: int         # end-of-turn markers the messages render to
    sampled: int = 0     # how many of ``tail``'s tokens the engine sampled (the rest is prompt)

    def token_ids(self) -> list[int]:
        """The chain's exact token IDs through this node's sampled response."""
        parts: list[tuple[int, ...]] = []
        node: ChainNode | None = self
        while node is not None:
            parts.append(node.tail)
            node = node.parent
        out: list[int] = []
        for part in reversed(parts):
            out.extend(part)
        return out


@dataclass
class PromptPlan:
    """The prompt to send for one call and how it was built."""

    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tools_key: bytes
    markers: int
    chain_id: str
    reused: int = 0                  # token IDs taken from the chain as they were
    parent: ChainNode | None = None  # the node this prompt extends
    parent_len: int = 0              # token IDs of ``parent`` at the head of the prompt
    new_chain: str | None = None     # why the whole prompt was rendered (None: it extends a chain)
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def thinking(self) -> bool:
        return self.template_kwargs.get("enable_thinking") is not False


class _Session:
    def __init__(self) -> None:
        self.nodes: OrderedDict[int, ChainNode] = OrderedDict()
        self.by_head: dict[bytes, list[int]] = {}
        self.counter = 0
        self.key_of: dict[int, int] = {}  # id(node) -> key, to find a new node's parent
        self.extended: set[int] = set()   # keys of nodes a later node extends (no chain's latest turn)

    def evict_one(self) -> None:
        """Drop the oldest node some later node already extends; only when there is none, the oldest node. A chain's
        latest node is what its next call extends: a long sub-agent run must not evict the waiting main agent's."""
        key = min(self.extended) if self.extended else next(iter(self.nodes))
        old = self.nodes.pop(key)
        self.extended.discard(key)
        self.key_of.pop(id(old), None)
        self.by_head[_head(list(old.messages))].remove(key)


def _head(messages: list[dict[str, Any]]) -> bytes:
    """The index key of a conversation: its first message (chains that differ there never extend each other)."""
    return orjson.dumps(messages[0], option=orjson.OPT_SORT_KEYS) if messages else b""


class PrefixRenderer:
    """The chains of every session, and the prompt for each new call. Thread-safe (plans are made off the loop)."""

    def __init__(self, tokenizer: TemplateTokenizer, *, check_boundary: bool = True) -> None:
        self.tokenizer = tokenizer
        self.eot_text = tokenizer.end_of_turn_text
        self.eot_id = tokenizer.end_of_turn_ids[0]
        self.stable = boundary_is_stable(tokenizer) if check_boundary else True
        #: render only the new messages (else the whole conversation, cut after the chain's markers)
        self.short_suffix = short_suffix_is_exact(tokenizer) if check_boundary else False
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        #: render image parts as the template's placeholders (a vision model's engine; else images are dropped)
        self.keep_images = False

    def plan(self, request: ChatRequest, session_id: str) -> PromptPlan:
        """The prompt IDs for ``request``: a chain's IDs plus the rendered suffix, or a whole new rendering."""
        plan = self.plan_cheap(request, session_id, full=True)
        assert plan is not None  # full=True always plans
        return plan

    def plan_cheap(self, request: ChatRequest, session_id: str, *, full: bool = False) -> PromptPlan | None:
        """:meth:`plan`, or None when that needs a whole rendering (CPU-heavy: the caller moves it off the event
        loop) and ``full`` is False. Extending a chain with a short suffix render costs well under a millisecond."""
        messages, tools = template_messages(request, images=self.keep_images)
        kwargs = dict(request.extra.get("chat_template_kwargs") or {})
        tools_key = orjson.dumps(tools, option=orjson.OPT_SORT_KEYS)
        node, cause = self._find(session_id, messages, tools_key)
        if node is not None and cause == "same_prompt":
            # a retry, or another sample from the same context: exactly the tokens that call was sent
            full_ids = node.token_ids()
            prompt = full_ids[:len(full_ids) - node.sampled]
            parent_len = len(full_ids) - len(node.tail)
            return PromptPlan(prompt, messages, tools, tools_key, node.markers - 1, node.chain_id,
                              reused=len(prompt), parent=node.parent, parent_len=parent_len,
                              template_kwargs=kwargs)
        if node is not None and cause is None:
            suffix: str | None = None
            if not full and (not self.short_suffix
                             or len(orjson.dumps(messages[len(node.messages):])) > INLINE_SUFFIX_BYTES):
                return None  # a whole render, or a large new turn (a huge tool result): off the event loop
            if self.short_suffix:
                suffix = short_suffix_text(self.tokenizer, node.messages[-1], messages[len(node.messages):], kwargs)
            else:
                text = self.tokenizer.render_text(messages, tools, template_kwargs=kwargs)
                cut = self._after_marker(text, node.markers)
                suffix = text[cut:] if cut is not None else None
            if suffix is not None:
                head = node.token_ids()
                reused = len(head)
                if not node.ended:
                    head.append(self.eot_id)
                ids = head + self.tokenizer.encode(suffix)
                return PromptPlan(ids, messages, tools, tools_key, node.markers + suffix.count(self.eot_text),
                                  node.chain_id, reused=reused, parent=node, parent_len=reused,
                                  template_kwargs=kwargs)
            cause = "boundary_not_found"
        if not full:
            return None
        text = self.tokenizer.render_text(messages, tools, template_kwargs=kwargs)
        return PromptPlan(self.tokenizer.encode(text), messages, tools, tools_key, text.count(self.eot_text),
                          uuid.uuid4().hex[:16], new_chain=cause, template_kwargs=kwargs)

    def remember(self, session_id: str, plan: PromptPlan, reply: ChatMessage, response_ids: list[int]) -> None:
        """Keep what this call sent and sampled as a chain node later calls can extend."""
        assistant = template_messages(ChatRequest(model="-", messages=[reply]))[0][0]
        ended = bool(response_ids) and response_ids[-1] in self.tokenizer.end_of_turn_ids
        start = plan.parent_len if plan.parent is not None else 0
        node = ChainNode(plan.chain_id, (*plan.messages, assistant), plan.tools_key, plan.parent,
                         (*plan.prompt_ids[start:], *response_ids), ended, plan.markers + 1, len(response_ids))
        with self._lock:
            session = self._sessions.setdefault(session_id, _Session())
            key = session.counter
            session.counter += 1
            session.nodes[key] = node
            session.key_of[id(node)] = key
            session.by_head.setdefault(_head(plan.messages), []).append(key)
            parent_key = session.key_of.get(id(plan.parent)) if plan.parent is not None else None
            if parent_key is not None:
                session.extended.add(parent_key)
            while len(session.nodes) > MAX_NODES:
                session.evict_one()

    def forget(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def chain_count(self, session_id: str) -> int:
        with self._lock:
            session = self._sessions.get(session_id)
            return len({n.chain_id for n in session.nodes.values()}) if session else 0

    def _find(self, session_id: str, messages: list[dict[str, Any]],
              tools_key: bytes) -> tuple[ChainNode | None, str | None]:
        """The longest node ``messages`` extends, or None and why not."""
        if not self.stable:
            return None, "boundary_unstable"
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or not session.nodes:
                return None, "new_context"
            keys = list(session.by_head.get(_head(messages), ()))
            candidates = [session.nodes[k] for k in reversed(keys)]
        best: ChainNode | None = None
        tools_differ = False
        for node in candidates:
            size = len(node.messages)
            if size == len(messages) + 1 and node.tools_key == tools_key and all(
                    same_message(a, b) for a, b in zip(messages, node.messages[:-1], strict=True)):
                return node, "same_prompt"
            if size >= len(messages) or (best is not None and size <= len(best.messages)):
                continue
            if not same_message(messages[size - 1], node.messages[-1]):
                continue
            if not all(same_message(a, b) for a, b in zip(messages[:size - 1], node.messages[:-1], strict=True)):
                continue
            if node.tools_key != tools_key:
                tools_differ = True
                continue
            best = node
        if best is not None:
            return best, None
        if not candidates:
            return None, "new_context"
        return None, "tools_changed" if tools_differ else "history_edited"

    def _after_marker(self, text: str, count: int) -> int | None:
        """The offset just after the ``count``-th end-of-turn marker of ``text`` (None: there are fewer)."""
        at = 0
        for _ in range(count):
            found = text.find(self.eot_text, at)
            if found < 0:
                return None
            at = found + len(self.eot_text)
        return at
