"""``python -m polar_gym.trainer serve MODEL_DIR [--port 8000] [--dtype float32]``: serve a model for training with
vLLM's CPU build, in float32 by default (the trainer computes in fp32; bf16 serving made logprobs differ by up to
0.31 in issue 14's measurement, and the mismatch guard refuses it: docs/trainer/correction.md), with
``VLLM_SERVER_DEV_MODE=1``, which the in-place weight reload (``/collective_rpc``) needs. ``--dtype`` is
``trainer.engine_dtype`` when a GRPO launch serves the policy itself. Training itself runs through
``python -m polar_gym.launch +trainer=sft|grpo``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import get_args

from polar_gym.assets import vllm_server_command, vllm_server_env
from polar_gym.trainer.settings import Dtype

__all__: list[str] = []


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - process glue
    parser = argparse.ArgumentParser(prog="python -m polar_gym.trainer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve MODEL_DIR with vLLM CPU (fp32 by default; dev mode: weight reloads)")
    serve.add_argument("model_dir", type=Path)
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-model-len", type=int, default=32768)
    serve.add_argument("--dtype", choices=get_args(Dtype), default="float32",
                       help="the engine's dtype (trainer.engine_dtype; default %(default)s, what the trainer uses)")
    args = parser.parse_args(argv)
    command = vllm_server_command(args.port, model_dir=args.model_dir, max_model_len=args.max_model_len,
                                  dtype=args.dtype, weight_updates=True)
    env = vllm_server_env(weight_updates=True)
    os.execvpe(command[0], command, env)


if __name__ == "__main__":  # pragma: no cover - process glue
    raise SystemExit(main())
