"""What each precision choice costs in trainer-vs-engine mismatch (issue 37, "precision as a knob"): the tiny Qwen3
served by vLLM's CPU build in each engine dtype samples the same prompts (temperature 1, raw logprobs captured);
the trainer then recomputes every sampled token's logprob in each trainer precision (fp32, bf16, bf16 with an fp32
output layer, fp16) and the mismatch metrics are taken under verl's names. One engine runs at a time (each start
takes ~40-60 s here); an engine dtype vLLM refuses is reported as such with its log's last line.

    .venv/bin/python benchmarks/bench_precision.py [--samples 16] [--max-tokens 64] [--out bench_precision.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from polar_gym.assets import TINY_MODEL_NAME, tiny_model_dir, tokenizer_dir, vllm_server_command, vllm_server_env
from polar_gym.audit.correction import rollout_correction
from polar_gym.audit.metrics import mismatch_metrics
from polar_gym.serving import free_port
from polar_gym.trainer import TrainSequence, collate, load_policy, trained_logprobs

ENGINE_DTYPES = ("float32", "bfloat16", "float16")
#: (name, trainer dtype, fp32 output layer)
TRAINERS = (("fp32", "float32", False), ("bf16", "bfloat16", False), ("bf16+fp32 head", "bfloat16", True),
            ("fp16", "float16", False))
PROMPTS = ("Write a short poem about the sea.", "What is 17 times 23? Think step by step.",
           "List three uses of a paperclip.", "Explain why the sky is blue in two sentences.",
           "Translate 'good morning' into French and Spanish.", "Name a prime number larger than 100.",
           "Describe a cat to someone who has never seen one.", "Give me a recipe for pancakes.")
COLUMNS = ("audit/logprob_abs_diff_mean", "audit/logprob_abs_diff_max", "rollout_corr/k3_kl",
           "rollout_corr/chi2_token", "rollout_corr/rollout_is_ratio_fraction_high")


def _serve(dtype: str, log: Path, wait: float) -> tuple[subprocess.Popen[bytes] | None, str, str]:
    """Start vLLM in ``dtype``; (process, url, "") once healthy, or (None, "", why) when it exits or times out."""
    port = free_port()
    cmd = vllm_server_command(port, dtype=dtype, max_model_len=4096)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=vllm_server_env(), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    while time.monotonic() - started < wait:
        if proc.poll() is not None:
            lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
            errors = [x for x in lines if "Error" in x or "error" in x]
            return None, "", (errors or lines or ["(no log)"])[-1].strip()[:300]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, ""
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    _stop(proc)
    return None, "", f"not ready after {wait:.0f} s"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _sample(url: str, prompts: list[list[int]], samples: int, max_tokens: int) -> list[TrainSequence]:
    """``samples`` completions round-robin over ``prompts``, with each sampled token's raw logprob."""
    out = []
    with httpx.Client(timeout=300) as client:
        for i in range(samples):
            ids = prompts[i % len(prompts)]
            body = {"model": TINY_MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 1.0,
                    "logprobs": 0, "return_tokens_as_token_ids": True, "seed": i}
            choice = client.post(url + "/v1/completions", json=body).raise_for_status().json()["choices"][0]
            tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            if tokens:
                out.append(TrainSequence(ids, tokens, [1] * len(tokens), logprobs))
    return out


def _measure(sequences: list[TrainSequence]) -> dict[str, dict[str, float | None]]:
    batch = collate(sequences, 151643)
    table: dict[str, dict[str, float | None]] = {}
    for name, dtype, head in TRAINERS:
        model = load_policy(tiny_model_dir(), getattr(torch, dtype)).eval()
        with torch.no_grad():
            train = trained_logprobs(model, batch, fp32_head=head).float()
        rows = batch.rows.tolist()
        per_seq_t: dict[int, list[float]] = {}
        per_seq_r: dict[int, list[float]] = {}
        for k, (a, b) in enumerate(zip(train.tolist(), batch.old_logprobs.tolist(), strict=True)):
            per_seq_t.setdefault(rows[k], []).append(a)
            per_seq_r.setdefault(rows[k], []).append(b)
        metrics = mismatch_metrics(list(per_seq_t.values()), list(per_seq_r.values()))
        values = metrics.as_dict() if metrics is not None else {}
        row: dict[str, float | None] = {c: (float(v) if (v := values.get(c)) is not None else None) for c in COLUMNS}
        masked = rollout_correction(train, batch.old_logprobs, batch.rows, "sequence_mask", 2.0).stats
        row["tokens"] = float(batch.trained_tokens)
        row["sequence_mask_masked_fraction"] = masked["rollout_corr/correction_masked_fraction"]
        table[name] = row
        del model
    return table


def _ids(encoded: Any) -> list[int]:
    """Token ids from apply_chat_template's answer (a list, or a BatchEncoding in recent transformers)."""
    return [int(x) for x in (encoded["input_ids"] if hasattr(encoded, "keys") else encoded)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--engine-dtypes", default=",".join(ENGINE_DTYPES))
    parser.add_argument("--wait", type=float, default=300.0, help="seconds for each engine to become ready")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the trainer side")
    parser.add_argument("--out", type=Path, default=Path("bench_precision.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir()))
    prompts = [_ids(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                  tokenize=True, enable_thinking=False)) for p in PROMPTS]
    result: dict[str, Any] = {"samples": args.samples, "max_tokens": args.max_tokens, "engines": {}}
    logs = Path(tempfile.mkdtemp(prefix="bench-precision-"))
    for dtype in args.engine_dtypes.split(","):
        proc, url, why = _serve(dtype, logs / f"vllm-{dtype}.log", args.wait)
        if proc is None:
            print(f"engine {dtype}: refused ({why})", flush=True)
            result["engines"][dtype] = {"refused": why}
            continue
        try:
            sequences = _sample(url, prompts, args.samples, args.max_tokens)
        finally:
            _stop(proc)
        print(f"engine {dtype}: {len(sequences)} completions, {sum(len(s.response_ids) for s in sequences)} tokens",
              flush=True)
        result["engines"][dtype] = _measure(sequences)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    header = ["engine", "trainer", "|Δ| mean", "|Δ| max", "k3 KL", "chi2 token", "ρ>2 share", "seq-masked @2"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for dtype, table in result["engines"].items():
        if "refused" in table:
            print(f"| {dtype} | - | refused: {table['refused']} |")
            continue
        for name, row in table.items():
            cells = [row[c] for c in COLUMNS] + [row["sequence_mask_masked_fraction"]]
            print(f"| {dtype} | {name} | " + " | ".join("-" if v is None else f"{v:.3g}" for v in cells) + " |")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
