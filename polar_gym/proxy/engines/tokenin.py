"""Token-in engines: the proxy sends the engine exact prompt token IDs (``prompt_mode: token_in``).

The prompt of each call is a chain's exact IDs plus the chat template's rendering of the new suffix
(:mod:`polar_gym.proxy.prefix`); vLLM gets it on ``/v1/completions`` as a list of token IDs with
``return_token_ids``, SGLang on its native ``/generate`` as ``input_ids``. The sampled text is turned into the
protocol's message (reasoning, text, tool calls) by the configured output parser.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import httpx

from polar_gym.proxy.chat import ChatRequest, ChatResult, FinishReason, Usage
from polar_gym.proxy.engines.base import HttpEngine, WeightUpdateMode
from polar_gym.proxy.engines.sglang import generate_answer, sampling_params, update_sglang_weights
from polar_gym.proxy.engines.vllm import _ints, reload_vllm_weights
from polar_gym.proxy.parsers.base import OutputParser, ParsedReply, call_id
from polar_gym.proxy.prefix import PrefixRenderer, PromptPlan
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool

__all__ = ["SGLangTokenInEngine", "TokenInEngine", "VLLMTokenInEngine", "completions_body", "keep_token_in_result",
           "parse_reply", "plan_prompt"]

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


class TokenInEngine(HttpEngine):
    """An engine fed exact token IDs: subclasses supply the upstream body and read the answer back."""

    prompt_mode: ClassVar[str] = "token_in"

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

    async def count_tokens(self, request: ChatRequest, session_id: str) -> int:
        plan = await asyncio.to_thread(self.renderer.plan, request, session_id)
        return len(plan.prompt_ids)

    def close_session(self, session_id: str) -> None:
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
            text = self.tokenizer.decode(_ints(response_ids))
        return (_ints(prompt_ids), _ints(response_ids), [float(v) for v in values], text,
                str(choice.get("finish_reason") or "stop"), {})


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
