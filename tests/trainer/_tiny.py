"""A tiny random Qwen3 built in-process (real architecture, small sizes) and saved with the real Qwen tokenizer,
for trainer tests that need a model but not the engine tier's cached one."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from polar_gym.assets import tokenizer_dir

__all__ = ["QWEN_VOCAB", "small_qwen3", "small_qwen3_dir"]

QWEN_VOCAB = 151936


def small_qwen3(vocab_size: int = 512, seed: int = 0) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
    return Qwen3ForCausalLM(config).float()


def small_qwen3_dir(root: Path) -> Path:
    """A small Qwen3 over the real vocabulary, saved in HF format with the real tokenizer files."""
    source = tokenizer_dir()
    if not (source / "tokenizer.json").exists():
        pytest.fail("the Qwen tokenizer is needed: run `bash scripts/setup.sh`")
    out = root / "small-qwen3"
    small_qwen3(QWEN_VOCAB).save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out
