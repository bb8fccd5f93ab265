"""What harnesses really send, for benchmarks: agent sessions of the four recorded harnesses, growing turn by turn
as each harness grows them (bench_traffic.py drives them through the proxy, LiteLLM and direct).

A session starts from the harness's recorded second call (tests/data/harness/<harness>/01.json: its system prompt,
tools and settings as sent, and one round of the model's tool call and the tool's result). Each turn appends one
more round made from that recorded round: fresh call ids, a fresh thought and command, a tool result of 10 to 600
words, signatures kept as recorded. Claude Code's ``cache_control`` marker moves to the newest tool result (the
harness moves it every turn); a compaction replaces the conversation by the opening with a summary.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

__all__ = ["HARNESSES", "HarnessSession", "Shape", "auth_headers", "direct_body"]

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shape:
    """Where a harness keeps its conversation, and how many of a round's items are the model's answer."""

    front_end: str  # the proxy's provider name
    items: str  # the body key holding the conversation
    answer_items: int  # of the recorded round: the model's items, then the tool's


#: each front end's real harness, as recorded
HARNESSES = {
    "claude_code": Shape("anthropic", "messages", 1),
    "codex": Shape("openai_responses", "input", 2),  # a reasoning item and the function call
    "gemini_cli": Shape("google", "contents", 1),
    "qwen_code": Shape("openai_chat", "messages", 1),
}

#: keys whose value pairs an answer with its result: the same fresh value on both sides
_IDS = {"id", "tool_use_id", "call_id", "tool_call_id"}
#: keys whose string is what the model or the tool said: replaced by fresh words
_SAID = {"thinking", "text", "output", "content", "reasoning_content", "command"}
#: keys whose value is the model's own opaque state: kept as recorded
_KEPT = {"signature", "thoughtSignature", "encrypted_content", "cache_control"}


def _fresh(value: Any, rng: random.Random, words: list[str], ident: str, lengths: tuple[int, int]) -> Any:
    """``value`` with ids set to ``ident`` and what was said replaced by ``lengths`` (min, max) fresh words."""
    if isinstance(value, list):
        return [_fresh(v, rng, words, ident, lengths) for v in value]
    if not isinstance(value, dict):
        return value
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key in _KEPT:
            out[key] = v
        elif key in _IDS and isinstance(v, str):
            out[key] = ident
        elif key in _SAID and isinstance(v, str):
            out[key] = " ".join(rng.choices(words, k=rng.randint(*lengths)))
        elif key == "arguments" and isinstance(v, str):  # a function call's arguments: JSON text
            out[key] = json.dumps({"command": " ".join(rng.choices(words, k=rng.randint(3, 30)))})
        elif key == "args" and isinstance(v, dict):  # Gemini's function call arguments: an object
            out[key] = {"command": " ".join(rng.choices(words, k=rng.randint(3, 30)))}
        else:
            out[key] = _fresh(v, rng, words, ident, lengths)
    return out


def _without_cache_marks(item: Any) -> Any:
    if isinstance(item, dict):
        return {k: _without_cache_marks(v) for k, v in item.items() if k != "cache_control"}
    if isinstance(item, list):
        return [_without_cache_marks(v) for v in item]
    return item


@dataclass
class HarnessSession:
    """One agent session of ``harness``: ``next_body()`` is each call's body as the harness sends it."""

    harness: str
    seed: int
    path: str = ""
    body: dict[str, Any] = field(default_factory=dict)
    turn: int = 0

    def __post_init__(self) -> None:
        recorded = json.loads((ROOT / "tests" / "data" / "harness" / self.harness / "01.json").read_text())
        self.shape = HARNESSES[self.harness]
        self.path = recorded["path"]
        self.body = recorded["body"]
        items = self.body[self.shape.items]
        self.round = items[-(self.shape.answer_items + 1):]
        self.opening = items[:-(self.shape.answer_items + 1)]
        self.rng = random.Random(self.seed)
        self.words = [f"w{self.rng.randrange(50000)}" for _ in range(2000)]
        self.conversation = [*self.opening, *_fresh(self.round, self.rng, self.words, f"c{self.seed}x0", (5, 60))]

    def next_body(self) -> bytes:
        """This turn's body (compact JSON, as Node and Rust harnesses send it); the next grows by a round."""
        body = orjson.dumps({**self.body, self.shape.items: self.conversation})
        self.turn += 1
        ident = f"c{self.seed}x{self.turn}"
        answer = _fresh(self.round[:self.shape.answer_items], self.rng, self.words, ident, (5, 60))
        result = _fresh(self.round[self.shape.answer_items:], self.rng, self.words, ident, (10, 600))
        if self.harness == "claude_code":  # the marker moves to the newest tool result
            self.conversation = [*self.conversation[:-1], _without_cache_marks(self.conversation[-1])]
        self.conversation = [*self.conversation, *answer, *result]
        return body

    def compact(self) -> None:
        """The conversation replaced by its opening with a summary in its last message (a shorter prompt)."""
        summary = _fresh(self.opening[-1:], self.rng, self.words, f"c{self.seed}s", (100, 400))
        self.conversation = [*copy.deepcopy(self.opening[:-1]), *summary]


def auth_headers(front_end: str, key: str) -> dict[str, str]:
    """The headers a harness of ``front_end`` sends its key in (the proxy's ad-hoc session is the key)."""
    header = {"anthropic": "x-api-key", "google": "x-goog-api-key"}.get(front_end)
    return {"content-type": "application/json",
            **({header: key} if header else {"authorization": f"Bearer {key}"})}


def direct_body(harness: str, path: str, body: bytes) -> bytes:
    """The streamed Chat body polar_gym's proxy sends upstream for ``body``: what the harness would send if it spoke
    the upstream's protocol itself (the ``direct`` target)."""
    from polar_gym.proxy.detect import split_google_path
    from polar_gym.proxy.engines.vllm import VLLMEngine
    from polar_gym.proxy.providers.base import Route
    from polar_gym.registry import PROVIDERS

    front_end = HARNESSES[harness].front_end
    url_path, _, query = path.partition("?")
    split = split_google_path(url_path) if front_end == "google" else None
    route = Route(url_path, model=split[0] if split else None, action=split[1] if split else None,
                  query=dict(q.split("=", 1) for q in query.split("&") if "=" in q))
    chat = PROVIDERS.get(front_end)().parse(orjson.loads(body), route).chat
    engine = VLLMEngine.__new__(VLLMEngine)  # build() is pure: no client, no pool
    return orjson.dumps({**VLLMEngine.build(engine, chat), "stream": True, "stream_options": {"include_usage": True}})
