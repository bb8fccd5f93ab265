"""Token-in prompts with images, on vLLM: exact prefixes across turns that carry pictures.

The chat template renders each image as one placeholder (``<|image_pad|>`` for the Qwen2-VL family); the model's
processor repeats it once per merged patch, a number it reads from the image's size. A chain keeps the expanded IDs
the engine saw, as it keeps every sampled token. A call's plan is the chain's IDs plus the new messages rendered,
each new image's placeholder expanded here by transformers' own resize rule (:class:`ImageGrid`).

vLLM expands images itself, and only in a prompt whose placeholders are not expanded yet. So a call with images goes
to its token-in route ``/inference/v1/generate`` (served with ``--enable-scale-out``) with every run of placeholders
collapsed to one and the images as content parts, in order. vLLM answers with the prompt IDs it expanded, and the
token-in engine's check that they are the ones planned compares its expansion with ours. A call without images
takes the completions route, as on any vLLM.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from polar_gym.proxy.chat import ChatRequest
from polar_gym.proxy.engines.openai import token_ids_in
from polar_gym.proxy.engines.tokenin import (
    StreamedAnswer,
    VLLMTokenInEngine,
    plan_prompt,
    spend_budgets,
    take_choice,
)
from polar_gym.proxy.errors import RequestError
from polar_gym.proxy.images import (
    ImageGrid,
    collapse_placeholders,
    expand_placeholders,
    has_images,
    image_size,
    image_urls,
)
from polar_gym.proxy.prefix import PromptPlan
from polar_gym.proxy.tokenizer import image_token_id_in

__all__ = ["VISION_ROUTE", "VLLMVisionTokenInEngine", "image_grid_in"]

#: vLLM's token-in route, which takes images as content parts beside the token IDs
VISION_ROUTE = "/inference/v1/generate"


def image_grid_in(directory: str | Path) -> ImageGrid | None:
    """The image grid of the model whose tokenizer is in ``directory`` (its ``preprocessor_config.json``); None
    when it has none (a text model)."""
    try:
        config = json.loads((Path(directory) / "preprocessor_config.json").read_text())
    except (OSError, ValueError):
        return None
    return ImageGrid.from_config(config) if isinstance(config, dict) else None


class VLLMVisionTokenInEngine(VLLMTokenInEngine):
    """:class:`VLLMTokenInEngine` for a vision-language model: calls with images keep exact prefixes too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        token_id = image_token_id_in(self.tokenizer.path)
        grid = image_grid_in(self.tokenizer.path)
        if token_id is None or grid is None:
            raise ValueError(f"{self.tokenizer.path} is not a vision-language model's (no image token or processor "
                             "config)")
        self.image_token_id = self.image_token = token_id
        self.grid = grid
        self.renderer.keep_images = True

    async def plan(self, request: ChatRequest, session_id: str) -> PromptPlan:
        """The plan, the placeholders of the images it renders anew expanded (those of the chain it extends are
        expanded already: they are the IDs the engine saw)."""
        plan = await plan_prompt(self.renderer, request, session_id)
        new = plan.prompt_ids[plan.reused:]
        fresh = new.count(self.image_token)
        if not fresh:
            return plan
        urls = image_urls(request)
        if fresh > len(urls):
            raise RequestError(f"the prompt renders {fresh} image placeholders for {len(urls)} images (the text "
                               f"holds the image token itself?)")
        try:
            counts = [self.grid.placeholders(*image_size(url)) for url in urls[len(urls) - fresh:]]
            expanded = expand_placeholders(new, self.image_token, counts)
        except Exception as exc:  # a header that does not read (or claims a decompression bomb): the caller's error
            raise RequestError(f"an image cannot be placed in the prompt: {exc.__class__.__name__}: {exc}") from exc
        return replace(plan, prompt_ids=[*plan.prompt_ids[:plan.reused], *expanded])

    def token_body(self, request: ChatRequest, plan: PromptPlan) -> dict[str, Any]:
        if not has_images(request):
            return super().token_body(request, plan)
        params: dict[str, Any] = {"stop_token_ids": list(self.tokenizer.end_of_turn_ids), "logprobs": 0,
                                  "skip_special_tokens": False, "detokenize": True}
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop"):
            value = getattr(request, name)
            if value is not None:
                params[name] = value
        return {"model": request.model, "token_ids": collapse_placeholders(plan.prompt_ids, self.image_token),
                "content_parts": [{"type": "image_url", "url": url} for url in image_urls(request)],
                "sampling_params": params, "return_token_ids": True, "output_mode": "text", "stream": False}

    def route_of(self, body: dict[str, Any]) -> str:
        return VISION_ROUTE if "token_ids" in body else self.path

    def continuation_body(self, body: dict[str, Any], prompt_ids: list[int], sampled: int) -> dict[str, Any] | None:
        if "token_ids" not in body:
            return super().continuation_body(body, prompt_ids, sampled)
        params = dict(body["sampling_params"])
        if not spend_budgets(params, ("max_tokens", "min_tokens"), sampled):
            return None
        return {**body, "token_ids": collapse_placeholders(prompt_ids, self.image_token), "sampling_params": params}

    def read_answer(self, body: dict[str, Any],
                    plan: PromptPlan) -> tuple[list[int], list[int], list[float], str, str, dict[str, Any]]:
        if body.get("output_mode") is None:
            return super().read_answer(body, plan)
        answer = StreamedAnswer()
        self.read_chunk(answer, body)
        assert answer.prompt_ids is not None  # read_chunk raises without them
        return answer.prompt_ids, answer.response_ids, answer.logprobs, answer.text, answer.finish or "stop", {}

    def read_chunk(self, answer: StreamedAnswer, chunk: dict[str, Any]) -> tuple[list[int], list[float]]:
        """A chunk of the token-in route (``output_mode`` text): the new tokens' IDs, their logprobs and text; the
        first also the expanded prompt's IDs."""
        if chunk.get("output_mode") is None:
            return super().read_chunk(answer, chunk)
        if answer.prompt_ids is None:
            if chunk.get("prompt_token_ids") is None:
                raise ValueError("no prompt_token_ids in the answer's first chunk (return_token_ids)")
            answer.prompt_ids = token_ids_in(chunk["prompt_token_ids"])
        if not chunk.get("choices"):
            return [], []
        choice = chunk["choices"][0]
        return take_choice(answer, choice, [item.get("logprob") if isinstance(item, dict) else None
                                            for item in (choice.get("logprobs") or {}).get("content") or []])
