"""Recompute the logprob of chosen tokens of one sequence with a transformers causal LM, computing the output layer
only at the rows that predict them.

The output layer is what costs: Qwen's is 151,936 wide, so logits for every position of a 2k-token trace are
~1.2 GB in fp32 and most of the compute (issue 14 measured a GRPO step at ~35 s on 2 cores, ~2-3 s once the head
ran only at response positions). Here the decoder body runs over the sequence in chunks of ``chunk_tokens`` with a
KV cache (memory stays bounded for long traces: attention scores are chunk x seen, not length x length), its last
hidden state is kept only at the rows that predict a wanted token, and the head runs over those rows
``head_rows`` at a time. Logits are upcast to fp32 before the softmax, as trainers do.

The logprob is of the raw model distribution (no temperature, no top-p): what vLLM reports by default
(``logprobs_mode=raw_logprobs``) and what SGLang's ``return_logprob`` reports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polar_gym.audit.inputs import AuditTrace

__all__ = ["DTYPES", "ModelRecompute", "head_logprobs", "image_pixels", "load_image_processor", "load_model",
           "token_logprobs", "vision_token_logprobs"]

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu") -> Any:
    """A causal LM from a local directory (never the hub), in eval mode, on ``device``; a vision-language model (a
    config with a ``vision_config``) as the image-text-to-text model it is."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    # the audit prints its own report; no bars in logs (transformers leaves this function unannotated)
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    vision = hasattr(AutoConfig.from_pretrained(str(path), local_files_only=True), "vision_config")
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model: Any = auto.from_pretrained(str(path), dtype=getattr(torch, dtype), local_files_only=True)
    return model.to(device).eval()


def load_image_processor(path: str | Path) -> Any:
    """The image processor of a vision-language model's directory, on vLLM's backend (torchvision) when it is
    installed. The PIL backend (this project's venv has no torchvision) gives the same grids, so the same token IDs,
    but pixels up to one 8-bit level apart on a downscaled photo and several on an upscaled one
    (``benchmarks/bench_image_processors.py``): logprobs recomputed from them differ a little from the engine's."""
    import importlib.util

    from transformers import AutoImageProcessor

    backend = "torchvision" if importlib.util.find_spec("torchvision") is not None else "pil"
    if backend == "pil":
        log.warning("torchvision is not installed: images go through the PIL image processor, whose resampling "
                    "differs slightly from the engine's (vLLM uses torchvision's)")
    return AutoImageProcessor.from_pretrained(  # type: ignore[no-untyped-call]
        str(path), local_files_only=True, backend=backend)


