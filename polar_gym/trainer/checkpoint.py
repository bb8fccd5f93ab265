"""Checkpoints in Hugging Face format (safetensors weights, config.json, generation config, tokenizer files), the
layout vLLM's ``reload_weights`` and ``--model`` read and :func:`load_policy` reads back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = ["TOKENIZER_FILES", "load_policy", "save_checkpoint"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json")


def load_policy(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """A transformers causal LM from ``model_dir`` in ``dtype`` (fp32 by default: the engine serves fp32 too, so
    trainer and engine logprobs agree to ~1e-5), in train mode on CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model.train()
    return model


def save_checkpoint(model: Any, out_dir: str | Path, tokenizer_dir: str | Path) -> Path:
    """Write ``model`` and the tokenizer files of ``tokenizer_dir`` to ``out_dir`` atomically (staging + rename,
    a ``.complete`` marker), so an engine never reloads a half-written checkpoint."""
    out = Path(out_dir)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(str(staging), safe_serialization=True)
    for name in TOKENIZER_FILES:
        source = Path(tokenizer_dir) / name
        if source.exists() and not (staging / name).exists():
            shutil.copy(source, staging / name)
    config_path = staging / "config.json"
    config = json.loads(config_path.read_text())
    config["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (staging / ".complete").touch()
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out
