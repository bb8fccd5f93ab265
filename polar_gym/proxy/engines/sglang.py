"""SGLang's OpenAI server with ``return_prompt_token_ids`` and ``return_meta_info``: prompt IDs on the choice,
sampled IDs and logprobs in ``meta_info.output_token_logprobs`` as ``[logprob, token_id, text]`` triples."""

from __future__ import annotations

from typing import Any

from polar_gym.proxy.chat import ChatRequest, ChatResult
from polar_gym.proxy.engines.base import HttpEngine
from polar_gym.proxy.engines.openai import finish_reason_in, message_from_openai, usage_in

__all__ = ["SGLangEngine", "output_tokens_in"]


def output_tokens_in(meta_info: dict[str, Any]) -> tuple[list[int], list[float]]:
    triples = meta_info.get("output_token_logprobs")
    if triples is None:
        raise ValueError("no meta_info.output_token_logprobs in the answer")
    ids = [int(t[1]) for t in triples]
    logprobs = [float(t[0]) if t[0] is not None else 0.0 for t in triples]
    return ids, logprobs


class SGLangEngine(HttpEngine):
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
        prompt_ids = choice.get("prompt_token_ids") or body.get("prompt_token_ids")
        meta = choice.get("meta_info") or body.get("meta_info")
        if prompt_ids is None or meta is None:
            raise ValueError("no prompt_token_ids / meta_info in the answer (start SGLang with a version that "
                             "supports return_prompt_token_ids and return_meta_info)")
        response_ids, logprobs = output_tokens_in(meta)
        message = message_from_openai(choice["message"])
        return ChatResult(
            message=message,
            finish_reason=finish_reason_in(choice, bool(message.tool_calls)),
            prompt_ids=[int(t) for t in prompt_ids],
            response_ids=response_ids,
            response_logprobs=logprobs,
            usage=usage_in(body, len(prompt_ids), len(response_ids)),
            engine=self.name,
        )