def image_pixels(processor: Any, image_urls: Sequence[str]) -> dict[str, Any]:
    """What a vision-language model's forward pass takes for ``image_urls`` (base64 data URLs, in the order of
    their placeholders): the image processor's tensors (Qwen2-VL: ``pixel_values``, ``image_grid_thw``)."""
    import base64
    import io

    from PIL import Image

    images = [Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB") for url in image_urls]
    return dict(processor(images=images, return_tensors="pt"))


def vision_token_logprobs(model: Any, processor: Any, input_ids: Sequence[int], image_urls: Sequence[str],
                          positions: Sequence[int], *, head_rows: int = 256, fp32_head: bool = False) -> list[float]:
    """:func:`token_logprobs` for a prompt with images: the images (data URLs, in order) through the model's image
    processor and vision tower, their features in place of the placeholders of ``input_ids`` (one pass, no chunks:
    the multimodal rotary positions are computed over the whole sequence)."""
    import torch

    if not positions:
        return []
    if min(positions) < 1 or max(positions) >= len(input_ids):
        raise ValueError(f"positions must lie in [1, {len(input_ids) - 1}]")
    pixels = image_pixels(processor, image_urls)
    ids = torch.tensor([list(input_ids)], dtype=torch.long, device=next(model.parameters()).device)
    rows = sorted({t - 1 for t in positions})
    # which tokens are an image's (1) for the multimodal rotary positions: each run of them takes the next grid
    image_tokens = (ids == model.config.image_token_id).to(torch.int)
    with torch.inference_mode():
        out = model.model(input_ids=ids, pixel_values=pixels["pixel_values"].to(model.dtype),
                          image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=image_tokens)
        hidden = out.last_hidden_state[0, rows]
        values = head_logprobs(model, hidden, ids[0, [r + 1 for r in rows]], head_rows, fp32_head=fp32_head).tolist()
    by_row = dict(zip(rows, values, strict=True))
    return [float(by_row[t - 1]) for t in positions]


def head_logprobs(model: Any, hidden: Any, targets: Any, head_rows: int, *, fp32_head: bool = False) -> Any:
    """log p(target_i) from hidden rows ``hidden[i]``, the head applied ``head_rows`` rows at a time (with the
    model's final logit softcapping, if it has one). The trainer computes its logprobs through this too, so an
    audit and a training step score a token the same way; gradients flow when the caller allows them.
    ``fp32_head``: the output layer computes in fp32 (hidden states and head weights upcast) whatever the model's
    dtype, the "fp32 LM head" of Slime and others: a bf16 model's logits then lose no precision at the very layer
    whose rounding moves a token's logprob most (``trainer.lm_head_fp32``, the audit's ``--lm-head-fp32``)."""
    import torch

    head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    bias = getattr(head, "bias", None)
    out = []
    for start in range(0, hidden.shape[0], head_rows):
        if fp32_head:
            logits = torch.nn.functional.linear(hidden[start:start + head_rows].float(), head.weight.float(),
                                                None if bias is None else bias.float())
        else:
            logits = head(hidden[start:start + head_rows]).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        logprobs = torch.log_softmax(logits, dim=-1)
        out.append(logprobs.gather(-1, targets[start:start + head_rows].unsqueeze(-1)).squeeze(-1))
    return torch.cat(out) if out else torch.empty(0)


def token_logprobs(model: Any, input_ids: Sequence[int], positions: Sequence[int], *, chunk_tokens: int = 4096,
                   head_rows: int = 256, fp32_head: bool = False) -> list[float]:
    """``log p(input_ids[t] | input_ids[:t])`` for each ``t`` in ``positions`` (in that order; 1 <= t < len)."""
    import torch
    from transformers import DynamicCache

    if not positions:
        return []
    if min(positions) < 1 or max(positions) >= len(input_ids):
        raise ValueError(f"positions must lie in [1, {len(input_ids) - 1}]")
    if chunk_tokens < 1 or head_rows < 1:
        raise ValueError("chunk_tokens and head_rows must be positive")
    device = next(model.parameters()).device
    ids = torch.tensor([list(input_ids)], dtype=torch.long, device=device)
    rows = sorted({t - 1 for t in positions})  # the hidden row that predicts token t is t - 1
    body = model.get_decoder()
    upto = rows[-1] + 1  # nothing after the last wanted row is needed
    kept = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config) if upto > chunk_tokens else None
        for start in range(0, upto, chunk_tokens):
            end = min(start + chunk_tokens, upto)
            out = body(input_ids=ids[:, start:end], past_key_values=cache, use_cache=cache is not None)
            local = [r - start for r in rows if start <= r < end]
            if local:
                kept.append(out.last_hidden_state[0, local])
        hidden = torch.cat(kept)
        targets = ids[0, [r + 1 for r in rows]]
        values = head_logprobs(model, hidden, targets, head_rows, fp32_head=fp32_head).tolist()
    by_row = dict(zip(rows, values, strict=True))
    return [float(by_row[t - 1]) for t in positions]


class ModelRecompute:
    """A :data:`polar_gym.audit.core.Recompute` over model directories: loads one model at a time (the audit asks
    for all of one directory's tokens before the next) and drops it when another is asked for."""

    def __init__(self, dtype: str = "float32", device: str = "cpu", chunk_tokens: int = 4096,
                 head_rows: int = 256, fp32_head: bool = False) -> None:
        self.dtype, self.device, self.chunk_tokens, self.head_rows = dtype, device, chunk_tokens, head_rows
        self.fp32_head = fp32_head
        self._path: str | None = None
        self._model: Any = None
        self._processors: dict[str, Any] = {}
        self.load_seconds: dict[str, float] = {}

    def model(self, path: str) -> Any:
        if path != self._path:
            self._model = None  # free the previous weights before loading the next
            started = time.monotonic()
            self._model = load_model(path, self.dtype, self.device)
            self._path = path
            self.load_seconds[path] = round(time.monotonic() - started, 3)
        return self._model

    def image_processor(self, path: str) -> Any:
        if path not in self._processors:
            self._processors[path] = load_image_processor(path)
        return self._processors[path]

    def __call__(self, path: str, trace: AuditTrace, positions: list[int]) -> list[float]:
        prompt = len(trace.prompt_ids)
        if trace.images:
            return vision_token_logprobs(self.model(path), self.image_processor(path),
                                         [*trace.prompt_ids, *trace.response_ids], trace.image_urls,
                                         [prompt + i for i in positions], head_rows=self.head_rows,
                                         fp32_head=self.fp32_head)
        return token_logprobs(self.model(path), [*trace.prompt_ids, *trace.response_ids],
                              [prompt + i for i in positions], chunk_tokens=self.chunk_tokens,
                              head_rows=self.head_rows, fp32_head=self.fp32_head)
