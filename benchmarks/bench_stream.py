"""Time to first byte of a streamed call: through the proxy (pass-through, and synthesized for comparison) against
straight to the upstream, in the same run.

    .venv/bin/python benchmarks/bench_stream.py [--calls 60] [--token-delay 0.004] [--pin] [--out benchmarks/results]

The upstream (``benchmarks/fast_upstream.py``) streams vLLM-style ``/v1/completions`` chunks one token every
``--token-delay`` seconds (a think block, then ~50 tokens of text). Two token-in proxies (``--engine vllm
--prompt-mode token_in``, capture on, to disk) forward to it: one passing streams through, one synthesizing them
(``--no-stream-passthrough``, the behaviour before). Each front end (Anthropic, Chat, Responses, Google) runs a
growing conversation at concurrency 1 on the recorded Claude Code request's system prompt and tools (each call
echoes the reply and adds a user turn, as an agent does); the baseline is the same prompt's token IDs streamed
straight from the upstream, measured next to each front end. Per call: time to the first byte of the body, to the
first byte of answer text, and to the end. Printed: p50 of each and the proxy's added p50 over direct (target:
first byte within 5 ms of direct).
``--pin`` runs the upstream and the client on core 0 and each proxy on core 1 (``taskset``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_proxy import free_port, streaming, wait_ready, workloads  # noqa: E402
from benchmarks.fast_upstream import STREAM_PIECES  # noqa: E402

#: the answer text the upstream streams (see fast_upstream.STREAM_PIECES): what an agent echoes back
ANSWER = "zq9 " * 47 + "end"


def assistant_turn(front_end: str) -> dict[str, Any]:
    if front_end == "anthropic":
        return {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]}
    if front_end == "google":
        return {"role": "model", "parts": [{"text": ANSWER}]}
    return {"role": "assistant", "content": ANSWER}


def user_turn(front_end: str, n: int) -> dict[str, Any]:
    text = f"Continue with step {n}."
    return {"role": "user", "parts": [{"text": text}]} if front_end == "google" else {"role": "user", "content": text}


def conversation_field(front_end: str) -> str:
    return {"anthropic": "messages", "openai_chat": "messages", "openai_responses": "input", "google": "contents"}[
        front_end]


async def timed_stream(client: httpx.AsyncClient, path: str, payload: bytes, headers: dict[str, str],
                       text_marker: bytes) -> tuple[float, float, float]:
    """(first byte, first answer text, end) of one streamed call, in seconds."""
    t0 = time.perf_counter()
    first = first_text = 0.0
    async with client.stream("POST", path, content=payload, headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{path} answered {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for chunk in resp.aiter_raw():
            now = time.perf_counter() - t0
            if chunk and not first:
                first = now
            if not first_text and text_marker in chunk:
                first_text = now
    end = time.perf_counter() - t0
    return first, first_text or end, end  # a synthesized answer's text is in its one burst


async def run_front_end(base: str, front_end: str, calls: int, warmup: int = 5) -> list[tuple[float, float, float]]:
    path, body = workloads()[front_end]
    path, body = streaming(front_end, path, body)
    field = conversation_field(front_end)
    key = f"bench-stream-{front_end}-{time.time_ns()}"
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}", "x-api-key": key,
               "x-goog-api-key": key}
    history = list(body[field]) if isinstance(body[field], list) else [{"role": "user", "content": body[field]}]
    timings = []
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        for n in range(warmup + calls):
            payload = json.dumps({**body, field: history}).encode()
            timing = await timed_stream(client, path, payload, headers, b"zq9")
            if n >= warmup:
                timings.append(timing)
            history = [*history, assistant_turn(front_end), user_turn(front_end, n)]
    return timings


async def run_direct(base: str, prompt_tokens: int, calls: int, warmup: int = 5) -> list[tuple[float, float, float]]:
    body = {"model": "policy", "prompt": [(i * 7919) % 151000 for i in range(prompt_tokens)], "stream": True,
            "return_token_ids": True, "logprobs": 0, "max_tokens": 1024}
    payload = json.dumps(body).encode()
    timings = []
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        for n in range(warmup + calls):
            timing = await timed_stream(client, "/v1/completions", payload, {"content-type": "application/json"},
                                        b"zq9")
            if n >= warmup:
                timings.append(timing)
    return timings


def p50s(timings: list[tuple[float, float, float]]) -> dict[str, float]:
    return {name: 1000 * statistics.median(t[i] for t in timings)
            for i, name in enumerate(("first_byte_ms", "first_text_ms", "total_ms"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--token-delay", type=float, default=0.004)
    parser.add_argument("--pin", action="store_true", help="pin upstream+client to core 0, proxies to core 1")
    parser.add_argument("--front-ends", nargs="*", default=["anthropic", "openai_chat", "openai_responses", "google"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    pin = args.pin and shutil.which("taskset") is not None
    if pin:
        os.sched_setaffinity(0, {0})

    def on(core: int) -> list[str]:
        return ["taskset", "-c", str(core)] if pin else []

    from polar_gym.assets import tokenizer_dir
    from polar_gym.proxy.chat import ChatRequest
    from polar_gym.proxy.tokenizer import HFChatTokenizer, template_messages

    chat = workloads()["openai_chat"][1]
    prompt_tokens = len(HFChatTokenizer(tokenizer_dir()).render(
        *template_messages(ChatRequest.model_validate({**chat, "model": "policy"}))))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    up_port = free_port()
    procs = [subprocess.Popen([*on(0), sys.executable, str(ROOT / "benchmarks" / "fast_upstream.py"), "--port",
                               str(up_port), "--token-delay", str(args.token_delay)], env=env)]
    ports = {"passthrough": free_port(), "synthesized": free_port()}
    for mode, port in ports.items():
        procs.append(subprocess.Popen(
            [*on(1), sys.executable, "-m", "polar_gym.proxy", "--engine", "vllm", "--upstream",
             f"http://127.0.0.1:{up_port}", "--port", str(port), "--prompt-mode", "token_in",
             "--capture-dir", tempfile.mkdtemp(prefix=f"polar-bench-stream-{mode}-"), "--admin-token", "bench",
             "--log-level", "warning", "--stream-passthrough" if mode == "passthrough" else "--no-stream-passthrough"],
            env=env))
    rows: list[dict[str, Any]] = []
    try:
        wait_ready(f"http://127.0.0.1:{up_port}/")
        for port in ports.values():
            wait_ready(f"http://127.0.0.1:{port}/health", timeout=120)
        print(f"streamed calls at c=1, {prompt_tokens}-token first prompt, {len(STREAM_PIECES)} tokens "
              f"{1000 * args.token_delay:.1f} ms apart", flush=True)
        for front_end in args.front_ends:
            # direct again next to each front end: a shared machine's load drifts over a run
            direct = p50s(asyncio.run(run_direct(f"http://127.0.0.1:{up_port}", prompt_tokens, args.calls)))
            rows.append({"front_end": front_end, "mode": "direct", **direct})
            print(f"  {front_end:16} {'direct':12} first byte {direct['first_byte_ms']:7.2f} ms {'':19} first text "
                  f"{direct['first_text_ms']:7.2f} ms  end {direct['total_ms']:7.2f} ms", flush=True)
            for mode, port in ports.items():
                cell = p50s(asyncio.run(run_front_end(f"http://127.0.0.1:{port}", front_end, args.calls)))
                added = cell["first_byte_ms"] - direct["first_byte_ms"]
                rows.append({"front_end": front_end, "mode": mode, **cell, "first_byte_added_ms": added})
                print(f"  {front_end:16} {mode:12} first byte {cell['first_byte_ms']:7.2f} ms ({added:+6.2f} vs "
                      f"direct)  first text {cell['first_text_ms']:7.2f} ms  end {cell['total_ms']:7.2f} ms",
                      flush=True)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=20)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_stream.json").write_text(json.dumps({"token_delay": args.token_delay, "rows": rows},
                                                               indent=1))

if __name__ == "__main__":
    main()
