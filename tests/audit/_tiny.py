"""A tiny random Qwen3 built in-process (small vocabulary, two layers) and traces sampled from it, so the audit's
recompute and CLI are tested without the engine tier."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["build_model", "naive_logprobs", "sampled_trace", "write_run"]


def build_model(seed: int = 0) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=128, vocab_size=512, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    return Qwen3ForCausalLM(config).eval()


def naive_logprobs(model: Any, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for every t >= 1, from one full forward (logits at every position)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[t - 1, ids[t]]) for t in range(1, len(ids))]


def sampled_trace(model: Any, session: str, prompt: int = 20, turns: int = 3, seed: int = 0,
                  version: int | str | None = 0) -> dict[str, Any]:
    """A prefix-merged trace line: turns of 8 sampled tokens (mask 1) between bridges of 5 (mask 0), with the
    logprobs the model gives each token and one span per turn."""
    import torch

    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(0, vocab, (prompt,), generator=g).tolist()
    response: list[int] = []
    mask: list[int] = []
    spans = []
    for turn in range(turns):
        if turn:
            response += torch.randint(0, vocab, (5,), generator=g).tolist()
            mask += [0] * 5
        start = len(response)
        response += torch.randint(0, vocab, (8,), generator=g).tolist()
        mask += [1] * 8
        spans.append({"completion_id": f"{session}-{turn}", "start": start, "end": len(response),
                      "policy_version": version})
    lp = naive_logprobs(model, prompt_ids + response)[prompt - 1:]
    logprobs = [v if m else 0.0 for v, m in zip(lp, mask, strict=True)]
    return {"session_id": session, "trace_index": 0, "task_id": "t", "prompt_ids": prompt_ids,
            "response_ids": response, "loss_mask": mask,
            "response_logprobs": [{"token": None, "token_id": t, "logprob": v} for t, v in zip(response, logprobs,
                                                                                               strict=True)],
            "metadata": {"spans": spans, "policy_versions": [version], "has_logprobs": True}}


def write_run(folder: Path, rows: list[dict[str, Any]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder
