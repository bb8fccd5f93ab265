"""SGLang, in two modes.

``SGLangEngine`` uses SGLang's OpenAI chat server. With ``return_prompt_token_ids`` and ``return_meta_info`` (and
``logprobs``, which turns on ``return_logprob`` inside SGLang) every choice carries its own ``prompt_token_ids`` and
the engine's ``meta_info``, whose ``output_token_logprobs`` lists ``[logprob, token_id, text]`` per sampled token
(text is null unless SGLang decodes it; some versions clamp ``-inf`` to ``-999999999.0``). SGLang parses reasoning
and tool calls itself when started with ``--reasoning-parser`` / ``--tool-call-parser``.

``SGLangGenerateEngine`` uses the native ``/generate`` API: we render the prompt with the model's chat template,
post ``input_ids`` and ``sampling_params`` with ``return_logprob``, and parse the answer
``{"text", "output_ids", "meta_info"}`` ourselves (Qwen-style ``<think>`` and ``<tool_call>`` markup). The prompt
IDs are then ours by construction, which suits trainers that must control tokenization exactly.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import httpx

from polar_gym.proxy.chat import ChatMessage, ChatRequest, ChatResult, FinishReason, FunctionCall, ToolCall, Usage
from polar_gym.proxy.engines.base import HttpEngine
from polar_gym.proxy.engines.openai import finish_reason_in, message_from_openai, usage_in
from polar_gym.proxy.tokenizer import ChatTokenizer, template_messages
from polar_gym.proxy.upstreams import UpstreamPool

__all__ = ["GenerateAnswer", "SGLangEngine", "SGLangGenerateEngine", "generate_answer", "output_tokens_in",
           "parse_qwen_text", "sampling_params"]

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_GENERATE_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "stop"}


def output_tokens_in(meta_info: dict[str, Any]) -> tuple[list[int], list[float]]:
    """Sampled token IDs and their logprobs from ``meta_info.output_token_logprobs``. A token whose logprob SGLang
    left null makes the list empty ("no logprobs", as the record schema reads it), never a made-up 0.0."""
    triples = meta_info.get("output_token_logprobs")
    if triples is None:
        raise ValueError("no meta_info.output_token_logprobs in the answer (was logprobs / return_logprob set?)")
    ids = [int(t[1]) for t in triples]
    if any(t[0] is None for t in triples):
        return ids, []
    return ids, [float(t[0]) for t in triples]


def _version_in(meta_info: dict[str, Any], body: dict[str, Any]) -> Any:
    """SGLang's weight version (set by its update-weights API), if it reports one."""
    version = meta_info.get("weight_version")
    if version is None:
        version = (body.get("metadata") or {}).get("weight_version")
    return version


@dataclass
class GenerateAnswer:
    """What SGLang's native ``/generate`` answered: the sampled ids and their logprobs (``[]``: none reported),
    the text, the finish type and the weight version it sampled with."""

    response_ids: list[int]
    logprobs: list[float]
    text: str
    finish: str
    weight_version: Any


def generate_answer(body: dict[str, Any], decode: Callable[[list[int]], str]) -> GenerateAnswer:
    """Read a ``/generate`` answer (``decode`` supplies the text when the server sent none). Raises KeyError or
    ValueError on an answer that does not hold together (callers turn them into upstream errors)."""
    meta = body["meta_info"]
    response_ids, logprobs = output_tokens_in(meta)
    output_ids = body.get("output_ids")
    if output_ids is not None and [int(t) for t in output_ids] != response_ids:
        raise ValueError("output_ids and meta_info.output_token_logprobs disagree")
    text = body.get("text")
    return GenerateAnswer(response_ids, logprobs, text if isinstance(text, str) else decode(response_ids),
                          str((meta.get("finish_reason") or {}).get("type") or "stop"), _version_in(meta, body))


class SGLangEngine(HttpEngine):
    """SGLang's OpenAI chat server with token IDs and logprobs per choice."""

    name = "sglang"

    def build(self, request: ChatRequest) -> dict[str, Any]:
        body = request.to_openai()
        body["return_prompt_token_ids"] = True
        body["return_meta_info"] = True
        body["logprobs"] = True
        body["top_logprobs"] = 0
        return body

    def parse(self, body: dict[str, Any]) -> ChatResult:
        choice = body["choices"][0]
        prompt_ids = choice.get("prompt_token_ids")
        meta = choice.get("meta_info")
        if prompt_ids is None or meta is None:
            raise ValueError("no choices[0].prompt_token_ids / choices[0].meta_info in the answer (SGLang needs a "
                             "version that supports return_prompt_token_ids and return_meta_info)")
        response_ids, logprobs = output_tokens_in(meta)
        message = message_from_openai(choice["message"])
        result = ChatResult(
            message=message,
            finish_reason=finish_reason_in(choice, bool(message.tool_calls)),
            prompt_ids=[int(t) for t in prompt_ids],
            response_ids=response_ids,
            response_logprobs=logprobs,
            usage=usage_in(body, len(prompt_ids), len(response_ids)),
            engine=self.name,
        )
        version = _version_in(meta, body)
        if version is not None:
            result.raw["weight_version"] = version
        return result


