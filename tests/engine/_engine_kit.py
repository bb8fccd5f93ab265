"""The real-engine tier: a proxy in front of the session's vLLM CPU server (``tests/_vllm.py``: tiny random Qwen3,
real Qwen tokenizer) whose upstream client keeps every raw answer, so tests compare what we recorded with what the
engine actually said."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar_gym.assets import (
    tokenizer_dir,
)
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.chat import ChatRequest, ChatResult
from polar_gym.proxy.engines.base import StreamPiece
from polar_gym.proxy.engines.tokenin import TokenInEngine, VLLMTokenInEngine
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool
from tests._serving import serve
from tests._vllm import VLLMServer  # the vllm_server fixture itself is registered by tests/conftest.py


@pytest.fixture(scope="session")
def qwen_tokenizer(vllm_server: VLLMServer) -> HFChatTokenizer:
    return HFChatTokenizer(vllm_server.tokenizer_dir)


@dataclass
class Exchange:
    """One upstream call as it went over the wire."""

    path: str
    request: dict[str, Any]
    status: int
    answer: dict[str, Any]


def joined_stream(content: bytes) -> dict[str, Any] | None:
    """A vLLM stream with ``return_token_ids`` (``/v1/completions``, or ``/v1/chat/completions`` in chat mode) as the
    one answer it adds up to (the shape of the same call not streamed), so tests read a streamed call's wire as they
    read any other; None if it is not one."""
    chunks = [json.loads(line[5:]) for line in content.decode(errors="replace").splitlines()
              if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    if not chunks or not all(isinstance(c, dict) for c in chunks):
        return None
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    if not choices:
        return None
    finish = next((ch.get("finish_reason") for ch in reversed(choices) if ch.get("finish_reason")), None)
    token_ids = [t for ch in choices for t in ch.get("token_ids") or []]
    if any("delta" in ch for ch in choices):  # a chat stream: deltas, the prompt's IDs on the first chunk
        deltas = [ch.get("delta") or {} for ch in choices]
        message = {"role": "assistant", "content": "".join(d.get("content") or "" for d in deltas) or None,
                   "reasoning": "".join(d.get("reasoning") or d.get("reasoning_content") or "" for d in deltas)
                   or None}
        return {"choices": [{"index": 0, "message": message, "finish_reason": finish, "token_ids": token_ids,
                             "logprobs": {"content": [item for ch in choices
                                                      for item in (ch.get("logprobs") or {}).get("content") or []]}}],
                "prompt_token_ids": next((c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids")), None),
                "usage": next((c["usage"] for c in reversed(chunks) if c.get("usage")), None), "streamed": True}
    return {"choices": [{"index": 0, "text": "".join(c.get("text") or "" for c in choices),
                         "prompt_token_ids": choices[0].get("prompt_token_ids"), "token_ids": token_ids,
                         "logprobs": {"token_logprobs": [v for c in choices
                                                         for v in (c.get("logprobs") or {}).get("token_logprobs")
                                                         or []]},
                         "finish_reason": finish}], "streamed": True}


@dataclass
class RecordingTransport(httpx.AsyncBaseTransport):
    """Passes requests to the real network transport and keeps each request body and raw JSON answer."""

    exchanges: list[Exchange] = field(default_factory=list)
    # no keep-alive: each proxy runs on its own short-lived event loop, which must not leave sockets open behind it
    inner: httpx.AsyncBaseTransport = field(
        default_factory=lambda: httpx.AsyncHTTPTransport(limits=httpx.Limits(max_keepalive_connections=0)))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        content = await response.aread()
        await response.aclose()
        try:
            answer = json.loads(content)
        except ValueError:
            answer = joined_stream(content) or {"_raw": content.decode(errors="replace")}
        self.exchanges.append(Exchange(request.url.path, json.loads(request.content or b"{}"),
                                       response.status_code, answer))
        headers = [(k, v) for k, v in response.headers.multi_items()
                   if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")]
        return httpx.Response(response.status_code, headers=headers, content=content, request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclass
class EngineProxy:
    """The proxy (real app, uvicorn, loopback) with a VLLMEngine on the real server, plus the wire log."""

    url: str
    service: ProxyService
    transport: RecordingTransport
    server: VLLMServer

    @property
    def exchanges(self) -> list[Exchange]:
        return self.transport.exchanges


@pytest.fixture
def engine_proxy(vllm_server: VLLMServer) -> Iterator[EngineProxy]:
    transport = RecordingTransport()
    client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(120.0, connect=5.0))
    engine = VLLMEngine(UpstreamPool([vllm_server.url]), client=client, upstream_model=vllm_server.model)
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True),
                           model_names=[vllm_server.model])
    for running in serve(service):
        yield EngineProxy(running.url, service, transport, vllm_server)


SGLANG_HINT = ("needs a running SGLang server (GPU only): on a GPU node run `python -m sglang.launch_server "
               "--model-path Qwen/Qwen3-0.6B --port 30000 --tool-call-parser qwen25 --reasoning-parser qwen3`, then "
               "`POLAR_SGLANG_URL=http://127.0.0.1:30000 POLAR_SGLANG_MODEL=Qwen/Qwen3-0.6B "
               "pytest -m engine tests/engine/test_sglang_real.py`")


@pytest.fixture
def sglang_proxy() -> Iterator[EngineProxy]:
    """The proxy with an SGLangEngine on the server at $POLAR_SGLANG_URL (never started here: SGLang is GPU-only)."""
    from polar_gym.proxy.engines.sglang import SGLangEngine

    url = os.environ.get("POLAR_SGLANG_URL")
    if not url:
        pytest.skip(f"POLAR_SGLANG_URL is not set: this test {SGLANG_HINT}")
    model = os.environ.get("POLAR_SGLANG_MODEL", "default")
    server = VLLMServer(url.rstrip("/"), model, Path(), tokenizer_dir(), Path(), 0.0)
    transport = RecordingTransport()
    client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(120.0, connect=5.0))
    engine = SGLangEngine(UpstreamPool([server.url]), client=client, upstream_model=model)
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True), model_names=[model])
    for running in serve(service):
        yield EngineProxy(running.url, service, transport, server)


# -- real harnesses on the real engine: steering tool calls, counting conversations -----------------------------------
#: calls of one conversation that the engine is made to answer with a shell call (later calls sample freely)
STEERED_TOOL_TURNS = 2
#: the commands a steered call may choose between: one, so each conversation runs the same command twice, as agents
#: re-run a test (the two calls must still get two ids)
STEERED_COMMANDS = ("ls",)
#: steered calls per session at most (retries and sub-agents included): a harness that never answers a call with a
#: tool result cannot keep the engine calling tools until its deadline
STEERED_PER_SESSION = 8
#: room for the whole block (the grammar ends the reply there), whatever cap the test's proxy sets on free replies
STEERED_MAX_TOKENS = 160
#: a steered call cut here never closes its block (``<tool_call>`` alone is 4 tokens of this tokenizer)
CUT_MAX_TOKENS = 12
_REGEX_SPECIAL = set("\\.^$|?*+()[]{}")


def _regex_literal(text: str) -> str:
    return "".join("\\n" if c == "\n" else "\\" + c if c in _REGEX_SPECIAL else c for c in text)


def shell_call_regex(tool: Any) -> str:
    """A regex for one hermes ``<tool_call>`` block calling ``tool`` (the harness's own shell tool, its arguments
    shaped by its schema) with one of :data:`STEERED_COMMANDS`."""
    from polar_gym.proxy.engines.oracle import shell_arguments

    marker = "POLARCOMMANDSLOT"
    body = json.dumps({"name": tool.name, "arguments": shell_arguments(tool, marker)})
    head, tail = body.split(marker)
    choice = "(" + "|".join(_regex_literal(c) for c in STEERED_COMMANDS) + ")"
    return _regex_literal("<tool_call>\n" + head) + choice + _regex_literal(tail + "\n</tool_call>")


def regex_steered(request: ChatRequest, regex: str, **update: Any) -> ChatRequest:
    """``request`` asking vLLM for structured output matching ``regex`` (and ``update``'s other fields): the engine
    still samples every token, the grammar only masks its logits."""
    steered = request.model_copy(update={"extra": {**request.extra, "structured_outputs": {"regex": regex}},
                                         **update})
    steered._dump = None  # the copy must not reuse the original's cached dump
    return steered


class SteeredCalls(TokenInEngine):
    """A token-in engine whose every call, streamed or not, goes through :meth:`steer` first (mixed in before the
    engine class: ``class E(SteeredCalls, VLLMTokenInEngine)``)."""

    def steer(self, request: ChatRequest) -> ChatRequest:
        return request

    async def complete(self, request: ChatRequest, session_id: str) -> ChatResult:
        return await super().complete(self.steer(request), session_id)

    def stream(self, request: ChatRequest, session_id: str) -> AsyncGenerator[StreamPiece, None]:
        return super().stream(self.steer(request), session_id)


class ToolSteeredEngine(VLLMTokenInEngine):
    """The token-in engine, asking vLLM for structured output (a regex over a shell ``<tool_call>`` block) on the
    first :data:`STEERED_TOOL_TURNS` calls of a conversation that offers a shell tool: random weights almost never
    write a well-formed tool call, but the harness's tool loop is what the chains must survive. The next call of the
    conversation (once per session) starts the same block but is cut at :data:`CUT_MAX_TOKENS`, as a real model cut
    at max_tokens mid-call: an unclosed block the parser must answer as text and flag. The engine still samples
    every token (the grammar only masks its logits) and returns its own IDs and logprobs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steered: dict[str, int] = {}  # session -> calls sent with the regex
        self.cut: dict[str, int] = {}      # session -> of those, calls cut before the block closes

    def steer(self, request: ChatRequest, session_id: str) -> ChatRequest:
        """``request`` with the regex (and its token budget) when this call is steered, else as it is."""
        from polar_gym.proxy.engines.oracle import find_shell_tool

        tool = find_shell_tool(request.tools)
        done = sum(1 for m in request.messages if m.role == "tool")
        if (tool is not None and done <= STEERED_TOOL_TURNS and request.tool_choice != "none"
                and self.steered.get(session_id, 0) < STEERED_PER_SESSION):
            cut = done == STEERED_TOOL_TURNS
            if cut and self.cut.get(session_id):
                return request
            extra = {**request.extra, "structured_outputs": {"regex": shell_call_regex(tool)}}
            request = request.model_copy(update={"extra": extra,
                                                 "max_tokens": CUT_MAX_TOKENS if cut else STEERED_MAX_TOKENS})
            request._dump = None  # the copy must not reuse the original's cached dump
            self.steered[session_id] = self.steered.get(session_id, 0) + 1
            self.cut[session_id] = self.cut.get(session_id, 0) + cut
        return request

    async def complete(self, request: ChatRequest, session_id: str) -> ChatResult:
        return await super().complete(self.steer(request, session_id), session_id)

    def stream(self, request: ChatRequest, session_id: str) -> AsyncGenerator[StreamPiece, None]:
        """Streamed calls (harnesses that stream get them passed through) are steered the same way."""
        return super().stream(self.steer(request, session_id), session_id)


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return str(content or "")


def _arguments(raw: Any) -> Any:
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return raw


def message_key(message: dict[str, Any]) -> str:
    """A message as a conversation sees it: an assistant turn by its text (surrounding whitespace aside) and its
    tool calls' names and arguments (IDs, reasoning and argument formatting aside); any other message whole."""
    role = message.get("role")
    if role != "assistant":
        return json.dumps({k: v for k, v in message.items() if v not in (None, "")}, sort_keys=True)
    calls = [(c["function"]["name"], _arguments(c["function"].get("arguments")))
             for c in message.get("tool_calls") or []]
    return json.dumps({"role": role, "content": _text(message.get("content")).strip(), "calls": calls},
                      sort_keys=True)


@dataclass
class _Turn:
    messages: list[str]
    attempts: list[str] = field(default_factory=list)             # each call's reply
    children: dict[int, set[str]] = field(default_factory=dict)   # attempt index -> turns going on from it


@dataclass
class ConversationCount:
    conversations: int
    roots: int            # calls that go on from no earlier call
    edited: int           # of those, calls that repeat an earlier call's messages but not its reply
    branches: int         # a second turn going on from one reply
    forks: int            # a second attempt of one turn that is also continued
    branch_calls: list[Any] = field(default_factory=list)  # the records that started a branch


def count_conversations(records: list[Any]) -> ConversationCount:
    """Conversations among ``records`` (journal order), from the request messages alone, independently of any
    builder: a call continues an earlier one when its messages start with that call's messages plus its reply (the
    longest such); calls with the same messages are attempts at one turn (a retry). A conversation starts at every
    call that continues none, at every further turn continuing one reply (a branch), and at every further attempt
    of a turn that is continued too (a fork)."""
    turns: dict[str, _Turn] = {}
    roots = edited = 0
    branch_calls: list[Any] = []
    for rec in records:
        messages = [message_key(m) for m in rec.normalized_request.get("messages") or []]
        key = json.dumps(messages)
        reply = message_key({"role": "assistant", **(rec.response.get("message") or {})})
        if key in turns:
            turns[key].attempts.append(reply)
            continue
        turn = turns[key] = _Turn(messages, [reply])
        parent: tuple[_Turn, int] | None = None
        for earlier in turns.values():
            size = len(earlier.messages)
            if earlier is turn or size >= len(messages) or messages[:size] != earlier.messages:
                continue
            if messages[size] in earlier.attempts and (parent is None or size > len(parent[0].messages)):
                parent = earlier, earlier.attempts.index(messages[size])
        if parent is None:
            roots += 1
            edited += any(t is not turn and len(t.messages) < len(messages) and messages[:len(t.messages)] ==
                          t.messages for t in turns.values())
        else:
            kids = parent[0].children.setdefault(parent[1], set())
            if kids:
                branch_calls.append(rec)
            kids.add(key)
    branches = sum(max(0, len(kids) - 1) for t in turns.values() for kids in t.children.values())
    forks = sum(max(0, len(t.children) - 1) for t in turns.values())
    return ConversationCount(roots + branches + forks, roots, edited, branches, forks, branch_calls)
