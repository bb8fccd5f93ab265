"""Token-in engines: the proxy sends the engine exact prompt token IDs (``prompt_mode: token_in``).

The prompt of each call is a chain's exact IDs plus the chat template's rendering of the new suffix
(:mod:`polar_gym.proxy.prefix`); vLLM gets it on ``/v1/completions`` as a list of token IDs with
``return_token_ids``, SGLang on its native ``/generate`` as ``input_ids``. The sampled text is turned into the
protocol's message (reasoning, text, tool calls) by the configured output parser.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx

from polar_gym.proxy.chat import ChatRequest, ChatResult, FinishReason, Usage
from polar_gym.proxy.engines.base import HttpEngine, StreamDelta, StreamPiece, StreamStart, WeightUpdateMode
from polar_gym.proxy.engines.openai import token_ids_in
from polar_gym.proxy.engines.sglang import generate_answer, sampling_params, update_sglang_weights
from polar_gym.proxy.engines.vllm import reload_vllm_weights
from polar_gym.proxy.errors import translate_upstream_errors
from polar_gym.proxy.parsers.base import OutputParser, ParsedReply, call_id
from polar_gym.proxy.prefix import PrefixRenderer, PromptPlan
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool

__all__ = ["SGLangTokenInEngine", "StreamedAnswer", "TokenInEngine", "VLLMTokenInEngine", "completions_body",
           "keep_token_in_result", "parse_reply", "plan_prompt", "token_in_result"]

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "stop", "tool_calls": "tool_calls"}


def completions_body(request: ChatRequest, prompt_ids: list[int], stop_ids: list[int]) -> dict[str, Any]:
    """vLLM's ``/v1/completions`` body: the prompt as token IDs, the request's sampling parameters, the sampled
    token IDs and their logprobs back, and a stop at the end-of-turn tokens."""
    body: dict[str, Any] = {"model": request.model, "prompt": prompt_ids, "stream": False, "return_token_ids": True,
                            "logprobs": 0, "stop_token_ids": list(stop_ids), "skip_special_tokens": False}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop"):
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    # engine arguments a caller set (e.g. structured_outputs), as the chat path passes them; never over ours
    body.update({k: v for k, v in request.extra.items() if k not in body and k != "chat_template_kwargs"})
    return body


async def plan_prompt(renderer: PrefixRenderer, request: ChatRequest, session_id: str) -> PromptPlan:
    """The call's prompt plan: inline when it extends a chain with a few messages, else rendered whole (CPU work) in
    a thread, off the event loop every session shares."""
    plan = renderer.plan_cheap(request, session_id)
    if plan is None:
        plan = await asyncio.to_thread(renderer.plan, request, session_id)
    return plan


def parse_reply(parser: OutputParser, text: str, request: ChatRequest, plan: PromptPlan) -> ParsedReply:
    """The sampled text as the protocol's message. Tool-call ids come from the prompt's length and the text: a call
    sampled again later in the conversation (a command run twice) must not repeat an id the harness holds (Claude
    Code interrupts such a tool_use), and a replay of the same prompt and sample keeps them."""
    parsed = parser.parse(text, request.tools, thinking=plan.thinking)
    if parsed.message.tool_calls:
        parsed.message.tool_calls = [c.model_copy(update={"id": call_id(f"{len(plan.prompt_ids)}:{text}", i)})
                                     for i, c in enumerate(parsed.message.tool_calls)]
    return parsed


def keep_token_in_result(renderer: PrefixRenderer, session_id: str, plan: PromptPlan, parsed: ParsedReply,
                         result: ChatResult) -> None:
    """After a token-in call: keep what it sent and sampled as a chain node later calls extend, and tell the record
    (``result.raw``) the prompt mode, how many prompt tokens were reused, why a new chain started (if it did) and
    how many tool-call blocks did not parse."""
    renderer.remember(session_id, plan, parsed.message, result.response_ids)
    result.raw["prompt_mode"] = "token_in"
    result.raw["reused_prompt_tokens"] = plan.reused
    if plan.new_chain is not None:
        result.raw["new_chain"] = plan.new_chain
    if parsed.unparseable_tool_calls:
        result.raw["unparseable_tool_calls"] = parsed.unparseable_tool_calls


def token_in_result(engine: str, parser: OutputParser, request: ChatRequest, plan: PromptPlan,
                    answer: tuple[list[int], list[int], list[float], str, str, dict[str, Any]],
                    ) -> tuple[ChatResult, ParsedReply]:
    """The result of a token-in answer (prompt IDs, sampled IDs, logprobs, text, finish reason, extra raw data), as
    :meth:`TokenInEngine.complete` builds it, and the parsed reply behind its message."""
    prompt_ids, response_ids, logprobs, text, finish, extra = answer
    if prompt_ids != plan.prompt_ids:
        raise ValueError("the engine reports other prompt token IDs than the ones sent")
    parsed = parse_reply(parser, text, request, plan)
    reason: FinishReason = _FINISH.get(finish, "stop")
    if parsed.message.tool_calls and reason == "stop":
        reason = "tool_calls"
    result = ChatResult(message=parsed.message, finish_reason=reason, prompt_ids=prompt_ids,
                        response_ids=response_ids, response_logprobs=logprobs,
                        usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(response_ids)),
                        engine=engine)
    result.raw.update(extra)
    return result, parsed


@dataclass
class StreamedAnswer:
    """A streamed answer read so far: what the chunks carried, added up (the engine's chunk reader fills it)."""

    prompt_ids: list[int] | None = None
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    #: False once a sampled token came without its logprob (the record then has none, as a non-streamed one)
    logprobs_whole: bool = True
    text: str = ""
    finish: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class TokenInEngine(HttpEngine):
    """An engine fed exact token IDs: subclasses supply the upstream body and read the answer back."""

    prompt_mode: ClassVar[str] = "token_in"
    can_stream: ClassVar[bool] = True

    def __init__(self, tokenizer: HFChatTokenizer, parser: OutputParser, pool: UpstreamPool | None = None,
                 client: httpx.AsyncClient | None = None, timeout: float = 600.0,
                 upstream_model: str | None = None, *, renderer: PrefixRenderer | None = None) -> None:
        super().__init__(pool, client, timeout, upstream_model=upstream_model)
        self.tokenizer = tokenizer
        self.parser = parser
        self.renderer = renderer if renderer is not None else PrefixRenderer(tokenizer)

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.end_of_turn_ids)

    def token_body(self, request: ChatRequest, plan: PromptPlan) -> dict[str, Any]:
        raise NotImplementedError

    def read_answer(self, body: dict[str, Any],
                    plan: PromptPlan) -> tuple[list[int], list[int], list[float], str, str, dict[str, Any]]:
        """(prompt IDs, sampled IDs, logprobs, sampled text, finish reason, extra raw data) of an answer."""
        raise NotImplementedError

    def read_chunk(self, answer: StreamedAnswer, chunk: dict[str, Any]) -> tuple[list[int], list[float]]:
        """Add one stream chunk to ``answer``; the token IDs and logprobs it added."""
        raise NotImplementedError

    def build(self, request: ChatRequest) -> dict[str, Any]:
        raise NotImplementedError("token-in engines build their body from a prompt plan")

    def parse(self, body: dict[str, Any]) -> ChatResult:
        raise NotImplementedError("token-in engines parse through read_answer")

    async def complete(self, request: ChatRequest, session_id: str) -> ChatResult:
        plan = await plan_prompt(self.renderer, request, session_id)
        parsed: list[ParsedReply] = []

        def read(data: dict[str, Any]) -> ChatResult:
            prompt_ids, response_ids, logprobs, text, finish, extra = self.read_answer(data, plan)
            if prompt_ids != plan.prompt_ids:
                raise ValueError("the engine reports other prompt token IDs than the ones sent")
            parsed.append(parse_reply(self.parser, text, request, plan))
            reason: FinishReason = _FINISH.get(finish, "stop")
            if parsed[0].message.tool_calls and reason == "stop":
                reason = "tool_calls"
            result = ChatResult(message=parsed[0].message, finish_reason=reason, prompt_ids=prompt_ids,
                                response_ids=response_ids, response_logprobs=logprobs,
                                usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(response_ids)),
                                engine=self.name)
            result.raw.update(extra)
            return result

        result = await self.exchange(session_id, self.token_body(request, plan), read)
        keep_token_in_result(self.renderer, session_id, plan, parsed[0], result)
        return result

    async def stream(self, request: ChatRequest, session_id: str) -> AsyncGenerator[StreamPiece, None]:
        """The same call as :meth:`complete`, streamed: the answer's chunks are read into a StreamedAnswer, each
        yields the tokens it added and the text the parser can already tell is plain reasoning or content; the
        last piece is the result :meth:`complete` builds from the same tokens."""
        plan = await plan_prompt(self.renderer, request, session_id)
        body = self.token_body(request, plan)
        body["stream"] = True
        if self.upstream_model is not None and "model" in body:
            body["model"] = self.upstream_model
        answer = StreamedAnswer()
        reasoning, content, started_stream, chunks = "", "", False, 0
        async with self.pool.lease(session_id) as server:
            started = time.perf_counter()
            async for chunk in self.post_stream(server.url, self.path, body, session_id):
                if not started_stream:  # the server took the call: the stream opens (its prompt is the plan's)
                    started_stream = True
                    yield StreamStart(list(plan.prompt_ids))
                if chunk is None:
                    continue
                chunks += 1
                with translate_upstream_errors(server.url):
                    ids, logprobs = self.read_chunk(answer, chunk)
                r, c = self.parser.stream_prefix(answer.text, thinking=plan.thinking)
                if ids or len(r) > len(reasoning) or len(c) > len(content):
                    yield StreamDelta(ids, logprobs, r[len(reasoning):], c[len(content):])
                    reasoning, content = max(r, reasoning, key=len), max(c, content, key=len)
            with translate_upstream_errors(server.url):
                if not chunks:
                    raise ValueError("the stream carried no chunk")
                if answer.finish is None:
                    raise ValueError("the stream ended without a finish reason")
                result, parsed = token_in_result(
                    self.name, self.parser, request, plan,
                    (answer.prompt_ids if answer.prompt_ids is not None else list(plan.prompt_ids),
                     answer.response_ids, answer.logprobs if answer.logprobs_whole else [], answer.text,
                     answer.finish, answer.extra))
            result.server = server.url
            result.policy_version = self.pool.policy_version
            result.raw["upstream_seconds"] = time.perf_counter() - started
        keep_token_in_result(self.renderer, session_id, plan, parsed, result)
        yield result

    async def count_tokens(self, request: ChatRequest, session_id: str) -> int:
        plan = await asyncio.to_thread(self.renderer.plan, request, session_id)
        return len(plan.prompt_ids)

    def close_session(self, session_id: str) -> None:
        super().close_session(session_id)
        self.renderer.forget(session_id)


