"""What a trainer computes for a multimodal prompt, with transformers from the model's folder: the chat template's
text tokenized, each image's one ``<|image_pad|>`` expanded by the model's image processor to one per merged patch
of that image's grid. The multimodal tests compare what vLLM and the proxy captured with it."""

from __future__ import annotations

import base64
import functools
import io
from pathlib import Path
from typing import Any

from polar_gym.merge.base import image_urls_of
from polar_gym.proxy.images import placeholder_runs
from polar_gym.tiny_vlm import IMAGE_PAD_ID

__all__ = ["pad_runs", "png_url", "processor_view"]


def png_url(size: tuple[int, int], colour: tuple[int, int, int]) -> str:
    """A plain PNG of ``size`` pixels in one colour, as a data URL."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@functools.cache
def _processors(model_dir: Path) -> tuple[Any, Any]:
    """The model's tokenizer and image processor, loaded once (about 3 s each)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return AutoTokenizer.from_pretrained(str(model_dir)), Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))


def processor_view(model_dir: Path, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
    """(the prompt with one placeholder per image, the same expanded by the image processor's grids) of OpenAI-shaped
    chat ``messages``, as a trainer computes them."""
    from PIL import Image

    tokenizer, processor = _processors(model_dir)
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    unexpanded = tokenizer(text)["input_ids"]
    urls = image_urls_of(messages)
    if not urls:
        return unexpanded, unexpanded
    images = [Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) for url in urls]
    grids = processor(images=images)["image_grid_thw"].tolist()
    counts = iter(t * h * w // processor.merge_size ** 2 for t, h, w in grids)
    expanded = [i for token in unexpanded for i in ([token] * next(counts) if token == IMAGE_PAD_ID else [token])]
    return unexpanded, expanded


def pad_runs(ids: list[int]) -> list[tuple[int, int]]:
    """(offset, length) of each run of image placeholders."""
    return [(start, end - start) for start, end in placeholder_runs(ids, IMAGE_PAD_ID)]
