"""Trajectory builders on long generated sessions, against a reference-like baseline measured in the same run.

    .venv/bin/python benchmarks/bench_merge.py [--quick] [--out benchmarks/results]

Sessions: a main agent whose 8-20K-token system+tools prompt grows to 32-64K tokens over 50 or 200 turns, one
compaction at 60 % of the turns, and two sub-agents with their own prompts interleaved with it; prompts are built by
concatenation, so consecutive prompts share their int objects and message dicts as a decoded capture journal's do.
Builders: per_request and prefix_merging (ours), and ``baseline``, written here from REFERENCE.md's description of
the public reference builder: per completion it deep-copies the prompt messages and tool schemas, joins the chain
whose last prompt is a strict token prefix, and drops completions after a prefix break instead of starting a new
chain. Printed: time, peak memory (tracemalloc, a separate run), traces; ratios against the targets (4x the turns ->
at most 4.5x the time; at least 5x faster than the baseline at 200 turns; peak memory a small multiple of the
session's unique tokens) and the fraction of completions each builder loses on 200-turn sessions with 0.5 % and 2 %
retries per turn (the issue measured 10 % and 35 % for the reference; ours must lose none). Last, prefix_merging
from 50 to 400 turns on clean sessions, on sessions where 30 % of the turns drift and on sessions where 30 % of the
turns are retried (``--growth-only`` runs just that): the growth factors and their ratios, target within 1.5x.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from polar_gym.merge.base import MergeConfig  # noqa: E402
from polar_gym.merge.per_request import per_request  # noqa: E402
from polar_gym.merge.prefix_merging import prefix_merging  # noqa: E402
from polar_gym.schema import CompletionRecord, CompletionSession  # noqa: E402

EOT = 151645  # <|im_end|>
VOCAB = 151000
CONFIG = MergeConfig(end_of_turn_ids=(EOT, 151643))
BYTES_PER_TOKEN = 12  # the least a trace needs per token: a 4-byte id and an 8-byte logprob


# -- session generator -----------------------------------------------------------------------------------------
@dataclass
class Generated:
    session: CompletionSession
    unique_tokens: int
    summed_prompt_tokens: int
    discarded: set[str] = field(default_factory=set)  # answers a harness retry threw away


def _tools(rng: random.Random, n: int = 20) -> list[dict[str, Any]]:
    """Claude Code's 24 tool schemas from a recorded request, as chat tools; synthetic ones of that shape without."""
    recorded = sorted((ROOT / "tests" / "data" / "harness" / "claude_code").glob("*.json"))
    if recorded:
        tools = json.loads(recorded[-1].read_text())["body"]["tools"]
        return [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                  "parameters": t.get("input_schema", {})}} for t in tools]

    def prop(i: int) -> dict[str, Any]:
        return {"type": rng.choice(["string", "integer", "boolean"]), "description": f"parameter {i} " * 6}
    return [{"type": "function", "function": {
        "name": f"tool_{t}", "description": f"what tool {t} does, in detail. " * 12,
        "parameters": {"type": "object", "properties": {f"arg{i}": prop(i) for i in range(rng.randint(2, 7))},
                       "required": ["arg0"], "additionalProperties": False}}} for t in range(n)]


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


