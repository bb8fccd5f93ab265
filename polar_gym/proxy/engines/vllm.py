"""vLLM's OpenAI server with ``return_token_ids``: prompt and sampled token IDs plus per-token logprobs."""

from __future__ import annotations

from typing import Any

from polar_gym.proxy.chat import ChatRequest, ChatResult
from polar_gym.proxy.engines.base import HttpEngine
from polar_gym.proxy.engines.openai import finish_reason_in, message_from_openai, usage_in

__all__ = ["VLLMEngine", "logprobs_in"]


def logprobs_in(choice: dict[str, Any], n_tokens: int) -> list[float]:
    content = (choice.get("logprobs") or {}).get("content") or []
    values = [float(item["logprob"]) for item in content]
    if len(values) != n_tokens:
        raise ValueError(f"engine returned {len(values)} logprobs for {n_tokens} sampled tokens")
    return values


def _ints(values: Any) -> list[int]:
    """Token IDs as a list of ints. JSON arrays of integers decode to exactly that, so a list whose ends are ints
    is taken as it is (a full scan costs more than the rest of the request path)."""
    if not isinstance(values, list):
        raise ValueError(f"token IDs must be a list, got {type(values).__name__}")
    if values and not (type(values[0]) is int and type(values[-1]) is int):
        return [int(v) for v in values]
    return values


class VLLMEngine(HttpEngine):
    name = "vllm"

    def build(self, request: ChatRequest) -> dict[str, Any]:
        body = request.to_openai()
        body["return_token_ids"] = True
        body["logprobs"] = True
        body["top_logprobs"] = 0
        # Special tokens are part of what was sampled; keep them out of the text only.
        body.setdefault("skip_special_tokens", True)
        return body

    def parse(self, body: dict[str, Any]) -> ChatResult:
        choice = body["choices"][0]
        prompt_ids = body.get("prompt_token_ids") or choice.get("prompt_token_ids")
        response_ids = choice.get("token_ids")
        if prompt_ids is None or response_ids is None:
            raise ValueError("no prompt_token_ids / token_ids in the answer (is this vLLM >= 0.10.2?)")
        message = message_from_openai(choice["message"])
        return ChatResult(
            message=message,
            finish_reason=finish_reason_in(choice, bool(message.tool_calls)),
            prompt_ids=_ints(prompt_ids),
            response_ids=_ints(response_ids),
            response_logprobs=logprobs_in(choice, len(response_ids)),
            usage=usage_in(body, len(prompt_ids), len(response_ids)),
            engine=self.name,
        )
