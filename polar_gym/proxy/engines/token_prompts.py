"""Token prompts: the bodies a token-in call sends (vLLM's ``/v1/completions``, SGLang's ``/generate``) and the
start-up probe built from them.

An upstream that serves only chat would refuse every token-in call (each a 502 to the harness), so processes find out
at start-up with one one-token call built like the real ones: ``TokenInEngine.probe_token_prompt``
(:mod:`polar_gym.proxy.engines.tokenin`) where a tokenizer is loaded, :func:`token_probe` in the launch's check
without one. A refusal says to use ``prompt_mode chat``.
"""

from __future__ import annotations

from typing import Any

import orjson

from polar_gym.proxy.chat import ChatRequest
from polar_gym.proxy.engines.sglang import sampling_params

__all__ = ["COMPLETIONS_ROUTE", "GENERATE_ROUTE", "PROBE_PROMPT_IDS", "TOKEN_PROMPT_HINT", "completions_body",
           "generate_body", "served_model", "token_probe", "token_probe_answer", "token_probe_message"]

#: where a token prompt goes: vLLM's completions route, SGLang's native route
COMPLETIONS_ROUTE = "/v1/completions"
GENERATE_ROUTE = "/generate"


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


def generate_body(request: ChatRequest, prompt_ids: list[int], stop_ids: list[int]) -> dict[str, Any]:
    """SGLang's ``/generate`` body: the prompt as ``input_ids``, the request's sampling parameters, logprobs back,
    and a stop at the end-of-turn tokens."""
    params = sampling_params(request)
    params["stop_token_ids"] = list(stop_ids)
    params["skip_special_tokens"] = False
    return {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True, "stream": False}


#: the start-up probe's prompt where no tokenizer is loaded (the launch's check): IDs every vocabulary holds
PROBE_PROMPT_IDS = (0, 1, 2, 3)
#: what a probe that an upstream refused ends with
TOKEN_PROMPT_HINT = ("this upstream does not take token prompts: use prompt_mode chat (--prompt-mode chat / "
                     "inference.prompt_mode=chat)")


def token_probe(engine: str, prompt_ids: list[int], model: str | None,
                stop_ids: list[int] | None = None) -> tuple[str, dict[str, Any]]:
    """The route and body of one minimal token prompt (``prompt_ids``, one new token) to a token-in upstream of
    ``engine`` (vllm: ``/v1/completions``; sglang, sglang_generate: ``/generate``), built by the body builder real
    calls use, so an upstream that takes it takes them. ``model``: the name sent (vLLM refuses one it does not
    serve; None: left out, the server's own)."""
    request = ChatRequest(model=model or "", messages=[], max_tokens=1, temperature=0.0)
    if engine == "vllm":
        body = completions_body(request, list(prompt_ids), list(stop_ids or []))
        if model is None:
            del body["model"]
        return COMPLETIONS_ROUTE, body
    return GENERATE_ROUTE, generate_body(request, list(prompt_ids), list(stop_ids or []))


def served_model(models: bytes) -> str | None:
    """The first model id of a ``GET /v1/models`` answer (None: none, or not a model list)."""
    try:
        data = orjson.loads(models)
    except orjson.JSONDecodeError:
        return None
    cards = data.get("data") if isinstance(data, dict) else None
    if not isinstance(cards, list):
        return None
    ids = [c["id"] for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)]
    return ids[0] if ids else None


def token_probe_answer(status: int, content: bytes) -> str | None:
    """None when an answer to :func:`token_probe` shows the prompt was taken (2xx, a JSON object), else what the
    upstream answered in words (the status and a short excerpt)."""
    excerpt = " ".join(content[:200].decode(errors="replace").split())
    if 200 <= status < 300:
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError:
            data = None
        if isinstance(data, dict):
            return None
        return f"HTTP {status} but not a JSON object ({excerpt!r})"
    return f"HTTP {status}" + (f": {excerpt}" if excerpt else "")


def token_probe_message(url: str, route: str, answer: str) -> str:
    """The message of an upstream that refused the token probe: which one, where, what it answered, what to do."""
    return f"upstream {url} refused a token prompt (POST {url}{route} answered {answer}); {TOKEN_PROMPT_HINT}"
