"""bench_scale's workload and analysis, pure: the scripted harness and each session's stage durations as a
TaskRequest, and the numbers read from the rollout server's store afterwards (slot use over time, scheduling
latencies, the ideal makespan). Kept apart so the benchmark's driver stays small and tests can read these alone."""

from __future__ import annotations

import contextlib
import json
import math
import random
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polar_gym.result_codec import without_tokens
from polar_gym.schema import AgentSpec, BuilderSpec, EvaluatorSpec, PrepareAction, RuntimeSpec, TaskRequest

__all__ = ["AGENT", "OUTPUT_SOURCE", "OUTPUT_SPAN", "SYSTEM", "Plan", "analyse", "dist", "draw_plan", "make_task",
           "percentile", "refill_latencies", "session_rows", "slot_series", "split", "stamps", "use_stats"]

#: the scripted harness: a minimal agent loop (chat completions with one bash tool; stdlib only)
AGENT = r'''
import json, os, subprocess, urllib.request
url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
headers = {"authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"}
tools = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command in the repository.",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
messages = [{"role": "system", "content": os.environ.get("AGENT_SYSTEM", "")},
            {"role": "user", "content": os.environ["POLAR_INSTRUCTION"]}]
for _ in range(500):
    body = json.dumps({"model": os.environ["POLAR_MODEL"], "messages": messages, "tools": tools, "max_tokens": 512})
    with urllib.request.urlopen(urllib.request.Request(url, body.encode(), headers), timeout=600) as resp:
        reply = json.load(resp)["choices"][0]["message"]
    calls = reply.get("tool_calls") or []
    turn = {"role": "assistant", "content": reply.get("content") or ""}
    messages.append({**turn, "tool_calls": calls} if calls else turn)
    if not calls:
        break
    for call in calls:
        command = json.loads(call["function"]["arguments"])["command"]
        out = subprocess.run(command, shell=True, capture_output=True, text=True)
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": (out.stdout + out.stderr)[-100000:]})
print(reply.get("content"))
'''
SYSTEM = ("You are a coding agent working in a git repository. Use the bash tool to inspect files, run the tests "
          "and edit code; keep answers short. ") * 12  # ~1.3 KB, a small harness's system prompt


#: what a tool command prints, repeated (about 4 characters per token)
#: what a tool call prints: real code (the host Python's standard library, which the local sandbox sees), a different
#: stretch per call from ``OUTPUT_SPAN`` bytes of it, so results compress as real tool output does (one repeated
#: line, used before, compressed 100x and flattered every stored size)
OUTPUT_SOURCE = "/usr/lib/python3*/[a-z]*.py"
OUTPUT_SPAN = 4_000_000


# -- the workload (pure) -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """One session's durations in real seconds (before ``time_scale``) and its real turn count."""

    init: float
    turns: int
    run: float
    evaluate: float


def lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(median), sigma)


def draw_plan(rng: random.Random) -> Plan:
    """A SWE-style rollout's stages (docs/scaling.md: where each distribution comes from)."""
    turns = min(150, max(5, round(lognormal(rng, 40, 0.5))))
    run = sum(lognormal(rng, 5.0, 0.8) for _ in range(turns))
    return Plan(init=lognormal(rng, 12.0, 0.6), turns=turns, run=run, evaluate=lognormal(rng, 20.0, 0.7))


def split(total: float, parts: int, rng: random.Random) -> list[float]:
    """``total`` seconds cut into ``parts`` random pieces (tool commands between model calls)."""
    weights = [rng.uniform(0.5, 1.5) for _ in range(parts)]
    return [total * w / sum(weights) for w in weights]


