"""The tiny Qwen2-VL's tokenizer and chat template (polar_gym/tiny_vlm.py), on the project's real Qwen tokenizer: the
vision ids get their names, an image part renders as Qwen2-VL's placeholder where it stands, and a conversation
without images renders exactly as with the Qwen3 template it extends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.tiny_vlm import IMAGE_PAD_ID, PROCESSOR_CONFIG, VISION_TOKENS, multimodal_template, name_vision_tokens

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
TOOLS = [{"type": "function", "function": {
    "name": "read", "description": "read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Read a.png"},
    {"role": "assistant", "content": "<think>\nuse the tool\n</think>\n\nReading.",
     "tool_calls": [{"type": "function", "function": {"name": "read", "arguments": {"path": "a.png"}}}]},
    {"role": "tool", "content": "a red square"},
    {"role": "assistant", "content": "Red."},
    {"role": "user", "content": "And b.png?"},
]


@pytest.fixture(scope="module")
def qwen3() -> Path:
    if not (tokenizer_dir() / ".complete").exists():
        pytest.skip("the Qwen tokenizer is not built (bash scripts/setup.sh)")
    return tokenizer_dir()


@pytest.fixture(scope="module")
def vlm_tokenizer(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny VLM's tokenizer files, written as build_tiny_vlm writes them (without the model)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("vlm-tokenizer")
    named = name_vision_tokens(json.loads((qwen3 / "tokenizer.json").read_text()))
    (out / "tokenizer.json").write_text(json.dumps(named))
    config = json.loads((qwen3 / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").write_text(multimodal_template((qwen3 / "chat_template.jinja").read_text()))
    return AutoTokenizer.from_pretrained(str(out))


def test_a_conversation_without_images_renders_exactly_as_with_the_qwen3_template(qwen3: Path,
                                                                                  vlm_tokenizer: Any) -> None:
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(str(qwen3))
    for kwargs in ({"tools": TOOLS}, {}, {"enable_thinking": False}):
        expected = plain.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False, **kwargs)
        assert vlm_tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False,
                                                 **kwargs) == expected
    as_parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} if m["role"] in ("user", "tool") else m
                for m in CONVERSATION]
    assert vlm_tokenizer.apply_chat_template(as_parts, tools=TOOLS, tokenize=False) == plain.apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=False)


def test_an_image_part_renders_as_the_placeholder_where_it_stands_in_user_and_tool_messages(
        vlm_tokenizer: Any) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare "},
                                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                             {"type": "text", "text": " with "}, {"type": "image"}]},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "read", "arguments": {"path": "c.png"}}}]},
                {"role": "tool", "content": [{"type": "text", "text": "c.png:"}, {"type": "image"}]}]
    text = vlm_tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert f"<|im_start|>user\nCompare {PLACEHOLDER} with {PLACEHOLDER}<|im_end|>" in text
    assert f"<tool_response>\nc.png:{PLACEHOLDER}\n</tool_response>" in text
    ids = vlm_tokenizer(text)["input_ids"]
    assert ids.count(IMAGE_PAD_ID) == 3  # one token each, expanded later by the processor's grid


def test_the_vision_ids_are_named_as_qwen2_vl_names_them_and_nothing_else_moves(qwen3: Path,
                                                                                 vlm_tokenizer: Any) -> None:
    from transformers import AutoTokenizer

    original = json.loads((qwen3 / "tokenizer.json").read_text())
    named = name_vision_tokens(original)
    assert original["model"]["vocab"].get("<|image_pad|>") is None  # the input is not modified
    for token_id, name in VISION_TOKENS.items():
        assert vlm_tokenizer.convert_tokens_to_ids(name) == token_id
        assert vlm_tokenizer.decode([token_id]) == name
        assert f"[PAD{token_id}]" not in named["model"]["vocab"]
    assert len(vlm_tokenizer) == len(named["model"]["vocab"]) + sum(
        a["content"] not in named["model"]["vocab"] for a in named["added_tokens"])
    plain = AutoTokenizer.from_pretrained(str(qwen3))
    text = "Compare these two pictures: <|im_start|> [PAD151700]"
    assert vlm_tokenizer(text)["input_ids"] == plain(text)["input_ids"]


def test_a_changed_upstream_template_fails_the_build_by_name() -> None:
    with pytest.raises(ValueError, match=r"messages\[0\]\.content"):
        multimodal_template("{{ messages[-1].content }}")


def test_the_image_processor_gives_one_placeholder_per_two_by_two_patches_within_the_bounds() -> None:
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(**{k: v for k, v in PROCESSOR_CONFIG.items()
                                            if k not in ("image_processor_type", "processor_class")})
    grids = {size: processor(images=[Image.new("RGB", size, (200, 30, 30))])["image_grid_thw"][0].tolist()
             for size in ((96, 64), (8, 8), (1000, 1000))}
    assert grids[(96, 64)] == [1, 4, 6]  # 64x96 rounds to 56x84: 4x6 patches, 6 placeholders
    assert grids[(8, 8)] == [1, 4, 4]  # grown to the 56x56 floor
    assert grids[(1000, 1000)] == [1, 16, 16]  # shrunk to the 224x224 ceiling: 64 placeholders
