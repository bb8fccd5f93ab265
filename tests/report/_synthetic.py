"""Constructed runs for the report's tests: results.jsonl rows shaped as a launch writes them (``result_row``), with
status histories on a made-up clock, and a writer for a whole run folder (results.jsonl, trajectories.jsonl with
real traces, config.yaml, a session folder with a harness's stderr)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from polar_gym.schema import Trace

__all__ = ["HOSTILE", "row", "synthetic_rows", "trace_line", "write_run"]

#: what a sandboxed agent may write into its stderr, a task id or a reason
HOSTILE = "<script>window.__pwned = 1</script></svg></pre><img src=x onerror=alert(1)>\x1b[31m\x00\x07 & $x$"


def row(session_id: str, task_id: str, *, status: str = "COMPLETED", reward: float | None = 1.0,
        cause: str | None = None, reason: str | None = None, start: float = 1000.0,
        stages: tuple[float, float, float, float] = (0.01, 0.2, 5.0, 0.5), sample_index: int = 0,
        harness_status: str = "ok", exit_code: int | None = 0, session_dir: str | None = None,
        traces: int = 1, chains: int = 1, breaks: dict[str, int] | None = None) -> dict[str, Any]:
    """One results.jsonl line: its stages (queued, init, run, postrun seconds) laid out from ``start``."""
    names = [("REGISTERED", "queued"), ("INITIALIZING", "init"), ("RUNNING", "run"), ("POST_RUN", "postrun")]
    at, history = start, []
    for (state, stage), seconds in zip(names, stages, strict=True):
        history.append({"status": state, "stage": stage, "at": at})
        at += seconds
    history.append({"status": status, "stage": "done", "at": at})
    timings = dict(zip(["queued", "init", "run", "postrun"], stages, strict=True))
    metadata: dict[str, Any] = {"sample_index": sample_index, "status_history": history,
                                "harness": {"status": harness_status, "exit_code": exit_code},
                                "artifacts": {"error_cause": cause} if cause else {}}
    if session_dir is not None:
        metadata["session_dir"] = session_dir
    diagnostics = {"chains": chains, "breaks": breaks or {}, "traces": traces, "trainable_tokens": 10 * traces,
                   "masked_tokens": 3 * traces, "prompt_tokens": 50 * traces, "superseded": [],
                   "rerender_merged": 0, "traces_without_logprobs": 0}
    return {"session_id": session_id, "task_id": task_id, "status": status, "reason": reason,
            "evaluation": None if reward is None else {"reward": reward}, "timings": {**timings, "total": at - start},
            "metadata": metadata, "harness": "pi", "traces": traces, "completions": 2 * traces,
            "seconds": round(at - start, 3), "error_cause": cause, "trajectory_diagnostics": diagnostics}


def synthetic_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` sessions over 50 tasks: most complete, some fail by cause (infrastructure ones included)."""
    pick = random.Random(seed)
    rows = []
    for i in range(n):
        fate = pick.random()
        status, cause, reward = "COMPLETED", None, float(pick.random() < 0.6)
        if fate < 0.05:
            status, cause, reward = "ERROR", "upstream_unreachable", None
        elif fate < 0.08:
            status, cause, reward = "TIMEOUT", "timeout", 0.0
        elif fate < 0.1:
            status, cause, reward = "ERROR", "init_failed", None
        rows.append(row(f"s{i}", f"task-{i % 50}", status=status, reward=reward, cause=cause,
                        reason=f"{cause}: synthetic" if cause else None, start=1000.0 + i * 0.7,
                        stages=(pick.uniform(0, 2), pick.uniform(0.1, 1), pick.uniform(2, 60), pick.uniform(0.2, 3)),
                        sample_index=i // 50, traces=pick.randint(1, 3), chains=pick.randint(1, 3),
                        breaks={"drift": 1} if pick.random() < 0.2 else {}))
    return rows


def trace_line(session_id: str, index: int, *, prompt_mode: str = "token_in") -> dict[str, Any]:
    """One trajectories.jsonl line with a real Trace: two model calls (3 sampled tokens) and a masked bridge."""
    trace = Trace(prompt_ids=[1, 2, 3], response_ids=[4, 5, 6, 7], loss_mask=[1, 1, 0, 1],
                  response_logprobs=[-0.1, -0.2, 0.0, -0.3],
                  metadata={"spans": [{"completion_id": "c1", "start": 0, "end": 2, "prompt_mode": prompt_mode},
                                      {"completion_id": "c2", "start": 3, "end": 4, "prompt_mode": prompt_mode}]})
    return {"session_id": session_id, "trace_index": index, **trace.model_dump(mode="json")}


def write_run(out: Path, rows: list[dict[str, Any]], traces: list[dict[str, Any]] | None = None,
              config: str = "harness:\n  name: pi\n") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if traces is not None:
        (out / "trajectories.jsonl").write_text("".join(json.dumps(t) + "\n" for t in traces))
    (out / "config.yaml").write_text(config)
    return out
