"""bench_proxy.py's cells over many calls of sessions: CPU per call as one session grows (``bench_growth``) and the
proxy's memory over 10,000 sessions (``bench_memory``). Run through ``benchmarks/bench_proxy.py`` (``--skip-growth``,
``--skip-memory`` leave them out)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
import orjson

from benchmarks.bench_proxy import cpu_ns, pin_self, real_workloads, rss_mb, start_pair
from benchmarks.journal_cost import claude_code_session

__all__ = ["bench_growth", "bench_memory", "run_sessions"]


# -- a growing session ------------------------------------------------------------------------------------------
def bench_growth(quick: bool, turns: int = 120, window: int = 20) -> dict:
    """CPU per call as a session grows: a ``turns``-call Claude Code session (the recorded request, its
    conversation growing by a tool call and its result each turn) through the proxy at c=1, the upstream answering
    with a prompt of a token per 4 request bytes (its IDs starting as the last answer's). Its first and last
    ``window`` calls, against the same bodies sent each in a session of its own (nothing the proxy keeps per
    session helps them): what a call costs stays near what its new content costs, not its whole conversation."""
    from polar_gym.proxy.upstream_http import UpstreamClient

    if quick:
        turns, window = 40, 10
    _, sent = claude_code_session(turns)
    bodies = [raw.replace(b'"stream":true', b'"stream":false') for raw in sent]
    upstream, proxy, _, proxy_port = start_pair(prompt_tokens=0)
    pin_self(1)
    url = f"http://127.0.0.1:{proxy_port}/v1/messages"

    async def run(keys: list[str]) -> list[float]:
        spent = []
        clients = {key: UpstreamClient(timeout=60, headers={"x-api-key": key}) for key in set(keys)}
        try:
            for key, body in zip(keys, bodies, strict=True):
                cpu0 = cpu_ns(proxy.pid)
                answer = await clients[key].post(url, body)
                spent.append((cpu_ns(proxy.pid) - cpu0) / 1e6)
                if answer.status_code != 200:
                    raise RuntimeError(f"a growing-session call failed: {answer.status_code} {answer.content[:300]!r}")
        finally:
            for client in clients.values():
                await client.aclose()
        return spent

    try:
        one = asyncio.run(run(["growth"] * turns))
        apart = asyncio.run(run([f"growth-{n}" for n in range(turns)]))
    finally:
        for proc in (proxy, upstream):
            proc.terminate()
            proc.wait(timeout=10)
    first, last = slice(0, window), slice(turns - window, turns)
    row = {"turns": turns, "window": window, "body_kb_first": len(bodies[0]) / 1024,
           "body_kb_last": len(bodies[-1]) / 1024, "prompt_tokens_last": len(bodies[-1]) // 4,
           "one_session_first_ms": statistics.median(one[first]), "one_session_last_ms": statistics.median(one[last]),
           "apart_first_ms": statistics.median(apart[first]), "apart_last_ms": statistics.median(apart[last])}
    row["last_ratio"] = row["one_session_last_ms"] / row["apart_last_ms"]
    print(f"\ngrowing session, {turns} Claude Code calls at c=1 (request {row['body_kb_first']:.0f} KB growing to "
          f"{row['body_kb_last']:.0f} KB, prompt to {row['prompt_tokens_last']} tokens): proxy CPU per call (median "
          f"of {window}), first / last calls: in one session {row['one_session_first_ms']:.2f} / "
          f"{row['one_session_last_ms']:.2f} ms; each call a session of its own {row['apart_first_ms']:.2f} / "
          f"{row['apart_last_ms']:.2f} ms; last calls x{row['last_ratio']:.2f}", flush=True)
    return row


# -- memory over many sessions ---------------------------------------------------------------------------------
async def run_sessions(base: str, path: str, body: dict, first: int, count: int, calls: int,
                       concurrency: int) -> int:
    """``count`` new sessions (keys ``mem-<n>``), each making ``calls`` calls; the number of failed calls."""
    payload = orjson.dumps(body)
    errors = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for n in range(first, first + count):
        queue.put_nowait(n)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as client:
        async def worker() -> None:
            nonlocal errors
            while not queue.empty():
                n = queue.get_nowait()
                for _ in range(calls):
                    resp = await client.post(path, content=payload, headers={
                        "content-type": "application/json", "x-api-key": f"mem-{n}"})
                    errors += resp.status_code != 200

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return errors


def bench_memory(quick: bool, calls: int = 2, idle_seconds: float = 0.5) -> dict:
    """The standalone proxy's resident memory after 100 and after 10,000 sessions (each ``calls`` calls with the
    recorded Claude Code body): per-session state must go when a session goes idle, so memory stays flat. Read
    once the sessions of a stage have gone idle (and a call of a new session has made the proxy forget them and
    give the memory back), and also right after the stage, while the sessions of its last ``idle_seconds`` are
    still live (what the proxy keeps for a live session: its conversation and its last prompt IDs, parsed once)."""
    sessions = (100, 500, 1_000, 2_000) if quick else (100, 1_000, 2_500, 5_000, 10_000)
    upstream, proxy, _, proxy_port = start_pair(extra=("--session-idle-seconds", str(idle_seconds)))
    path, body = real_workloads()["anthropic"]
    result: dict = {"calls_per_session": calls, "body_kb": len(json.dumps(body)) / 1024}
    try:
        done, errors = 0, 0
        for target in sessions:
            started = time.perf_counter()
            errors += asyncio.run(run_sessions(f"http://127.0.0.1:{proxy_port}", path, body, done, target - done,
                                               calls, 16))
            done = target
            live = result[f"rss_mb_live_{target}"] = rss_mb(proxy.pid)
            time.sleep(idle_seconds * 1.5)  # every session of the stage idle: the next new one makes them forgotten
            errors += asyncio.run(run_sessions(f"http://127.0.0.1:{proxy_port}", path, body, 10**9 + target, 1,
                                               1, 1))
            time.sleep(1.5)  # the proxy gives freed pages back to the OS within a second (polar_gym.proxy.heap)
            result[f"rss_mb_after_{target}"] = rss_mb(proxy.pid)
            print(f"after {target:>6} sessions ({calls} calls each): RSS {result[f'rss_mb_after_{target}']:.0f} MB "
                  f"once idle, {live:.0f} MB while the last were live ({time.perf_counter() - started:.0f} s)",
                  flush=True)
        result["errors"] = errors
        result["rss_ratio"] = result[f"rss_mb_after_{sessions[-1]}"] / result[f"rss_mb_after_{sessions[0]}"]
        result["sessions"] = list(sessions)
    finally:
        for proc in (proxy, upstream):
            proc.terminate()
            proc.wait(timeout=10)
    return result
