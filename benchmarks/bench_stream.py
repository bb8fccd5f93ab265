"""Time to first byte of a streamed call: through the proxy (pass-through, and synthesized for comparison) against
straight to the upstream, in the same run, in both prompt modes.

    .venv/bin/python benchmarks/bench_stream.py [--calls 60] [--token-delay 0.004] [--pin]
        [--modes token_in chat] [--front-ends ...] [--no-synthesized] [--out benchmarks/results]

The upstream (``benchmarks/fast_upstream.py``) streams vLLM 0.32-style chunks one token every ``--token-delay``
seconds (a think block, then ~50 tokens of text): ``/v1/completions`` for token-in proxies (``--prompt-mode
token_in``: the proxy renders the prompt and sends its token IDs), ``/v1/chat/completions`` with
``return_token_ids`` for chat proxies (``--prompt-mode chat``: the engine renders). Per mode, two proxies (capture on,
to disk) forward to it: one passing streams through, one synthesizing them (``--no-stream-passthrough``, the
behaviour before). Each front end (Anthropic, Chat, Responses, Google) runs a growing conversation at concurrency 1
on the recorded Claude Code request's system prompt and tools (each call echoes the reply and adds a user turn, as
an agent does); the baseline is the same prompt streamed straight from the upstream (token-in: its token IDs on
``/v1/completions``; chat: the Chat body the proxy sends upstream), its calls interleaved with the proxies' (a
direct call, then one through each proxy, in turn), so load drifting on a shared machine hits both alike. Per call: time
to the first byte of the body, to the first byte of answer text, and to the end. Printed: p50 of each, the
proxy's added p50 over direct, and the targets (issue 18: first byte within 5 ms of direct at c=1; first text, the
stricter one, held to the same 5 ms) as MET or MISSED.

What opens a stream: a token-in proxy opens it when the engine has taken the prompt (the answer's head; the
opening events need only the planned prompt); a chat proxy at the engine's first chunk (it carries the prompt's
IDs, which only the engine knows). Gemini's stream has no opening event (its first chunk carries text): it opens
with its keep-alive (a blank line), so its first text is the number to read.
``--pin`` runs the upstream and the client on core 0 and the proxies on core 1 (``taskset``).
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
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_proxy import free_port, scratch_dir, streaming, wait_ready, workloads  # noqa: E402
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


class Conversation:
    """One front end's growing conversation through one proxy (each call echoes the answer and adds a user turn)."""

    def __init__(self, base: str, front_end: str) -> None:
        path, body = workloads()[front_end]
        self.path, self.body = streaming(front_end, path, body)
        self.front_end, self.field = front_end, conversation_field(front_end)
        key = f"bench-stream-{front_end}-{time.time_ns()}"
        self.headers = {"content-type": "application/json", "authorization": f"Bearer {key}", "x-api-key": key,
                        "x-goog-api-key": key}
        turns = self.body[self.field]
        self.history = list(turns) if isinstance(turns, list) else [{"role": "user", "content": turns}]
        self.client = httpx.AsyncClient(base_url=base, timeout=60)
        self.turn = 0

    async def call(self) -> tuple[float, float, float]:
        payload = json.dumps({**self.body, self.field: self.history}).encode()
        timing = await timed_stream(self.client, self.path, payload, self.headers, b"zq9")
        self.history = [*self.history, assistant_turn(self.front_end), user_turn(self.front_end, self.turn)]
        self.turn += 1
        return timing


async def run_interleaved(up_port: int, mode: str, front_end: str, ports: dict[str, int], prompt_tokens: int,
                          calls: int, warmup: int = 5) -> dict[str, list[tuple[float, float, float]]]:
    """Direct and each proxy one call at a time, in turn: a shared machine's load drifts, and each comparison is
    between calls made next to each other."""
    if mode == "token_in":
        path = "/v1/completions"
        body = {"model": "policy", "prompt": [(i * 7919) % 151000 for i in range(prompt_tokens)], "stream": True,
                "return_token_ids": True, "logprobs": 0, "max_tokens": 1024}
    else:
        path, body = "/v1/chat/completions", chat_upstream_body()
    payload = json.dumps(body).encode()
    conversations = {name: Conversation(f"http://127.0.0.1:{port}", front_end) for name, port in ports.items()}
    timings: dict[str, list[tuple[float, float, float]]] = {"direct": [], **{name: [] for name in ports}}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{up_port}", timeout=60) as direct:
        for n in range(warmup + calls):
            timing = await timed_stream(direct, path, payload, {"content-type": "application/json"}, b"zq9")
            if n >= warmup:
                timings["direct"].append(timing)
            for name, conversation in conversations.items():
                timing = await conversation.call()
                if n >= warmup:
                    timings[name].append(timing)
    for conversation in conversations.values():
        await conversation.client.aclose()
    return timings


def chat_upstream_body() -> dict[str, Any]:
    """The streamed Chat body a chat-mode proxy sends upstream for the Chat front end's first call."""
    from polar_gym.proxy.chat import ChatRequest
    from polar_gym.proxy.engines.vllm import VLLMEngine

    chat = ChatRequest.model_validate({**workloads()["openai_chat"][1], "model": "policy"})
    body = VLLMEngine.build(VLLMEngine.__new__(VLLMEngine), chat)  # build() is pure: no client, no pool
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


