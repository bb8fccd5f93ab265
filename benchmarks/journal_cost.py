"""The capture journal's storage cost, for benchmarks/bench_proxy.py (``--journal-only`` runs just this): a 200-call
Claude Code session built from the recorded request against its unique content, and a 200-turn session growing to
32K-token contexts against its unique tokens."""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import orjson

from polar_gym.proxy.capture import CaptureJournal
from polar_gym.schema import CompletionRecord

__all__ = ["bench_journal", "bench_storage", "claude_code_request", "claude_code_session", "print_journal",
           "unique_content"]

ROOT = Path(__file__).resolve().parents[1]


def claude_code_request(synthetic: bool = False) -> dict:
    """The largest recorded Claude Code request (2.1.197 sends ~76 KB), or a synthetic ~30 KB one of its shape."""
    recorded = sorted((ROOT / "tests" / "data" / "harness" / "claude_code").glob("*.json"),
                      key=lambda p: p.stat().st_size)
    if recorded and not synthetic:
        body = json.loads(recorded[-1].read_text())["body"]
        body["stream"] = False
        return body
    rng = random.Random(0)
    words = [f"w{rng.randrange(5000)}" for _ in range(4500)]
    tools = [{"name": f"Tool{i}", "description": " ".join(words[i * 40:(i + 1) * 40]),
              "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                               "required": ["command"]}} for i in range(16)]
    return {"model": "policy", "max_tokens": 32000, "system": [{"type": "text", "text": " ".join(words[:3000])}],
            "tools": tools, "messages": [{"role": "user", "content": "Fix the failing test."}]}


def bench_storage(turns: int = 200, context: int = 32000) -> dict:
    """A 200-turn append-only session whose context grows to ~32K tokens."""
    rng = random.Random(7)
    per_turn = context // turns
    prompt = [rng.randrange(151000) for _ in range(1000)]
    messages: list[dict] = [{"role": "system", "content": "x" * 4000}]
    records, raw_bytes = [], 0
    for turn in range(turns):
        user = [rng.randrange(151000) for _ in range(per_turn // 2)]
        prompt = prompt + user
        messages = [*messages, {"role": "user", "content": " ".join(f"u{t}" for t in user)}]
        response = [rng.randrange(151000) for _ in range(per_turn - len(user))]
        rec = CompletionRecord(completion_id=f"c{turn}", session_id="long", index=turn, provider="anthropic",
                               engine="vllm", request={"model": "policy", "messages": messages},
                               normalized_request={"model": "policy", "messages": messages},
                               prompt_ids=list(prompt), response_ids=response,
                               response_logprobs=[-rng.random() for _ in response])
        records.append(rec)
        raw_bytes += len(rec.model_dump_json())
        messages = [*messages, {"role": "assistant", "content": " ".join(f"a{t}" for t in response)}]
        prompt = prompt + response

    async def store() -> tuple[int, int, int]:
        with tempfile.TemporaryDirectory() as tmp:
            journal = CaptureJournal(tmp)
            for rec in records:
                await journal.append(rec)
            journal.close()
            d = Path(tmp) / "long"
            sizes = {p.name: p.stat().st_size for p in d.iterdir()}
            back = await CaptureJournal(tmp).records("long")
            assert [r.prompt_ids for r in back] == [r.prompt_ids for r in records]
            return sizes["tokens.bin"], sizes["logprobs.bin"], sizes["records.jsonl"]

    tokens_b, logprobs_b, records_b = asyncio.run(store())
    unique = len(prompt)
    sampled = sum(len(r.response_ids) for r in records)
    minimum = 4 * unique + 8 * sampled
    return {"turns": turns, "final_context_tokens": unique, "unique_tokens": unique,
            "token_and_logprob_bytes": tokens_b + logprobs_b, "record_bytes": records_b,
            "minimum_bytes": minimum, "token_ratio": (tokens_b + logprobs_b) / minimum,
            "total_ratio": (tokens_b + logprobs_b + records_b) / minimum,
            "raw_per_call_json_bytes": raw_bytes, "raw_ratio": raw_bytes / minimum}


def claude_code_session(turns: int = 200) -> tuple[list[CompletionRecord], list[bytes]]:
    """A ``turns``-call Claude Code session built from the recorded request: the same tools, system blocks and
    metadata every call, the conversation growing by the model's tool call and the tool's result each turn; the
    normalized request is the Anthropic front end's own. Returns the records and the bodies as sent."""
    from polar_gym.proxy.providers.base import Route
    from polar_gym.registry import PROVIDERS

    rng = random.Random(18)
    words = [f"w{rng.randrange(20000)}" for _ in range(5000)]
    body = claude_code_request()
    body["stream"] = True
    provider = PROVIDERS.get("anthropic")()
    route = Route("/v1/messages", query={"beta": "true"})
    messages = list(body["messages"])
    prompt = [rng.randrange(151000) for _ in range(len(orjson.dumps(body)) // 4)]
    records, sent = [], []
    for turn in range(turns):
        request = {**body, "messages": list(messages)}
        raw = orjson.dumps(request)
        normalized = provider.parse(orjson.loads(raw), route).chat.dump()
        command = " ".join(rng.sample(words, rng.randrange(5, 40)))
        call = {"type": "tool_use", "id": f"toolu_{turn:024d}", "name": "Bash", "input": {"command": command}}
        answer = {"role": "assistant", "content": [{"type": "text", "text": " ".join(rng.sample(words, 20))}, call]}
        response = [rng.randrange(151000) for _ in range(len(orjson.dumps(answer)) // 4)]
        records.append(CompletionRecord(
            completion_id=f"{turn:032x}", session_id="claude", index=turn, provider="anthropic", engine="vllm",
            model="policy", stream=True, path="/v1/messages?beta=true", request=orjson.loads(raw),
            normalized_request=normalized, response={"id": f"msg_{turn:024x}", "message": answer,
                                                     "usage": {"prompt_tokens": len(prompt)}},
            prompt_ids=list(prompt), response_ids=response, response_logprobs=[-rng.random() for _ in response],
            finish_reason="tool_calls", prompt_mode="token_in", delivered=True, server="http://127.0.0.1:8000",
            started_at=1.76e9 + turn, upstream_seconds=rng.random(), total_seconds=rng.random()))
        sent.append(raw)
        output = " ".join(rng.sample(words, rng.randrange(10, 600)))
        result = {"role": "user", "content": [{"tool_use_id": call["id"], "type": "tool_result", "content": output,
                                               "is_error": False}]}
        messages += [answer, result]
        prompt = prompt + response + [rng.randrange(151000) for _ in range(len(orjson.dumps(result)) // 4)]
    return records, sent


def unique_content(records: list[CompletionRecord]) -> int:
    """Bytes of what the session holds that is new, each thing counted once: every distinct top-level value and
    conversation element of the request and of the normalized request (as compact JSON), each answer, each
    record's own fields, 4 bytes per distinct token of the conversation and 8 per sampled logprob."""
    seen: set[bytes] = set()
    total = 0

    def once(value: object) -> None:
        nonlocal total
        data = orjson.dumps(value)
        if data not in seen:
            seen.add(data)
            total += len(data)

    heavy = {"request", "normalized_request", "response", "prompt_ids", "response_ids", "response_logprobs"}
    for rec in records:
        for body in (rec.request, rec.normalized_request):
            for name, value in body.items():
                for item in (value if name in ("messages", "input", "contents") else [value]):
                    once(item)
        once(rec.response)
        total += len(rec.model_dump_json(exclude=heavy))
    last = records[-1]
    return total + 4 * len(last.prompt_ids + last.response_ids) + 8 * sum(len(r.response_ids) for r in records)


def bench_journal(turns: int = 200) -> dict:
    """Journal bytes per call of a ``turns``-call Claude Code session against its unique content (target <= 1.1x)
    and against raw per-call JSON (what storing each call whole costs); every request comes back as sent."""
    from polar_gym.journal import read_received, read_session

    records, sent = claude_code_session(turns)
    unique = unique_content(records)
    raw = sum(len(r.model_dump_json()) for r in records)

    async def store(root: str) -> float:
        journal = CaptureJournal(root)
        t0 = time.process_time()
        for rec, body in zip(records, sent, strict=True):
            await journal.append(rec.model_copy(), received=body)
        elapsed = time.process_time() - t0
        journal.close()
        return elapsed

    with tempfile.TemporaryDirectory() as tmp:
        cpu = asyncio.run(store(tmp))
        stream = Path(tmp) / "claude"
        stored = sum(p.stat().st_size for p in stream.iterdir())
        assert read_received(stream) == sent, "a request did not come back byte for byte"
        assert [r.prompt_ids for r in read_session(stream)] == [r.prompt_ids for r in records]
    return {"turns": turns, "request_bytes_first": len(sent[0]), "request_bytes_last": len(sent[-1]),
            "journal_bytes_per_call": stored / turns, "unique_bytes_per_call": unique / turns,
            "raw_json_bytes_per_call": raw / turns, "ratio_to_unique": stored / unique,
            "raw_ratio_to_unique": raw / unique, "append_cpu_ms_per_call": 1000 * cpu / turns}


def print_journal(j: dict) -> None:
    met = "MET" if j["ratio_to_unique"] <= 1.1 else "MISSED"
    print(f"\njournal, {j['turns']}-call Claude Code session (request {j['request_bytes_first'] / 1e3:.0f} KB growing "
          f"to {j['request_bytes_last'] / 1e3:.0f} KB): {j['journal_bytes_per_call'] / 1e3:.1f} KB stored per call, "
          f"unique content {j['unique_bytes_per_call'] / 1e3:.1f} KB per call: {j['ratio_to_unique']:.3f}x "
          f"(target <= 1.1x: {met}); raw per-call JSON {j['raw_json_bytes_per_call'] / 1e3:.1f} KB per call "
          f"({j['raw_ratio_to_unique']:.1f}x); append {j['append_cpu_ms_per_call']:.2f} CPU ms per call", flush=True)
