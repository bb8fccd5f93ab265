"""A tiny randomly initialised Qwen2-VL for the multimodal engine tier: the real architecture, vocabulary and image
processor, no download.

    python -m polar_gym.tiny_vlm OUT_DIR TOKENIZER_DIR

Like :mod:`polar_gym.tiny_model`, the weights are random but seeded. What the tests need from it is what a real
Qwen2-VL does with an image: its processor resizes it to a multiple of 28 pixels, cuts it into 14-pixel patches and
merges 2x2 of them, and the prompt holds one ``<|image_pad|>`` per merged patch, which vLLM fills with the vision
tower's output. 19.8 M parameters (79 MB in float32), of which the vision tower is 0.1 M.

The tokenizer is the project's Qwen3 one. Its vocabulary has the Qwen2.5 vision ids (151652-151656) but names them
``[PADn]``, both as added tokens and in the BPE vocabulary: both are renamed, or the processor would add
``<|image_pad|>`` as a new id past the embedding table. Its chat template gets a ``render_content`` macro, so a
message's content may be a list of parts, an image part rendered as ``<|vision_start|><|image_pad|><|vision_end|>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["IMAGE_PAD_ID", "PROCESSOR_CONFIG", "VISION_TOKENS", "build_tiny_vlm", "multimodal_template",
           "name_vision_tokens"]

SEED = 1234
BOS_TOKEN_ID = 151643
EOS_TOKEN_ID = 151645
IMAGE_PAD_ID = 151655
VISION_TOKENS: dict[int, str] = {151652: "<|vision_start|>", 151653: "<|vision_end|>", 151654: "<|vision_pad|>",
                                 IMAGE_PAD_ID: "<|image_pad|>", 151656: "<|video_pad|>"}
TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 65536,
    # multimodal rotary positions: the 16 frequency pairs of a 32-wide head split over time, height and width
    "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1000000.0},
    "rms_norm_eps": 1e-6, "bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "tie_word_embeddings": True,
}
VISION_CONFIG: dict[str, Any] = {"depth": 1, "embed_dim": 32, "hidden_size": 128, "num_heads": 2, "mlp_ratio": 2,
                                 "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
#: Qwen2-VL's image processor, bounded small: an image becomes 4 to 64 placeholders (56x56 to 224x224 pixels)
PROCESSOR_CONFIG: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
    "min_pixels": 56 * 56, "max_pixels": 224 * 224, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
    "resample": 3,
}

_RENDER_CONTENT = """{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- elif part.type == 'image' or part.type == 'image_url' -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
"""
#: (what the Qwen3 template says, what the multimodal one says instead); each must occur in it exactly as often as
#: given, so a changed upstream template fails the build instead of rendering images as nothing
_TEMPLATE_EDITS: tuple[tuple[str, str, int], ...] = (
    ("messages[0].content", "render_content(messages[0].content)", 2),
    ("not(message.content.startswith('<tool_response>')",
     "not(message.content is string and message.content.startswith('<tool_response>')", 1),
    ("'\\n' + message.content + '<|im_end|>'", "'\\n' + render_content(message.content) + '<|im_end|>'", 1),
    ("{%- set content = message.content %}",
     "{%- set rendered = render_content(message.content) %}\n        {%- set content = rendered %}", 1),
    ("'</think>' in message.content", "'</think>' in rendered", 1),
    ("message.content.split('</think>')", "rendered.split('</think>')", 2),
    ("{{- message.content }}", "{{- render_content(message.content) }}", 1),
)


def multimodal_template(template: str) -> str:
    """The Qwen3 chat template with list contents and image parts (pure)."""
    for old, new, count in _TEMPLATE_EDITS:
        found = template.count(old)
        if found != count:
            raise ValueError(f"the chat template has {found} of {old!r}, expected {count}: it changed upstream")
        template = template.replace(old, new)
    return _RENDER_CONTENT + template


def name_vision_tokens(tokenizer: dict[str, Any]) -> dict[str, Any]:
    """``tokenizer.json`` with the vision ids named as Qwen2-VL names them, as special added tokens and in the BPE
    vocabulary (pure: returns a new dict)."""
    out: dict[str, Any] = json.loads(json.dumps(tokenizer))
    added = {entry["id"]: entry for entry in out["added_tokens"]}
    vocab: dict[str, int] = out["model"]["vocab"]
    by_id = {token_id: name for name, token_id in vocab.items() if token_id in VISION_TOKENS}
    for token_id, name in VISION_TOKENS.items():
        if token_id not in added:
            raise ValueError(f"the tokenizer has no added token {token_id} to name {name}")
        added[token_id].update(content=name, special=True)
        if token_id in by_id:
            del vocab[by_id[token_id]]
        vocab[name] = token_id
    return out


def build_tiny_vlm(out_dir: Path, tokenizer_dir: Path) -> Path:
    """Write the model, its tokenizer, chat template and image processor config to ``out_dir`` atomically (staging +
    rename, ``.complete`` marker)."""
    import torch
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from polar_gym.tiny_model import fresh_staging, publish

    out_dir = Path(out_dir)
    if (out_dir / ".complete").exists():
        return out_dir
    staging = fresh_staging(out_dir)
    torch.manual_seed(SEED)
    config = Qwen2VLConfig(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG, tie_word_embeddings=True,
                           image_token_id=IMAGE_PAD_ID, vision_start_token_id=151652, vision_end_token_id=151653,
                           video_token_id=151656, dtype="float32")
    Qwen2VLForConditionalGeneration(config).save_pretrained(str(staging), safe_serialization=True)
    GenerationConfig.from_dict({"bos_token_id": BOS_TOKEN_ID, "eos_token_id": [EOS_TOKEN_ID, BOS_TOKEN_ID],
                                "pad_token_id": BOS_TOKEN_ID}).save_pretrained(str(staging))

    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    (staging / "tokenizer.json").write_text(json.dumps(name_vision_tokens(tokenizer), ensure_ascii=False))
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tokenizer_config.pop("added_tokens_decoder", None)  # tokenizer.json's added tokens, now named, are the truth
    (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    template = (tokenizer_dir / "chat_template.jinja").read_text()
    (staging / "chat_template.jinja").write_text(multimodal_template(template))
    (staging / "preprocessor_config.json").write_text(json.dumps(PROCESSOR_CONFIG, indent=2))
    return publish(staging, out_dir)


def main(argv: list[str] | None = None) -> int:
    from polar_gym.tiny_model import build_main

    return build_main("polar_gym.tiny_vlm", __doc__ or "", build_tiny_vlm, argv)


if __name__ == "__main__":
    raise SystemExit(main())