def make_task(i: int, plan: Plan, scale: float, calls: int, rng: random.Random, callback_url: str | None,
              prefix: str = "scale", commands: list[str] | None = None, tool_output_bytes: int = 0) -> TaskRequest:
    """The session of ``plan`` as a TaskRequest: prepare sleeps INIT, the oracle plays ``calls - 1`` sleep commands
    worth RUN (or ``commands``), each printing ``tool_output_bytes`` of real code (what makes the trajectory as
    long as a real one's), then answers; the evaluator's test command sleeps EVALUATE."""
    if commands is None:
        def out() -> str:
            if not tool_output_bytes:
                return ""
            start = rng.randrange(1, max(2, OUTPUT_SPAN - tool_output_bytes))
            return f" && cat {OUTPUT_SOURCE} | tail -c +{start} | head -c {tool_output_bytes}"

        commands = [f"sleep {s:.3f}{out()}" for s in split(plan.run * scale, calls - 1, rng)] if calls > 1 else []
    return TaskRequest(
        task_id=f"{prefix}-{i:05d}", instruction="Fix the failing test in tests/test_parser.py; run the suite.",
        timeout_seconds=3600,
        runtime=RuntimeSpec(backend="local", network="gateway", prepare=[
            PrepareAction(type="exec", command=f"sleep {plan.init * scale:.3f}")]),
        agent=AgentSpec(harness="shell", config={"command": "python3 -B agent.py", "files": {"agent.py": AGENT},
                                                 "env": {"AGENT_SYSTEM": SYSTEM}}),
        builder=BuilderSpec(strategy="prefix_merging"),
        evaluator=EvaluatorSpec(strategy="test_on_output", config={
            "command": f"sleep {plan.evaluate * scale:.3f}", "framework": "none"}),
        callback_url=callback_url,
        metadata={"group_id": f"g{i}", "oracle": {"commands": commands, "final_answer": "Fixed."},
                  "plan": {"init": plan.init, "turns": plan.turns, "run": plan.run, "evaluate": plan.evaluate}})


# -- the analysis (pure) -------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def dist(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99/max/mean in milliseconds."""
    ms = [v * 1e3 for v in values]
    return {"n": len(ms), "p50_ms": percentile(ms, 0.5), "p90_ms": percentile(ms, 0.9),
            "p99_ms": percentile(ms, 0.99), "max_ms": max(ms, default=None),
            "mean_ms": sum(ms) / len(ms) if ms else None}


def stamps(result: dict[str, Any]) -> dict[str, float]:
    """The first time the session entered each status (the gateway's wall clock)."""
    out: dict[str, float] = {}
    for item in (result.get("metadata") or {}).get("status_history") or []:
        out.setdefault(item["status"], float(item["at"]))
    return out


def columns(con: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in con.execute(f"PRAGMA table_info({table})")}


def stored_result_bytes(db: Path, prefix: str = "scale-") -> dict[str, float]:
    """What the store keeps per result of the sessions whose task id starts with ``prefix``, packed (this tree) or
    as JSON (a baseline's store), against the results' unique token bytes (uint32 ids, float64 logprobs)."""
    from polar_gym.result_codec import head, pack, unique_token_bytes
    from polar_gym.schema import SessionResult

    with contextlib.closing(sqlite3.connect(db)) as con:
        packed = "packed" in columns(con, "sessions")
        rows = con.execute(f"SELECT {'packed, ' if packed else ''}result FROM sessions WHERE task_id LIKE ? AND "
                           "status = 'COMPLETED'", (prefix + "%",)).fetchall()
    sizes, unique = [], []
    for row in rows:
        blob = row[0] if packed and row[0] is not None else None
        text = row[-1]
        stored = blob if blob is not None else (text or "").encode()
        sizes.append(len(stored))
        unique.append(unique_token_bytes(head(blob if blob is not None
                                              else pack(SessionResult.model_validate_json(text)))))
    n = max(1, len(sizes))
    return {"results": len(sizes), "stored_bytes_per_result": sum(sizes) / n,
            "unique_token_bytes_per_result": sum(unique) / n,
            "stored_per_unique_token_byte": sum(sizes) / max(1, sum(unique))}


def session_rows(db: Path) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """One row per session from the server's store, and each gateway's registered capacity."""
    with contextlib.closing(sqlite3.connect(db)) as con:
        con.row_factory = sqlite3.Row
        packed = "s.packed" if "packed" in columns(con, "sessions") else "NULL AS packed"  # a baseline's store
        rows = con.execute("SELECT s.session_id, s.task_id, s.status, s.gateway_id, s.attempts, s.created, "
                           f"s.dispatched, s.finished, s.result, {packed}, t.request FROM sessions s JOIN tasks t "
                           "USING (task_id)").fetchall()
        slots = {r["gateway_id"]: r["capacity"] for r in con.execute("SELECT gateway_id, capacity FROM gateways")}
    out = []
    for r in rows:
        result = (without_tokens(r["packed"]) if r["packed"] is not None
                  else json.loads(r["result"]) if r["result"] else {})
        st = stamps(result)
        meta = json.loads(r["request"])["metadata"]
        out.append({"session_id": r["session_id"], "task_id": r["task_id"], "status": r["status"],
                    "gateway": r["gateway_id"], "attempts": r["attempts"], "created": r["created"],
                    "dispatched": r["dispatched"], "finished": r["finished"],
                    "init_at": st.get("INITIALIZING"), "running_at": st.get("RUNNING"),
                    "postrun_at": st.get("POST_RUN"), "done_at": st.get(r["status"]),
                    "timings": result.get("timings") or {}, "plan": meta.get("plan"),
                    "completions": ((result.get("metadata") or {}).get("artifacts") or {}).get("completions")})
    return out, slots