class _Agent:
    """One agent's append-only conversation: its token prompt, messages, clock and records."""

    def __init__(self, gen: _Session, name: str, system: int, start: float) -> None:
        self.gen, self.name, self.t = gen, name, start
        self.system = gen.tokens(system)
        self.prompt = [*self.system, *gen.tokens(200)]
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": "s" * 4 * system},
                                               {"role": "user", "content": [_text("<system-reminder>"),
                                                                            _text(f"task of {name}")]}]
        gen.unique += len(self.prompt)

    def turn(self, reply: int, result: int) -> None:
        gen = self.gen
        drift = gen.drift_rate > 0 and gen.rng.random() < gen.drift_rate
        attempts = 2 if gen.rng.random() < gen.retry_rate else 1
        for attempt in range(attempts):
            response = [*gen.tokens(reply - 1), EOT]
            seconds = gen.rng.uniform(0.5, 4.0)
            cid = gen.record(self, response, seconds)
            gen.unique += len(response)
            if attempt < attempts - 1:
                gen.discarded.add(cid)  # the harness threw this answer away and sent the prompt again
            self.t += seconds + gen.rng.uniform(0.05, 0.5)
        bridge = gen.tokens(result)
        if drift:  # the next prompt re-tokenizes the reply non-canonically: one sampled token becomes two
            k = gen.rng.randrange(len(response) - 1)
            response = [*response[:k], *gen.tokens(2), *response[k + 1:]]
        self.prompt = self.prompt + response + bridge  # shares the int objects, as a decoded journal does
        call = f"toolu_{len(self.messages)}"
        self.messages = [*self.messages,  # the normalized chat form of a Claude Code turn
                         {"role": "assistant", "content": [_text("a" * 4 * reply)],
                          "tool_calls": [{"id": call, "type": "function",
                                          "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}]},
                         {"role": "tool", "tool_call_id": call, "content": [_text("r" * 4 * result)]}]
        gen.unique += len(bridge)

    def compact(self, summary: int) -> None:
        self.prompt = [*self.system, *self.gen.tokens(summary)]
        self.messages = [self.messages[0], {"role": "user", "content": "summary " * summary}]
        self.gen.unique += summary


class _Session:
    def __init__(self, seed: int, retry_rate: float, drift_rate: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.retry_rate = retry_rate
        self.drift_rate = drift_rate
        self.tools = _tools(self.rng)
        self.calls: list[tuple[float, CompletionRecord]] = []
        self.discarded: set[str] = set()
        self.unique = 0

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def record(self, agent: _Agent, response: list[int], seconds: float) -> str:
        cid = f"{agent.name}-{len(self.calls)}"
        rec = CompletionRecord.model_construct(
            completion_id=cid, session_id="bench", index=-1, provider="openai_chat", engine="vllm",
            normalized_request={"model": "policy", "messages": agent.messages, "tools": self.tools},
            response={"message": {"role": "assistant", "content": "a" * 4 * len(response)}},
            prompt_ids=agent.prompt, response_ids=response,
            response_logprobs=[-self.rng.random() for _ in response], finish_reason="stop",
            started_at=agent.t, total_seconds=seconds)
        self.calls.append((agent.t + seconds, rec))
        return cid


def generate(turns: int, seed: int, system: int, context: int, retry_rate: float = 0.0,
             drift_rate: float = 0.0) -> Generated:
    """A main agent of ``turns`` turns from a ``system``-token prompt to ``context`` tokens, compacted at 60 %, with
    two sub-agents of turns/10 turns each running alongside it from 30 % and 35 % of the way. ``drift_rate`` of the
    turns are re-rendered non-canonically in the next prompt (each one a chain break in break mode)."""
    gen = _Session(seed, retry_rate, drift_rate)
    compact_at = int(turns * 0.6)
    growth = (context - system) // compact_at
    main = _Agent(gen, "main", system, 0.0)
    subs: list[tuple[int, _Agent]] = []
    for k in range(turns):
        if k == compact_at:
            main.compact(2000)
        for at in (int(turns * 0.3), int(turns * 0.35)):
            if k == at:
                subs.append((turns // 10 + 3, _Agent(gen, f"sub{len(subs)}", gen.rng.randint(4000, 6000), main.t)))
        reply = gen.rng.randint(growth // 8, growth // 3)
        main.turn(reply, growth - reply)
        for n, (left, sub) in enumerate(subs):
            if left and sub.t <= main.t:  # the sub-agents call while the main agent waits on its tools
                sub.turn(gen.rng.randint(50, 300), gen.rng.randint(100, 800))
                subs[n] = (left - 1, sub)
    records = []
    for index, (_, rec) in enumerate(sorted(gen.calls, key=lambda c: c[0])):  # journal order: as they finish
        rec.index = index
        records.append(rec)
    summed = sum(len(r.prompt_ids) for r in records)
    return Generated(CompletionSession.model_construct(session_id="bench", completions=records, metadata={}),
                     gen.unique, summed, gen.discarded)


# -- the reference-like baseline -------------------------------------------------------------------------------
@dataclass
class _BaseChain:
    first: CompletionRecord
    last: CompletionRecord
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    messages: list[Any]
    tools: list[Any]
    ids: list[str]
    broken: bool = False


def baseline(session: CompletionSession, eot: tuple[int, ...] = CONFIG.end_of_turn_ids,
             copy_messages: bool = True) -> dict[str, Any]:
    """prefix_merging the way REFERENCE.md describes the public reference: deep copies per completion, strict
    prefix joins (longest wins), and after a prefix break inside a chain the rest of that chain is dropped."""
    eots = set(eot)
    chains: list[_BaseChain] = []
    dropped: list[str] = []
    for rec in sorted(session.completions, key=lambda r: r.index):
        if rec.status != "ok" or not rec.token_faithful or not rec.response_ids:
            continue
        request = rec.normalized_request
        messages = copy.deepcopy(request.get("messages", [])) if copy_messages else request.get("messages", [])
        tools = copy.deepcopy(request.get("tools", [])) if copy_messages else request.get("tools", [])
        q = rec.prompt_ids
        best: _BaseChain | None = None
        for chain in chains:
            p = chain.last.prompt_ids
            if len(p) < len(q) and q[:len(p)] == p and (best is None or len(p) > len(best.last.prompt_ids)):
                best = chain
        if best is None:
            owner = next((c for c in chains if q[:len(c.first.prompt_ids)] == c.first.prompt_ids), None)
            if owner is not None:  # a prefix break inside a chain: the chain ends here
                owner.broken = True
                dropped.append(rec.completion_id)
                continue
            chains.append(_BaseChain(rec, rec, list(rec.response_ids), [1] * len(rec.response_ids),
                                     list(rec.response_logprobs), messages, tools, [rec.completion_id]))
            continue
        if best.broken:
            dropped.append(rec.completion_id)
            continue
        n, a = len(best.last.prompt_ids), best.last.response_ids
        end = next((i for i in range(n, len(q)) if q[i] in eots), len(q))
        bridge = q[end + 1:] if a and a[-1] in eots else q[end:]
        best.response_ids += bridge + rec.response_ids
        best.loss_mask += [0] * len(bridge) + [1] * len(rec.response_ids)
        best.logprobs += [0.0] * len(bridge) + rec.response_logprobs
        best.last, best.messages, best.tools = rec, messages, tools
        best.ids.append(rec.completion_id)
    traces = [{"prompt_ids": c.first.prompt_ids, "response_ids": c.response_ids, "loss_mask": c.loss_mask,
               "response_logprobs": [{"token": None, "token_id": t, "logprob": lp}
                                     for t, lp in zip(c.response_ids, c.logprobs, strict=True)],
               "prompt_messages": c.first.normalized_request.get("messages", []), "messages": c.messages,
               "tools": c.tools, "completion_ids": c.ids} for c in chains]
    return {"traces": traces, "dropped": dropped}


# -- measurement -----------------------------------------------------------------------------------------------
Builder = Callable[[CompletionSession], Any]
BUILDERS: dict[str, Builder] = {
    "per_request": lambda s: per_request(s, CONFIG),
    "prefix_merging": lambda s: prefix_merging(s, CONFIG),
    "baseline": baseline,
}


def traces_of(result: Any) -> int:
    return len(result["traces"]) if isinstance(result, dict) else len(result.traces)


def timed(build: Builder, session: CompletionSession, repeat: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        result = build(session)
        best = min(best, time.perf_counter() - t0)
        del result
    return best, build(session)


def peak_memory(build: Builder, session: CompletionSession) -> int:
    """Peak bytes allocated while building (the session itself already exists and is not counted)."""
    gc.collect()
    tracemalloc.start()
    result = build(session)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del result
    return peak


def bench_scaling(seeds: list[int], repeat: int) -> list[dict[str, Any]]:
    rows = []
    for seed in seeds:
        rng = random.Random(1000 + seed)
        system, context = rng.randint(8000, 20000), rng.randint(32000, 64000)
        for turns in (50, 200):
            gen = generate(turns, seed, system, context)
            for name, build in BUILDERS.items():
                seconds, result = timed(build, gen.session, repeat)
                row = {"seed": seed, "turns": turns, "builder": name, "completions": len(gen.session.completions),
                       "system_tokens": system, "context_tokens": context, "unique_tokens": gen.unique_tokens,
                       "summed_prompt_tokens": gen.summed_prompt_tokens, "seconds": seconds,
                       "traces": traces_of(result), "peak_bytes": peak_memory(build, gen.session)}
                row["bytes_per_unique_token"] = row["peak_bytes"] / gen.unique_tokens
                rows.append(row)
                print(f"seed {seed} {turns:>3} turns {row['completions']:>3} calls {gen.unique_tokens / 1e3:6.1f}K "
                      f"unique {gen.summed_prompt_tokens / 1e6:5.2f}M summed  {name:<15} {seconds * 1e3:8.1f} ms  "
                      f"peak {row['peak_bytes'] / 2**20:7.1f} MiB ({row['bytes_per_unique_token']:6.1f} B/unique "
                      f"token)  traces {row['traces']}", flush=True)
            del gen
    return rows


def bench_loss(rates: list[float], sessions: int) -> list[dict[str, Any]]:
    """Completions the harness used (not retried away) that end up in no trace, and discarded answers trained."""
    rows = []
    for rate in rates:
        lost = {"baseline": 0, "prefix_merging": 0}
        trained_discarded = {"baseline": 0, "prefix_merging": 0}
        used_total = 0
        for seed in range(sessions):
            rng = random.Random(5000 + seed)
            gen = generate(200, 100 + seed, rng.randint(8000, 20000), rng.randint(32000, 64000), rate)
            used = {r.completion_id for r in gen.session.completions} - gen.discarded
            used_total += len(used)
            base = baseline(gen.session, copy_messages=False)
            ours = prefix_merging(gen.session, CONFIG)
            for name, trained in (("baseline", {c for t in base["traces"] for c in t["completion_ids"]}),
                                  ("prefix_merging", {c for t in ours.traces for c in t.metadata["completion_ids"]})):
                lost[name] += len(used - trained)
                trained_discarded[name] += len(trained & gen.discarded)
        row = {"retry_rate": rate, "sessions": sessions, "used_completions": used_total,
               **{f"{k}_lost": v / used_total for k, v in lost.items()},
               **{f"{k}_trained_discarded": v for k, v in trained_discarded.items()}}
        rows.append(row)
        print(f"retries {rate * 100:.1f} %/turn, {sessions} sessions of 200 turns: baseline loses "
              f"{row['baseline_lost'] * 100:5.1f} % of used completions and trains {row['baseline_trained_discarded']} "
              f"discarded answers; prefix_merging loses {row['prefix_merging_lost'] * 100:.1f} % and trains "
              f"{row['prefix_merging_trained_discarded']}", flush=True)
    return rows


def bench_growth(seeds: list[int], repeat: int, rate: float = 0.3) -> dict[str, Any]:
    """prefix_merging's time from 50 to 400 turns on clean sessions, on sessions where ``rate`` of the turns drift,
    and on sessions where ``rate`` of the turns are retried: finding a completion's chain must not cost more as drift
    leaves chains behind, nor telling retries apart as they pile up (target: each growth factor within 1.5x of the
    clean one, i.e. linear in the session's length as the clean build is)."""
    kinds = {"clean": {}, "drifting": {"drift_rate": rate}, "retrying": {"retry_rate": rate}}
    times: dict[tuple[str, int], list[float]] = {}
    traces: dict[tuple[str, int], list[int]] = {}
    for seed in seeds:
        rng = random.Random(3000 + seed)
        system, context = rng.randint(8000, 20000), rng.randint(32000, 64000)
        for kind, options in kinds.items():
            for turns in (50, 400):
                gen = generate(turns, seed, system, context, **options)
                seconds, result = timed(BUILDERS["prefix_merging"], gen.session, repeat)
                times.setdefault((kind, turns), []).append(seconds)
                traces.setdefault((kind, turns), []).append(traces_of(result))
                print(f"seed {seed} {kind:<8} {turns:>3} turns {len(gen.session.completions):>3} calls  "
                      f"prefix_merging {seconds * 1e3:8.1f} ms  traces {traces_of(result)}", flush=True)
                del gen, result
    growth = {kind: statistics.mean(times[(kind, 400)]) / statistics.mean(times[(kind, 50)]) for kind in kinds}
    ratios = {kind: growth[kind] / growth["clean"] for kind in kinds if kind != "clean"}
    for kind in growth:
        print(f"{kind:<8} 50 turns {statistics.mean(times[(kind, 50)]) * 1e3:8.1f} ms  400 turns "
              f"{statistics.mean(times[(kind, 400)]) * 1e3:8.1f} ms  growth x{growth[kind]:.1f}")
    for kind, ratio in ratios.items():
        print(f"{kind} ({rate * 100:.0f} % of turns) grows {ratio:.2f}x the clean growth factor (target <= 1.5x): "
              f"{'MET' if ratio <= 1.5 else 'MISSED'}", flush=True)
    return {"rate": rate, "seconds": {f"{k}_{t}": statistics.mean(v) for (k, t), v in times.items()},
            "traces": {f"{k}_{t}": statistics.mean(v) for (k, t), v in traces.items()},
            "growth": growth, "growth_ratios": ratios, "target_met": all(r <= 1.5 for r in ratios.values())}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def mean(turns: int, builder: str, key: str) -> float:
        return statistics.mean(r[key] for r in rows if r["turns"] == turns and r["builder"] == builder)

    out: dict[str, Any] = {}
    print(f"\n{'builder':<15} {'50 turns':>10} {'200 turns':>10} {'time x':>8} {'unique x':>9} {'summed x':>9} "
          f"{'B/unique tok':>13} {'x min':>6} {'traces 200':>11}")
    for builder in BUILDERS:
        t50, t200 = mean(50, builder, "seconds"), mean(200, builder, "seconds")
        unique_x = mean(200, builder, "unique_tokens") / mean(50, builder, "unique_tokens")
        summed_x = mean(200, builder, "summed_prompt_tokens") / mean(50, builder, "summed_prompt_tokens")
        per_token = mean(200, builder, "bytes_per_unique_token")
        out[builder] = {"seconds_50": t50, "seconds_200": t200, "time_ratio": t200 / t50, "unique_ratio": unique_x,
                        "summed_prompt_ratio": summed_x, "bytes_per_unique_token": per_token,
                        "memory_multiple": per_token / BYTES_PER_TOKEN, "traces_200": mean(200, builder, "traces")}
        print(f"{builder:<15} {t50 * 1e3:8.1f}ms {t200 * 1e3:8.1f}ms {t200 / t50:8.2f} {unique_x:9.2f} "
              f"{summed_x:9.2f} {per_token:13.1f} {per_token / BYTES_PER_TOKEN:6.1f} "
              f"{out[builder]['traces_200']:11.1f}")
    ours, base = out["prefix_merging"], out["baseline"]
    speedup = base["seconds_200"] / ours["seconds_200"]
    out["targets"] = {
        "time_ratio_at_most_4.5": {b: out[b]["time_ratio"] <= 4.5 for b in ("per_request", "prefix_merging")},
        "speedup_vs_baseline_200": speedup, "speedup_at_least_5": speedup >= 5,
        "memory_multiple_prefix_merging": ours["memory_multiple"],
    }
    print(f"\n4x the turns -> prefix_merging {ours['time_ratio']:.2f}x, per_request "
          f"{out['per_request']['time_ratio']:.2f}x the time (target <= 4.5x): "
          f"{'MET' if all(out['targets']['time_ratio_at_most_4.5'].values()) else 'MISSED'}")
    print(f"200 turns: prefix_merging {speedup:.1f}x faster than the baseline (target >= 5x): "
          f"{'MET' if speedup >= 5 else 'MISSED'}")
    print(f"peak memory: prefix_merging {ours['bytes_per_unique_token']:.0f} B per unique token = "
          f"{ours['memory_multiple']:.1f}x the {BYTES_PER_TOKEN}-byte minimum (id + logprob)")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one seed, fewer loss sessions")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--growth-only", action="store_true",
                        help="only the 50-to-400-turn growth section (clean, drifting, retrying)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = [0] if args.quick else [0, 1, 2]
    if args.growth_only:
        growth = bench_growth(seeds, repeat=1 if args.quick else 3)
        (args.out / "bench_merge_growth.json").write_text(json.dumps(growth, indent=1))
        return 0
    rows = bench_scaling(seeds, repeat=1 if args.quick else 3)
    summary = summarize(rows)
    print()
    loss = bench_loss([0.005, 0.02], 4 if args.quick else 20)
    print()
    growth = bench_growth(seeds, repeat=1 if args.quick else 3)
    result = {"scaling": rows, "summary": summary, "loss": loss, "growth": growth}
    (args.out / "bench_merge.json").write_text(json.dumps(result, indent=1))
    print(f"results: {args.out / 'bench_merge.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
