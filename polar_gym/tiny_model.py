"""A tiny randomly initialised Qwen3 for the real-engine test tier: real architecture and vocabulary, no download.

    python -m polar_gym.tiny_model OUT_DIR TOKENIZER_DIR

Runs with the vLLM venv's python (it needs torch and transformers, which that venv has). The weights are random but
seeded, so the same model comes out every time; what matters to the tests is that vLLM loads it, tokenizes with the
real Qwen tokenizer and reports token IDs and logprobs, not what the model says.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["EOS_TOKEN_ID", "TINY_CONFIG", "build_tiny_model"]

EOS_TOKEN_ID = 151645  # <|im_end|>: ends an assistant turn in the Qwen chat template
BOS_TOKEN_ID = 151643  # <|endoftext|>
SEED = 1234
TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "vocab_size": 151936,
    "max_position_embeddings": 65536,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                    "vocab.json", "merges.txt")


def build_tiny_model(out_dir: Path, tokenizer_dir: Path) -> Path:
    """Write the model, the tokenizer files and a generation config to ``out_dir`` atomically (staging + rename,
    ``.complete`` marker), so an interrupted build is never mistaken for a finished one."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / ".complete").exists():
        return out_dir
    staging = fresh_staging(out_dir)
    torch.manual_seed(SEED)
    config = Qwen3Config(**TINY_CONFIG, dtype="bfloat16")
    model = Qwen3ForCausalLM(config).bfloat16()
    model.save_pretrained(str(staging), safe_serialization=True)
    GenerationConfig.from_dict({"bos_token_id": BOS_TOKEN_ID, "eos_token_id": [EOS_TOKEN_ID, BOS_TOKEN_ID],
                                "pad_token_id": BOS_TOKEN_ID}).save_pretrained(str(staging))

    copied = [name for name in _TOKENIZER_FILES if (tokenizer_dir / name).exists()]
    if "tokenizer.json" not in copied:
        raise FileNotFoundError(f"no tokenizer.json in {tokenizer_dir}: build it with `python -m polar_gym.assets "
                                "tokenizer` first")
    for name in copied:
        shutil.copy(tokenizer_dir / name, staging / name)
    # The saved config must name our dtype even if this transformers version writes another key for it.
    cfg_path = staging / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return publish(staging, out_dir)


def fresh_staging(out_dir: Path) -> Path:
    """An empty folder beside ``out_dir`` to build it in, then :func:`publish` it."""
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish(staging: Path, out_dir: Path) -> Path:
    """Mark a finished build complete and move it to ``out_dir`` (an interrupted one is never mistaken for it)."""
    (staging / ".complete").touch()
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir


def build_main(prog: str, description: str, build: Callable[[Path, Path], Path], argv: list[str] | None) -> int:
    """The command line of a tiny-model builder: ``OUT_DIR TOKENIZER_DIR``, then the folder and its size."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("tokenizer_dir", type=Path)
    args = parser.parse_args(argv)
    path = build(args.out_dir, args.tokenizer_dir)
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    print(f"[{prog.rsplit('.', 1)[-1]}] {path} ({size / 1e6:.1f} MB)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return build_main("polar_gym.tiny_model", __doc__ or "", build_tiny_model, argv)


if __name__ == "__main__":
    raise SystemExit(main())
