"""SGLang's OpenAI chat server (``prompt_mode: chat``).

``SGLangEngine`` uses SGLang's OpenAI chat server. With ``return_prompt_token_ids`` and ``return_meta_info`` (and
``logprobs``, which turns on ``return_logprob`` inside SGLang) every choice carries its own ``prompt_token_ids`` and
the engine's ``meta_info``, whose ``output_token_logprobs`` lists ``[logprob, token_id, text]`` per sampled token
(text is null unless SGLang decodes it; some versions clamp ``-inf`` to ``-999999999.0``). SGLang parses reasoning
and tool calls itself when started with ``--reasoning-parser`` / ``--tool-call-parser``.

New weights without a restart (:func:`update_sglang_weights`, both SGLang engines): ``/update_weights_from_disk``
with the checkpoint and a ``weight_version`` tag (later answers carry it in ``meta_info``); SGLang flushes its radix
cache itself.

The native ``/generate`` API, fed exact prompt token IDs, is the token-in engine
(:class:`polar_gym.proxy.engines.tokenin.SGLangTokenInEngine`); this module holds the readers both share.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from polar_gym.proxy.chat import ChatRequest, ChatResult
from polar_gym.proxy.engines.base import HttpEngine, WeightUpdateMode
from polar_gym.proxy.engines.openai import finish_reason_in, message_from_openai, token_ids_in, usage_in
from polar_gym.proxy.errors import WeightUpdateError

__all__ = ["GenerateAnswer", "SGLangEngine", "generate_answer", "output_tokens_in",
           "sampling_params", "update_sglang_weights"]


async def update_sglang_weights(engine: HttpEngine, server_url: str, checkpoint: str,
                                version: int | str) -> dict[str, float]:
    """Load ``checkpoint`` into the SGLang server at ``server_url`` tagged ``version``; the seconds it took."""
    started = time.perf_counter()
    answer = await engine.admin_post(server_url, "/update_weights_from_disk",
                                     {"model_path": checkpoint, "weight_version": str(version)})
    if answer.get("success") is False:
        raise WeightUpdateError(f"{server_url}/update_weights_from_disk refused {checkpoint}: "
                                f"{str(answer.get('message'))[:500]}")
    return {"reload_seconds": time.perf_counter() - started}


def output_tokens_in(meta_info: dict[str, Any]) -> tuple[list[int], list[float]]:
    """Sampled token IDs and their logprobs from ``meta_info.output_token_logprobs``. A token whose logprob SGLang
    left null makes the list empty ("no logprobs", as the record schema reads it), never a made-up 0.0."""
    triples = meta_info.get("output_token_logprobs")
    if triples is None:
        raise ValueError("no meta_info.output_token_logprobs in the answer (was logprobs / return_logprob set?)")
    ids = token_ids_in([int(t[1]) for t in triples])
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
    weight_updates: ClassVar[WeightUpdateMode | None] = "reload"

    async def update_weights(self, server_url: str, checkpoint: str, version: int | str) -> dict[str, float]:
        return await update_sglang_weights(self, server_url, checkpoint, version)

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
            prompt_ids=token_ids_in(prompt_ids),
            response_ids=response_ids,
            response_logprobs=logprobs,
            usage=usage_in(body, len(prompt_ids), len(response_ids)),
            engine=self.name,
        )
        version = _version_in(meta, body)
        if version is not None:
            result.raw["weight_version"] = version
        return result


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
