"""Issue 42, the engine under the multimodal path: vLLM's CPU build serves the tiny Qwen2-VL (polar_gym/tiny_vlm.py,
with torchvision beside it through polar_gym/vllm_vision), and the prompt ids it samples from are exactly what the
model's own chat template and image processor make: the rendered prompt tokenized, each image's one
``<|image_pad|>`` expanded to one per 2x2 merged patch of that image's grid. Through the chat route (the official
OpenAI SDK) and through the token-in route (``/inference/v1/generate`` with the images as content parts), which is
how the proxy sends a prompt it rendered itself."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests._vision import pad_runs, png_url, processor_view
from tests._vllm import VLLMServer

pytestmark = pytest.mark.engine

SIZES = ((96, 64), (200, 60))  # 4x6 and 4x14 patches once resized to multiples of 28 pixels: 6 and 14 placeholders


def _messages(urls: list[str]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "Describe images."},
            {"role": "user", "content": [{"type": "text", "text": "Compare "},
                                         {"type": "image_url", "image_url": {"url": urls[0]}},
                                         {"type": "text", "text": " and "},
                                         {"type": "image_url", "image_url": {"url": urls[1]}}]}]


def test_the_chat_route_expands_each_image_as_the_models_processor_does(vllm_vlm_server: VLLMServer) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{vllm_vlm_server.url}/v1", api_key="none")
    seen = {}
    for order in ((0, 1), (1, 0)):
        urls = [png_url(SIZES[i], (200, 30 + 100 * i, 30)) for i in order]
        messages = _messages(urls)
        reply = client.chat.completions.create(model=vllm_vlm_server.model, messages=messages,  # type: ignore[arg-type]
                                               max_tokens=4, temperature=0, logprobs=True,
                                               extra_body={"return_token_ids": True})
        body = reply.model_dump()
        prompt_ids = body.get("prompt_token_ids") or body["choices"][0]["prompt_token_ids"]
        _, expected = processor_view(vllm_vlm_server.model_dir, messages)
        assert prompt_ids == expected
        seen[order] = [length for _, length in pad_runs(prompt_ids)]
        assert len(body["choices"][0]["token_ids"]) == len(body["choices"][0]["logprobs"]["content"]) > 0
    assert seen == {(0, 1): [6, 14], (1, 0): [14, 6]}  # each image its own grid, in its own place


def test_the_token_in_route_takes_one_placeholder_per_image_and_the_images_as_parts(
        vllm_vlm_server: VLLMServer) -> None:
    urls = [png_url(size, (30, 30, 200)) for size in SIZES]
    unexpanded, expanded = processor_view(vllm_vlm_server.model_dir, _messages(urls))
    reply = httpx.post(f"{vllm_vlm_server.url}/inference/v1/generate", timeout=120, json={
        "model": vllm_vlm_server.model, "token_ids": unexpanded, "return_token_ids": True,
        "content_parts": [{"type": "image_url", "url": url} for url in urls],
        "sampling_params": {"max_tokens": 4, "temperature": 0, "logprobs": 0}})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["prompt_token_ids"] == expanded
    placeholders = [(p["offset"], p["length"]) for p in body["mm_placeholders"]["image"]]
    assert placeholders == pad_runs(expanded) and [n for _, n in placeholders] == [6, 14]
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) > 0