def p50s(timings: list[tuple[float, float, float]]) -> dict[str, float]:
    return {name: 1000 * statistics.median(t[i] for t in timings)
            for i, name in enumerate(("first_byte_ms", "first_text_ms", "total_ms"))}


#: issue 18: a streamed call's first byte within this many ms of direct at c=1 (first text held to the same)
TARGET_MS = 5.0


def verdict(added: float) -> str:
    return "MET" if added <= TARGET_MS else "MISSED"


def start_proxies(mode: str, up_port: int, modes: list[str], on: Any, env: dict[str, str]) -> tuple[
        dict[str, int], list[subprocess.Popen[bytes]]]:
    ports = {m: free_port() for m in modes}
    procs = [subprocess.Popen(
        [*on(1), sys.executable, "-m", "polar_gym.proxy", "--engine", "vllm", "--upstream",
         f"http://127.0.0.1:{up_port}", "--port", str(port), "--prompt-mode", mode,
         "--capture-dir", scratch_dir(f"polar-bench-stream-{mode}-{m}-"), "--admin-token", "bench",
         "--log-level", "warning", "--stream-passthrough" if m == "passthrough" else "--no-stream-passthrough"],
        env=env) for m, port in ports.items()]
    return ports, procs


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--token-delay", type=float, default=0.004)
    parser.add_argument("--pin", action="store_true", help="pin upstream+client to core 0, proxies to core 1")
    parser.add_argument("--modes", nargs="*", default=["token_in", "chat"], choices=["token_in", "chat"])
    parser.add_argument("--front-ends", nargs="*", default=["anthropic", "openai_chat", "openai_responses", "google"])
    parser.add_argument("--no-synthesized", action="store_true", help="skip the synthesized-stream proxies")
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
    upstream = subprocess.Popen([*on(0), sys.executable, str(ROOT / "benchmarks" / "fast_upstream.py"), "--port",
                                 str(up_port), "--token-delay", str(args.token_delay), "--prompt-tokens",
                                 str(prompt_tokens)], env=env)
    proxy_modes = ["passthrough"] if args.no_synthesized else ["passthrough", "synthesized"]
    rows: list[dict[str, Any]] = []
    try:
        wait_ready(f"http://127.0.0.1:{up_port}/")
        print(f"streamed calls at c=1, {prompt_tokens}-token first prompt, {len(STREAM_PIECES)} tokens "
              f"{1000 * args.token_delay:.1f} ms apart; target: first byte (and first text) within {TARGET_MS:g} ms "
              "of direct", flush=True)
        for mode in args.modes:
            ports, procs = start_proxies(mode, up_port, proxy_modes, on, env)
            try:
                for port in ports.values():
                    wait_ready(f"http://127.0.0.1:{port}/health", timeout=120)
                print(f"prompt mode {mode}:", flush=True)
                for front_end in args.front_ends:
                    rows += bench_front_end(front_end, mode, up_port, ports, prompt_tokens, args.calls)
            finally:
                stop(procs)
    finally:
        stop([upstream])
    passthrough = [r for r in rows if r["proxy"] == "passthrough"]
    print("summary (pass-through, added p50 over direct):", flush=True)
    for r in passthrough:
        print(f"  {r['prompt_mode']:8} {r['front_end']:16} first byte {r['first_byte_added_ms']:+6.2f} ms "
              f"{verdict(r['first_byte_added_ms']):6}  first text {r['first_text_added_ms']:+6.2f} ms "
              f"{verdict(r['first_text_added_ms'])}", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_stream.json").write_text(json.dumps(
            {"token_delay": args.token_delay, "target_ms": TARGET_MS, "rows": rows}, indent=1))


def bench_front_end(front_end: str, mode: str, up_port: int, ports: dict[str, int], prompt_tokens: int,
                    calls: int) -> list[dict[str, Any]]:
    """Direct and each proxy for one front end, their calls interleaved."""
    timings = asyncio.run(run_interleaved(up_port, mode, front_end, ports, prompt_tokens, calls))
    direct = p50s(timings["direct"])
    rows: list[dict[str, Any]] = [{"prompt_mode": mode, "front_end": front_end, "proxy": "direct", **direct}]
    print(f"  {front_end:16} {'direct':12} first byte {direct['first_byte_ms']:7.2f} ms {'':19} first text "
          f"{direct['first_text_ms']:7.2f} ms {'':19} end {direct['total_ms']:7.2f} ms", flush=True)
    for proxy in ports:
        cell = p50s(timings[proxy])
        added = cell["first_byte_ms"] - direct["first_byte_ms"]
        text_added = cell["first_text_ms"] - direct["first_text_ms"]
        rows.append({"prompt_mode": mode, "front_end": front_end, "proxy": proxy, **cell,
                     "first_byte_added_ms": added, "first_text_added_ms": text_added})
        print(f"  {front_end:16} {proxy:12} first byte {cell['first_byte_ms']:7.2f} ms ({added:+7.2f} vs direct)  "
              f"first text {cell['first_text_ms']:7.2f} ms ({text_added:+7.2f})  end {cell['total_ms']:7.2f} ms",
              flush=True)
    return rows


if __name__ == "__main__":
    main()