def parse_qwen_text(text: str) -> ChatMessage:
    """The assistant message in a Qwen-style completion: ``<think>…</think>`` reasoning, then content, then any
    ``<tool_call>{"name", "arguments"}</tool_call>`` blocks. A block that is not valid JSON stays in the content
    (the model's mistake is kept, not hidden)."""
    reasoning: str | None = None
    if "</think>" in text:
        head, _, text = text.partition("</think>")
        reasoning = head.replace("<think>", "", 1).strip("\n")
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            payload = json.loads(match.group(1))
            name = payload["name"]
            args = payload.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=str(name),
                                                                                           arguments=arguments)))
    kept.append(text[last:])
    content = "".join(kept).strip("\n") if calls else text.lstrip("\n")
    return ChatMessage(role="assistant", content=content, reasoning_content=reasoning or None,
                       tool_calls=calls or None)


def sampling_params(request: ChatRequest) -> dict[str, Any]:
    """SGLang's ``sampling_params`` for a chat request (names differ from OpenAI's: ``max_new_tokens``)."""
    params: dict[str, Any] = {}
    if request.max_tokens is not None:
        params["max_new_tokens"] = request.max_tokens
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(request, name)
        if value is not None:
            params[name] = value
    if request.stop:
        params["stop"] = request.stop
    if request.seed is not None:
        params["sampling_seed"] = request.seed
    return params


class SGLangGenerateEngine(SGLangEngine):
    """SGLang's native ``/generate``: we own the prompt rendering, SGLang only samples."""

    name = "sglang_generate"
    path: ClassVar[str] = "/generate"
    prompt_mode: ClassVar[str] = "token_in"  # whole prompts rendered here every call (no chain reuse)

    def __init__(self, tokenizer: ChatTokenizer, pool: UpstreamPool | None = None,
                 client: httpx.AsyncClient | None = None, timeout: float = 600.0,
                 upstream_model: str | None = None) -> None:
        super().__init__(pool, client, timeout, upstream_model=upstream_model)
        self.tokenizer = tokenizer

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.end_of_turn_ids)

    def build(self, request: ChatRequest) -> dict[str, Any]:
        messages, tools = template_messages(request)
        return {"input_ids": self.tokenizer.render(messages, tools), "sampling_params": sampling_params(request),
                "return_logprob": True, "stream": False}

    async def prepare(self, request: ChatRequest) -> dict[str, Any]:
        # Chat-template rendering is CPU work: keep it off the event loop.
        return await asyncio.to_thread(self.build, request)

    def parse(self, body: dict[str, Any]) -> ChatResult:
        raise NotImplementedError("the /generate answer does not echo the prompt: use parse_generate")

    def parse_generate(self, body: dict[str, Any], prompt_ids: list[int]) -> ChatResult:
        meta = body["meta_info"]
        answer = generate_answer(body, self.tokenizer.decode)
        response_ids, logprobs = answer.response_ids, answer.logprobs
        message = parse_qwen_text(answer.text)
        reason: FinishReason = _GENERATE_FINISH.get(answer.finish, "stop")
        if message.tool_calls and reason == "stop":
            reason = "tool_calls"
        result = ChatResult(
            message=message,
            finish_reason=reason,
            prompt_ids=list(prompt_ids),
            response_ids=response_ids,
            response_logprobs=logprobs,
            usage=Usage(prompt_tokens=int(meta.get("prompt_tokens", len(prompt_ids))),
                        completion_tokens=int(meta.get("completion_tokens", len(response_ids)))),
            engine=self.name,
        )
        if answer.weight_version is not None:
            result.raw["weight_version"] = answer.weight_version
        return result

    def parse_for(self, body: dict[str, Any], sent: dict[str, Any]) -> ChatResult:
        return self.parse_generate(body, sent["input_ids"])

    async def count_tokens(self, request: ChatRequest, session_id: str) -> int:
        return len((await self.prepare(request))["input_ids"])
