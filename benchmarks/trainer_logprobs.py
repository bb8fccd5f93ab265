"""The trainer's output layer at trained positions only vs a full forward (issue 14): one fp32 forward+backward of a
PROMPT-token prompt + RESPONSE-token response on the tiny Qwen3, each way, in the same run; prints both and the ratio.

    .venv/bin/python benchmarks/trainer_logprobs.py [--prompt 2048] [--response 256] [--repeat 2]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from polar_gym.assets import tiny_model_dir
from polar_gym.trainer import TrainSequence, collate, full_logprobs, load_policy, trained_logprobs


def _seconds(fn: Any, model: Any, batch: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        torch.autograd.backward(-fn(model, batch).mean())
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    model = load_policy(tiny_model_dir())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 150000, (args.prompt + args.response,), generator=gen).tolist()
    batch = collate([TrainSequence(ids[:args.prompt], ids[args.prompt:], [1] * args.response)])
    fast = _seconds(trained_logprobs, model, batch, args.repeat)
    full = _seconds(full_logprobs, model, batch, args.repeat)
    print(f"prompt {args.prompt} + response {args.response}, fp32, {torch.get_num_threads()} threads: "
          f"trained positions {fast:.2f} s, full forward {full:.2f} s, ratio {full / fast:.1f}x")


if __name__ == "__main__":
    main()
