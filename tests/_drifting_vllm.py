"""A vLLM-compatible upstream on loopback that plays scripted agents with the real Qwen tokenizer and samples
NON-CANONICAL tokenizations of its own text on 30 % of calls: the upstream the token-in path exists for.

What it fakes, and how far (a documented fake, not a mock):
- vLLM 0.32's OpenAI server for token prompts: ``POST /v1/completions`` with ``prompt`` a list of token IDs,
  answered in vLLM's shape (``choices[0].prompt_token_ids``, ``token_ids`` ending with the stop token, ``text``
  without it, ``logprobs.token_logprobs``, ``finish_reason``/``stop_reason``, ``usage``); errors in vLLM's
  ``{"error": {message, type, param, code}}`` shape; ``GET /v1/models``. Real vLLM also takes text prompts; this
  one refuses anything but a list of token IDs (400), so a prompt that was not sent as tokens is caught. For
  contrast, ``POST /v1/chat/completions`` plays the same model the chat-mode way (vLLM renders and tokenizes the
  whole history itself, and parses the answer into a message).
- The model: it decodes the prompt, reads the conversation (the agent's name from ``You are NAME`` in the system
  prompt, its first tool, the last user task ``... N steps ...``, how many assistant turns followed it) and answers
  like a Qwen3 agent: a ``<think>`` block (unless the prompt closed it), then a hermes ``<tool_call>`` JSON for the
  next step (after a line of text on every other step, unless the task says ``quietly``), or a final text; a task
  that starts with ``Summarize`` asks for a one-line summary. The n-th time one exact prompt is seen it answers
  variant n (``sample n``), as sampling would: a retry gets another answer, two sub-agents from one prompt diverge
  (in their tool calls; the line of text before them stays the same, as it often does with a real model).
  Logprobs are a deterministic function of the prompt and the position.
- Faults on demand: :meth:`DriftingVLLM.fail_next` answers the next call 500; :meth:`DriftingVLLM.hold_next` keeps
  the next call until its gate opens (a client-timeout retry while the first attempt still runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from polar_gym.proxy.chat import ChatRequest
from polar_gym.proxy.parsers.base import parser_for
from polar_gym.proxy.tokenizer import HFChatTokenizer, template_messages
from polar_gym.serving import EmbeddedServer, free_port

__all__ = ["DriftingVLLM", "Exchange", "agent_reply", "drifting_vllm", "noncanonical", "read_turns"]

MODEL = "qwen3-drifting"
#: calls whose number modulo 10 is here sample a non-canonical tokenization: 30 %
DRIFT_CALLS = (1, 4, 7)
_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>|\Z)", re.S)
_FIRST_TOOL = re.compile(r'<tools>\n\{"type": "function", "function": \{"name": "([^"]+)"')
_STEPS = re.compile(r"(\d+) steps?")
_HOLD_SECONDS = 60.0  # a held call is answered at the latest then (a test that forgot to release it fails anyway)


@dataclass(frozen=True)
class Turn:
    role: str
    content: str


def read_turns(prompt_text: str) -> list[Turn]:
    """The turns of a rendered Qwen prompt, the open generation turn included (its content: what the template
    pre-filled, e.g. an empty think block)."""
    return [Turn(m.group(1), m.group(2)) for m in _TURN.finditer(prompt_text)]


def agent_reply(turns: list[Turn], sample: int) -> str:
    """What the scripted agent writes next for this conversation (without the end-of-turn token)."""
    open_turn = turns[-1] if turns and turns[-1].role == "assistant" else Turn("assistant", "")
    history = turns[:-1] if turns and turns[-1].role == "assistant" else turns
    system = history[0].content if history and history[0].role == "system" else ""
    name = m.group(1) if (m := re.search(r"You are ([\w-]+)", system)) else "agent"
    tool = m.group(1) if (m := _FIRST_TOOL.search(system)) else None
    tasks = [i for i, t in enumerate(history) if t.role == "user" and not t.content.startswith("<tool_response>")]
    last = tasks[-1] if tasks else 0
    task = history[last].content if history else ""
    done = sum(1 for t in history[last + 1:] if t.role == "assistant")
    steps = int(m.group(1)) if (m := _STEPS.search(task)) else 0
    think = "</think>" not in open_turn.content  # the template closed the think block: thinking is off
    text = f"<think>\n{name}: step {done + 1} of {steps}, sample {sample}.\n</think>\n\n" if think else ""
    if task.lower().startswith("summarize"):
        calls = sum(1 for t in history if t.content.startswith("<tool_response>"))
        return text + f"Summary: {name} made {calls} tool calls so far (sample {sample})."
    if done < steps and tool is not None:
        call = json.dumps({"name": tool, "arguments": {"command": f"{name} step {done + 1} sample {sample}"}})
        lead = f"Step {done + 1}: checking.\n" if done % 2 == 0 and "quietly" not in task else ""
        return text + f"{lead}<tool_call>\n{call}\n</tool_call>"
    return text + f"{name} is done after {steps} steps (sample {sample})."


def noncanonical(tok: HFChatTokenizer, text: str) -> list[int]:
    """A tokenization of ``text`` that is not the canonical one: two multi-character tokens (near a quarter and
    three quarters of the way) each split in two, as a real model sometimes samples. Decodes to ``text``."""
    ids = tok.encode(text)
    for where in (0.75, 0.25):
        for i in sorted(range(len(ids)), key=lambda i: abs(i - int(len(ids) * where))):
            piece = tok.decode([ids[i]])
            if len(piece) < 2 or "<" in piece or ">" in piece:
                continue
            split = tok.encode(piece[:1]) + tok.encode(piece[1:])
            candidate = ids[:i] + split + ids[i + 1:]
            if len(split) > 1 and tok.decode(candidate) == text:
                ids = candidate
                break
    return ids


@dataclass
class Exchange:
    """One call as the upstream saw it."""

    prompt_ids: list[int]
    status: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    drift: bool = False


def _logprob(digest: bytes, i: int) -> float:
    return -((int.from_bytes(digest[:4], "big") + 7919 * i) % 997 + 1) / 1000


def _error(status: int, kind: str, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


class DriftingVLLM:
    """The upstream's state and its FastAPI app (served by :func:`drifting_vllm`)."""

    def __init__(self, tok: HFChatTokenizer, model: str = MODEL) -> None:
        self.tok, self.model = tok, model
        self.eot = tok.end_of_turn_ids[0]
        self.url = ""
        self.exchanges: list[Exchange] = []
        self.seen: Counter[bytes] = Counter()
        self.calls = 0
        self.held = 0
        self._fail_next = False
        self._hold_next: threading.Event | None = None
        self._gates: list[threading.Event] = []
        self.app = FastAPI()
        self.app.post("/v1/completions")(self.completions)
        self.app.post("/v1/chat/completions")(self.chat_completions)
        self.app.get("/v1/models")(self.models)

    def fail_next(self) -> None:
        """Answer the next completion call with a 500 (an engine error a client retries)."""
        self._fail_next = True

    def hold_next(self) -> threading.Event:
        """Keep the next completion call until the returned gate is set (or :meth:`release`): a slow attempt."""
        gate = threading.Event()
        self._gates.append(gate)
        self._hold_next = gate
        return gate

    def release(self) -> None:
        """Answer every held call."""
        for gate in self._gates:
            gate.set()

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": int(time.time()),
                                            "owned_by": "vllm", "root": self.model, "parent": None,
                                            "max_model_len": 40960, "permission": []}]}

    async def completions(self, request: Request) -> JSONResponse:
        body = await request.json()
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not (isinstance(prompt, list) and prompt
                and all(type(t) is int and 0 <= t < 2**31 for t in prompt)):
            return _error(400, "Bad Request", "1 validation error: this upstream takes token prompts only: prompt "
                          "must be a non-empty list of token IDs", "body.prompt")
        if body.get("model") not in (None, self.model):
            return _error(404, "NotFoundError", f"The model `{body.get('model')}` does not exist.", "model")
        sampled = await self._sample(list(prompt), body.get("max_tokens"))
        if isinstance(sampled, JSONResponse):
            return sampled
        exchange, text, finish, stop = sampled
        ids, logprobs = exchange.token_ids, exchange.logprobs
        pieces = [self.tok.decode([t]) for t in ids]
        offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
        choice = {"index": 0, "text": text, "finish_reason": finish, "stop_reason": stop,
                  "token_ids": ids, "prompt_token_ids": list(prompt), "prompt_logprobs": None,
                  "logprobs": {"text_offset": offsets, "token_logprobs": logprobs, "tokens": pieces,
                               "top_logprobs": [{p: lp} for p, lp in zip(pieces, logprobs, strict=True)]}}
        return JSONResponse({"id": f"cmpl-{self.calls}", "object": "text_completion", "created": int(time.time()),
                             "model": self.model, "choices": [choice], "usage": _usage(prompt, ids)})

    async def chat_completions(self, request: Request) -> JSONResponse:
        """vLLM's chat endpoint with ``return_token_ids`` (the proxy's ``prompt_mode: chat``): the server renders
        the messages with the chat template and tokenizes the whole history again on every call."""
        body = await request.json()
        chat = ChatRequest.model_validate({k: body[k] for k in ("model", "messages", "tools") if k in body})
        messages, tools = template_messages(chat)
        text = self.tok.render_text(messages, tools, template_kwargs=body.get("chat_template_kwargs"))
        prompt = self.tok.encode(text)
        sampled = await self._sample(prompt, body.get("max_tokens"))
        if isinstance(sampled, JSONResponse):
            return sampled
        exchange, text, finish, _ = sampled
        reply = parser_for("qwen3").parse(text, chat.tools).message
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                "arguments": c.function.arguments}}
                 for c in reply.tool_calls or []]
        message = {"role": "assistant", "content": reply.content, "reasoning_content": reply.reasoning_content,
                   "tool_calls": calls}
        content: list[dict[str, Any]] = [
            {"token": self.tok.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
            for t, lp in zip(exchange.token_ids, exchange.logprobs, strict=True)]
        choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if calls else finish,
                  "token_ids": exchange.token_ids, "logprobs": {"content": content}}
        return JSONResponse({"id": f"chatcmpl-{self.calls}", "object": "chat.completion",
                             "created": int(time.time()), "model": self.model, "choices": [choice],
                             "prompt_token_ids": prompt, "usage": _usage(prompt, exchange.token_ids)})

    async def _sample(self, prompt: list[int],
                      max_tokens: Any) -> tuple[Exchange, str, str, int | None] | JSONResponse:
        """The scripted model's answer to ``prompt`` (after any scripted fault): the exchange (sampled IDs and
        logprobs), the text, the finish reason and vLLM's stop_reason."""
        self.calls += 1
        exchange = Exchange(prompt, 200)
        self.exchanges.append(exchange)
        if self._fail_next:
            self._fail_next = False
            exchange.status = 500
            return _error(500, "InternalServerError", "EngineCore encountered an issue (scripted failure)")
        if self._hold_next is not None:
            gate, self._hold_next = self._hold_next, None
            self.held += 1
            await asyncio.to_thread(gate.wait, _HOLD_SECONDS)
        digest = hashlib.sha256(json.dumps(prompt).encode()).digest()
        sample = self.seen[digest]
        self.seen[digest] += 1
        text = agent_reply(read_turns(self.tok.decode(prompt)), sample)
        drift = self.calls % 10 in DRIFT_CALLS
        ids = [*(noncanonical(self.tok, text) if drift else self.tok.encode(text)), self.eot]
        finish = "stop"
        stop: int | None = self.eot  # vLLM's stop_reason: the stop token that ended the turn
        if isinstance(max_tokens, int) and len(ids) > max_tokens:
            ids, finish, stop = ids[:max_tokens], "length", None
            text = self.tok.decode(ids)
        exchange.token_ids, exchange.logprobs = ids, [_logprob(digest, i) for i in range(len(ids))]
        exchange.drift = drift and finish == "stop"
        return exchange, text, finish, stop


def _usage(prompt: list[int], ids: list[int]) -> dict[str, Any]:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids),
            "prompt_tokens_details": None}


@contextlib.contextmanager
def drifting_vllm(tok: HFChatTokenizer, model: str = MODEL) -> Iterator[DriftingVLLM]:
    """The upstream served by uvicorn on a loopback port in its own thread while the block runs."""
    upstream = DriftingVLLM(tok, model)
    port = free_port()
    server = EmbeddedServer(uvicorn.Config(upstream.app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60  # generous: CI may be loaded
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the drifting vLLM upstream did not start")
        time.sleep(0.01)
    upstream.url = f"http://127.0.0.1:{port}"
    try:
        yield upstream
    finally:
        upstream.release()
        server.should_exit = True
        thread.join(timeout=10)