class VLLMTokenInEngine(TokenInEngine):
    """vLLM's ``/v1/completions`` with the prompt as token IDs."""

    name = "vllm"
    path: ClassVar[str] = "/v1/completions"
    weight_updates: ClassVar[WeightUpdateMode | None] = "reload"

    async def update_weights(self, server_url: str, checkpoint: str, version: int | str) -> dict[str, float]:
        return await reload_vllm_weights(self, server_url, checkpoint, version)

    def token_body(self, request: ChatRequest, plan: PromptPlan) -> dict[str, Any]:
        return completions_body(request, plan.prompt_ids, self.tokenizer.end_of_turn_ids)

    def read_answer(self, body: dict[str, Any],
                    plan: PromptPlan) -> tuple[list[int], list[int], list[float], str, str, dict[str, Any]]:
        choice = body["choices"][0]
        prompt_ids = choice.get("prompt_token_ids") or body.get("prompt_token_ids")
        response_ids = choice.get("token_ids")
        if prompt_ids is None or response_ids is None:
            raise ValueError("no prompt_token_ids / token_ids in the answer (is this vLLM >= 0.10.2?)")
        values = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(values) != len(response_ids) or any(v is None for v in values):
            raise ValueError(f"engine returned {len(values)} logprobs for {len(response_ids)} sampled tokens")
        text = choice.get("text")
        if not isinstance(text, str):
            text = self.tokenizer.decode(token_ids_in(response_ids))
        return (token_ids_in(prompt_ids), token_ids_in(response_ids), [float(v) for v in values], text,
                str(choice.get("finish_reason") or "stop"), {})


    def read_chunk(self, answer: StreamedAnswer, chunk: dict[str, Any]) -> tuple[list[int], list[float]]:
        """vLLM's completion chunks carry the new tokens' IDs, logprobs and text; the first also the prompt IDs (a
        usage-only chunk, with no choices, adds nothing)."""
        if not chunk.get("choices") and "usage" in chunk:
            return [], []
        choice = chunk["choices"][0]
        if answer.prompt_ids is None:
            prompt_ids = choice.get("prompt_token_ids") or chunk.get("prompt_token_ids")
            if prompt_ids is None:
                raise ValueError("no prompt_token_ids in the first chunk (is this vLLM >= 0.10.2?)")
            answer.prompt_ids = token_ids_in(prompt_ids)
        ids = token_ids_in(choice.get("token_ids") or [])
        values = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(values) != len(ids) or any(v is None for v in values):
            raise ValueError(f"engine streamed {len(values)} logprobs for {len(ids)} sampled tokens")
        logprobs = [float(v) for v in values]
        answer.response_ids += ids
        answer.logprobs += logprobs
        answer.text += choice.get("text") or ""
        if choice.get("finish_reason"):
            answer.finish = str(choice["finish_reason"])
        return ids, logprobs