def slot_series(rows: list[dict[str, Any]], slots: dict[str, int], step: float) -> list[dict[str, Any]]:
    """Busy run slots per gateway and overall every ``step`` s from the first submit to the last harness end, with
    the backlog (sessions submitted and not yet running)."""
    ran = [r for r in rows if r["running_at"] and r["postrun_at"]]
    if not ran:
        return []
    t0 = min(r["created"] for r in rows)
    t1 = max(r["postrun_at"] for r in ran)
    series = []
    n = int((t1 - t0) / step) + 1
    for k in range(n):
        t = t0 + k * step
        busy = {g: 0 for g in slots}
        for r in ran:
            if r["running_at"] <= t < r["postrun_at"]:
                busy[r["gateway"]] = busy.get(r["gateway"], 0) + 1
        backlog = sum(1 for r in rows if r["created"] <= t and not (r["running_at"] and r["running_at"] <= t))
        series.append({"t": round(t - t0, 3), "busy": busy, "overall": sum(busy.values()) / sum(slots.values()),
                       "per_gateway": {g: busy[g] / slots[g] for g in slots}, "backlog": backlog})
    return series


def use_stats(series: list[dict[str, Any]], slots: dict[str, int]) -> dict[str, Any]:
    """Mean and p10 of slot use, overall and per gateway, over the makespan and while work was queued."""
    def stats(points: list[dict[str, Any]]) -> dict[str, Any]:
        overall = [p["overall"] for p in points]
        return {"mean": sum(overall) / len(overall) if overall else None, "p10": percentile(overall, 0.1),
                "per_gateway": {g: {"mean": sum(p["per_gateway"][g] for p in points) / len(points) if points else None,
                                    "p10": percentile([p["per_gateway"][g] for p in points], 0.1)} for g in slots}}
    return {"makespan": stats(series), "while_queued": stats([p for p in series if p["backlog"] > 0])}


def refill_latencies(rows: list[dict[str, Any]]) -> list[float]:
    """Per run slot freed while work was queued: seconds until the next harness started on that gateway."""
    out = []
    ran = [r for r in rows if r["running_at"] and r["postrun_at"]]
    starts: dict[str, list[float]] = {}
    for r in ran:
        starts.setdefault(r["gateway"], []).append(r["running_at"])
    for values in starts.values():
        values.sort()
    for r in ran:
        freed = r["postrun_at"]
        queued = any(o["created"] <= freed and (o["running_at"] or math.inf) >= freed for o in ran if o is not r)
        later = [s for s in starts[r["gateway"]] if s >= freed]
        if queued and later:
            out.append(later[0] - freed)
    return out


def analyse(rows: list[dict[str, Any]], slots: dict[str, int], scale: float, step: float) -> dict[str, Any]:
    done = [r for r in rows if r["running_at"] and r["postrun_at"]]
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    t0 = min(r["created"] for r in rows)
    makespan = max(r["finished"] or r["created"] for r in rows) - t0
    run_work = sum(r["postrun_at"] - r["running_at"] for r in done)
    total_slots = sum(slots.values())
    ideal = run_work / total_slots
    series = slot_series(rows, slots, step)
    stage_means = {k: sum((r["timings"].get(k) or 0.0) for r in rows) / len(rows)
                   for k in ("queued", "init", "ready_wait", "run", "postrun", "teardown", "total")}
    return {
        "sessions": len(rows), "statuses": statuses, "gateways": len(slots), "run_slots": slots,
        "total_slots": total_slots, "time_scale": scale, "makespan_s": makespan,
        "sessions_per_minute": len(rows) / makespan * 60,
        "ideal_makespan_s": ideal, "makespan_ratio": makespan / ideal,
        "run_work_s": run_work, "slot_use": use_stats(series, slots),
        "stage_means_s": stage_means,
        "latency": {
            "submitted_to_running": dist([r["running_at"] - r["created"] for r in done]),
            "submitted_to_dispatched": dist([r["dispatched"] - r["created"] for r in rows if r["dispatched"]]),
            "dispatched_to_running": dist([r["running_at"] - r["dispatched"] for r in done if r["dispatched"]]),
            "slot_freed_to_next_running": dist(refill_latencies(rows)),
        },
        "model_calls": sum(r["completions"] or 0 for r in rows),
        "real_turns_per_session": sum(r["plan"]["turns"] for r in rows) / len(rows),
        "real_run_seconds_mean": sum(r["plan"]["run"] for r in rows) / len(rows),
    }, series
