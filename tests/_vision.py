"""What a trainer computes for a multimodal prompt, with transformers from the model's folder: the chat template's
text tokenized, each image's one ``<|image_pad|>`` expanded by the model's image processor to one per merged patch
of that image's grid. The multimodal tests compare what vLLM and the proxy captured with it."""

from __future__ import annotations

import base64
import functools
import hashlib
import io
from pathlib import Path
from typing import Any

from polar_gym.merge import MergeConfig
from polar_gym.merge.prefix_merging import prefix_merging
from polar_gym.proxy.images import placeholder_runs
from polar_gym.schema import CompletionRecord, CompletionSession, EvalResult, SessionResult, SessionStatus
from polar_gym.schema.images import image_urls_of
from polar_gym.tiny_vlm import EOS_TOKEN_ID, IMAGE_PAD_ID

__all__ = ["image_session", "pad_runs", "png_url", "processor_view"]


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


#: what the tiny VLM's image processor makes of a 56 x 56 image: a 1 x 4 x 4 grid, 4 placeholders after merging
SMALL_IMAGE_PADS = 4
_START, _END = 151652, 151653


def image_session(session_id: str = "s") -> tuple[SessionResult, list[CompletionRecord]]:
    """A completed two-call session of the shape the proxy captures, and its records: a red card in the first
    call's prompt, a blue one added in the second's (each 56 x 56, so 4 placeholders), prefix-merged into one trace
    with both images."""
    red, blue = png_url((56, 56), (200, 30, 30)), png_url((56, 56), (30, 30, 200))
    pads = [IMAGE_PAD_ID] * SMALL_IMAGE_PADS

    def user(text: str, url: str) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "text", "text": text},
                                            {"type": "image_url", "image_url": {"url": url}}]}

    def ref(url: str, start: int) -> dict[str, Any]:
        data = base64.b64decode(url.split(",", 1)[1])
        return {"sha256": hashlib.sha256(data).hexdigest(), "media_type": "image/png", "size": len(data),
                "prompt_span": {"start": start, "end": start + SMALL_IMAGE_PADS}}

    first_prompt = [1, _START, *pads, _END, 2]
    first_reply = [10, 11, EOS_TOKEN_ID]
    second_prompt = [*first_prompt, *first_reply, 3, _START, *pads, _END, 4]
    reply = {"role": "assistant", "content": "red"}
    records = [
        CompletionRecord(completion_id=f"{session_id}-c0", session_id=session_id, index=0, provider="openai_chat",
                         engine="vllm", normalized_request={"messages": [user("what is this?", red)]},
                         response={"message": reply}, prompt_ids=first_prompt, response_ids=first_reply,
                         response_logprobs=[-0.1] * 3, images=[ref(red, 2)]),
        CompletionRecord(completion_id=f"{session_id}-c1", session_id=session_id, index=1, provider="openai_chat",
                         engine="vllm", normalized_request={"messages": [user("what is this?", red), reply,
                                                                         user("and this?", blue)]},
                         response={"message": {"role": "assistant", "content": "blue"}}, prompt_ids=second_prompt,
                         response_ids=[12, EOS_TOKEN_ID], response_logprobs=[-0.2] * 2,
                         images=[ref(red, 2), ref(blue, len(first_prompt) + len(first_reply) + 2)]),
    ]
    trajectory = prefix_merging(CompletionSession(session_id=session_id, completions=records),
                                MergeConfig(end_of_turn_ids=(EOS_TOKEN_ID,)))
    result = SessionResult(session_id=session_id, task_id="t", status=SessionStatus.COMPLETED,
                           trajectory=trajectory, evaluation=EvalResult(reward=1.0, passed=True),
                           metadata={"sample_index": 0})
    return result, records