class SGLangTokenInEngine(TokenInEngine):
    """SGLang's native ``/generate`` with ``input_ids``."""

    name = "sglang"
    path: ClassVar[str] = "/generate"
    weight_updates: ClassVar[WeightUpdateMode | None] = "reload"

    async def update_weights(self, server_url: str, checkpoint: str, version: int | str) -> dict[str, float]:
        return await update_sglang_weights(self, server_url, checkpoint, version)

    def token_body(self, request: ChatRequest, plan: PromptPlan) -> dict[str, Any]:
        params = sampling_params(request)
        params["stop_token_ids"] = list(self.tokenizer.end_of_turn_ids)
        params["skip_special_tokens"] = False
        return {"input_ids": plan.prompt_ids, "sampling_params": params, "return_logprob": True, "stream": False}

    def read_answer(self, body: dict[str, Any],
                    plan: PromptPlan) -> tuple[list[int], list[int], list[float], str, str, dict[str, Any]]:
        answer = generate_answer(body, self.tokenizer.decode)
        extra: dict[str, Any] = {}
        if answer.weight_version is not None:
            extra["weight_version"] = answer.weight_version
        response_ids, logprobs, text, finish = answer.response_ids, answer.logprobs, answer.text, answer.finish
        return list(plan.prompt_ids), response_ids, logprobs, text, finish, extra

    def read_chunk(self, answer: StreamedAnswer, chunk: dict[str, Any]) -> tuple[list[int], list[float]]:
        """SGLang's ``/generate`` stream: each chunk's ``meta_info.completion_tokens`` counts every token so far,
        so the new ones are the last entries of ``output_token_logprobs`` (cumulative by default, only the new
        ones with ``--incremental-streaming-output``); ``text`` is cumulative unless it does not extend the text
        so far (then it is the new piece). A finished chunk carries ``meta_info.finish_reason``."""
        meta = chunk["meta_info"]
        triples = meta.get("output_token_logprobs")
        if triples is None:
            raise ValueError("no meta_info.output_token_logprobs in the chunk (was return_logprob set?)")
        new = int(meta.get("completion_tokens", len(answer.response_ids) + len(triples))) - len(answer.response_ids)
        if new < 0 or new > len(triples):
            raise ValueError(f"stream chunk claims {new} new tokens but lists {len(triples)}")
        fresh = triples[len(triples) - new:]
        ids = [int(t[1]) for t in fresh]
        if any(t[0] is None for t in fresh):
            answer.logprobs_whole = False
        logprobs = [float(t[0]) for t in fresh if t[0] is not None]
        answer.response_ids += ids
        answer.logprobs += logprobs
        text = chunk.get("text")
        if isinstance(text, str):
            answer.text = text if text.startswith(answer.text) else answer.text + text
        else:
            answer.text = self.tokenizer.decode(answer.response_ids)
        finish = meta.get("finish_reason")
        if finish:
            answer.finish = str(finish.get("type") or "stop") if isinstance(finish, dict) else str(finish)
        version = meta.get("weight_version")
        if version is not None:
            answer.extra["weight_version"] = version
        return ids, logprobs
