"""A fast local upstream for benchmarks: answers every chat completion instantly, vLLM-style, with ~2,000 prompt
token IDs, 50 sampled token IDs and their logprobs (a bare ASGI app, so it costs as little as possible).
A request with ``stream: true`` (``/v1/completions``, or ``/v1/chat/completions`` with ``return_token_ids``) is
streamed as vLLM 0.32 streams it, one token per chunk ``--token-delay`` seconds apart (a think block, then text),
so time to first byte means something; ``POST /bench/token-delay?seconds=S`` changes that delay (a benchmark's
phases).

    python benchmarks/fast_upstream.py --port 8001 [--prompt-tokens 2000] [--token-delay 0.004]

``--prompt-tokens 0``: each answer's prompt has a token per 4 bytes of the request, the same IDs as the last answer's
up to its length, as a growing conversation's prompt does.
"""

from __future__ import annotations

import argparse
import asyncio

import orjson
import uvicorn

__all__ = ["STREAM_PIECES", "answer_body", "chat_chunks", "completion_body", "completion_chunks", "make_app"]

#: the text a streamed completion samples, a token a piece: reasoning, then the answer, then the end of turn
STREAM_PIECES = ["<think>", "\n", "ok", "\n", "</think>", "\n\n", *["zq9 "] * 47, "end", "<|im_end|>"]


def answer_body(prompt_tokens: int = 2000, sampled: int = 50) -> bytes:
    ids = [(i * 7919) % 151000 for i in range(prompt_tokens)]
    out = [(i * 104729) % 151000 for i in range(sampled - 1)] + [151645]
    return orjson.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "policy",
        "prompt_token_ids": ids,
        "choices": [{"index": 0, "finish_reason": "stop", "token_ids": out,
                     "message": {"role": "assistant", "content": "word " * (sampled - 1), "reasoning_content": None},
                     "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -0.125, "bytes": None,
                                               "top_logprobs": []} for t in out]}}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": sampled,
                  "total_tokens": prompt_tokens + sampled},
    })


def completion_body(prompt: list[int], sampled: int = 50) -> bytes:
    """vLLM's /v1/completions answer to a token prompt (token-in mode): the prompt echoed, 50 sampled tokens."""
    out = [(i * 104729) % 151000 for i in range(sampled - 1)] + [151645]
    return orjson.dumps({
        "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "policy",
        "choices": [{"index": 0, "finish_reason": "stop", "text": "word " * (sampled - 1), "prompt_token_ids": prompt,
                     "token_ids": out, "logprobs": {"token_logprobs": [-0.125] * sampled, "tokens": [],
                                                    "text_offset": [], "top_logprobs": None}}],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": sampled,
                  "total_tokens": len(prompt) + sampled},
    })


def completion_chunks(prompt: list[int]) -> list[bytes]:
    """The SSE events of a streamed /v1/completions answer: one sampled token each, the prompt on the first."""
    events = []
    for i, piece in enumerate(STREAM_PIECES):
        last = i == len(STREAM_PIECES) - 1
        choice = {"index": 0, "text": piece, "token_ids": [151645 if last else (i * 104729) % 151000],
                  "logprobs": {"token_logprobs": [-0.125]}, "finish_reason": "stop" if last else None,
                  "prompt_token_ids": prompt if i == 0 else None}
        events.append(b"data: " + orjson.dumps({"id": "cmpl-bench", "object": "text_completion",
                                                 "choices": [choice]}) + b"\n\n")
    return [*events, b"data: [DONE]\n\n"]


def chat_chunks(prompt_tokens: int, include_usage: bool) -> list[bytes]:
    """The SSE events of a streamed /v1/chat/completions answer as vLLM 0.32 sends it with ``return_token_ids``
    (qwen3 reasoning parser): a role chunk with the prompt's IDs, then one sampled token a chunk (the think block as
    reasoning deltas, its tags as empty deltas), usage when asked."""
    prompt = [(i * 7919) % 151000 for i in range(prompt_tokens)]
    head = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "policy"}
    events = [b"data: " + orjson.dumps({**head, "prompt_token_ids": prompt, "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
        + b"\n\n"]
    thinking = True
    for i, piece in enumerate(STREAM_PIECES):
        last = i == len(STREAM_PIECES) - 1
        token = 151645 if last else (i * 104729) % 151000
        delta: dict[str, str] = {}
        if piece == "</think>":
            thinking = False
        elif piece not in ("<think>", "<|im_end|>") and not (not thinking and piece == "\n\n"):
            delta = {"reasoning": piece} if thinking else {"content": piece}
        choice = {"index": 0, "delta": delta, "token_ids": [token], "finish_reason": "stop" if last else None,
                  "logprobs": {"content": [{"token": f"token_id:{token}", "logprob": -0.125, "bytes": None,
                                            "top_logprobs": []}]}}
        events.append(b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n")
    if include_usage:
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(STREAM_PIECES),
                 "total_tokens": prompt_tokens + len(STREAM_PIECES)}
        events.append(b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n")
    return [*events, b"data: [DONE]\n\n"]


def make_app(prompt_tokens: int, token_delay: float = 0.0):
    body = answer_body(prompt_tokens) if prompt_tokens else b""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    pace = {"token_delay": token_delay}  # POST /bench/token-delay?seconds=S sets it (a benchmark's phases)

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        if scope["path"] == "/bench/token-delay":
            pace["token_delay"] = float(scope["query_string"].decode().partition("seconds=")[2] or 0)
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        token_delay = pace["token_delay"]
        more, chunks = True, []
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        if scope["path"] == "/v1/completions" or b'"stream":true' in raw or b'"stream": true' in raw:
            request = orjson.loads(raw)  # the hot non-streamed chat call is answered without reading its body
        else:
            request = {}
        if request.get("stream"):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            chat = scope["path"] != "/v1/completions"
            if chat:
                events = chat_chunks(prompt_tokens or max(1, len(raw) // 4),
                                     bool((request.get("stream_options") or {}).get("include_usage")))
            else:
                events = completion_chunks(request.get("prompt") or [])
            for n, event in enumerate(events):
                if token_delay and not (chat and n == 1):  # vLLM sends its role chunk with the first token
                    await asyncio.sleep(token_delay)
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        if token_delay:  # a whole answer takes as long to sample as a streamed one
            await asyncio.sleep(token_delay * len(STREAM_PIECES))
        if scope["path"] == "/v1/completions":
            answer = completion_body(request.get("prompt") or [])
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]})
            await send({"type": "http.response.body", "body": answer})
            return
        answer, answer_headers = body, headers
        if not prompt_tokens:  # a prompt as long as the request (~4 bytes a token), opening as the last one did
            answer = answer_body(max(1, len(raw) // 4))
            answer_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": answer_headers})
        await send({"type": "http.response.body", "body": answer})

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prompt-tokens", type=int, default=2000,
                        help="prompt token IDs in each answer (0: a quarter of the request's bytes)")
    parser.add_argument("--token-delay", type=float, default=0.0, help="seconds between streamed tokens")
    args = parser.parse_args()
    uvicorn.run(make_app(args.prompt_tokens, args.token_delay), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False, lifespan="off")
