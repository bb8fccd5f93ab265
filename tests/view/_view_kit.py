"""Runs written by hand for the viewer's tests and benchmark: results.jsonl, trajectories.jsonl and a capture journal
in exactly the shapes ``launch`` writes them (the journal through polar_gym.journal's own encoder), with as many
turns, chains and as hostile a content as a test needs. Also: starting ``python -m polar_gym.view`` as a process.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import random
import re
import socket
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_gym.journal import CURRENT_ATTEMPT, LOGPROBS_FILE, RECORDS_FILE, TOKENS_FILE, SessionStore
from polar_gym.schema import CompletionRecord
from polar_gym.serving import free_port
from polar_gym.tasks.demo import solid_png
from tests._waiting import until_sync

__all__ = ["HOSTILE", "PNG_URL", "FakeSession", "make_session", "running_viewer", "with_images", "write_run"]

HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class FakeSession:
    result: dict[str, Any]
    traces: list[dict[str, Any]]
    records: list[CompletionRecord] = field(default_factory=list)

    @property
    def session_id(self) -> str:
        return str(self.result["session_id"])


def make_session(session_id: str, task_id: str = "task-a", *, turns: int = 3, chains: int = 1, harness: str = "pi",
                 status: str = "COMPLETED", reward: float | None = 1.0, error_cause: str | None = None,
                 content: str = "done", assistant_tokens: int = 40, tool_tokens: int = 40, prompt_tokens: int = 60,
                 seed: int = 0) -> FakeSession:
    """A session of ``turns`` model calls split over ``chains`` traces (chain 0 is ``first``, the others start on
    ``drift``). Each call samples ``assistant_tokens`` (mask 1, logprobs < 0) and then a tool answers with
    ``tool_tokens`` (mask 0). ``content`` is the final answer's text and the tool's output."""
    rng = random.Random(seed)
    per_chain = [turns // chains + (1 if c < turns % chains else 0) for c in range(chains)]
    traces, records, call, started = [], [], 0, 1_700_000_000.0
    for chain, n in enumerate(per_chain):
        prompt = [rng.randrange(100, 20_000) for _ in range(prompt_tokens)]
        response: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        spans, messages = [], []
        for turn in range(n):
            sampled = [rng.randrange(100, 20_000) for _ in range(assistant_tokens)]
            lps = [round(-rng.random() * 3, 6) for _ in sampled]
            start = len(response)
            cid = f"c{call:05d}"
            record_prompt = prompt + response
            response += sampled
            mask += [1] * len(sampled)
            logprobs += lps
            spans.append({"completion_id": cid, "start": start, "end": len(response), "policy_version": chain,
                          "engine": "oracle", "server": "oracle://local", "prompt_mode": "token_in"})
            records.append(CompletionRecord(
                completion_id=cid, session_id=session_id, index=call, provider="openai_chat", engine="oracle",
                server="oracle://local", policy_version=chain, prompt_ids=record_prompt, response_ids=sampled,
                response_logprobs=lps, finish_reason="tool_calls", prompt_mode="token_in",
                started_at=started + call, upstream_seconds=0.01 * (call + 1), total_seconds=0.02 * (call + 1)))
            call += 1
            last = turn == n - 1
            if last:
                messages.append({"role": "assistant", "content": content})
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [{
                    "id": f"call_{cid}", "type": "function",
                    "function": {"name": "bash", "arguments": json.dumps({"command": f"echo {turn}"})}}]})
                messages.append({"role": "tool", "tool_call_id": f"call_{cid}", "content": content})
                tool = [rng.randrange(100, 20_000) for _ in range(tool_tokens)]
                response += tool
                mask += [0] * len(tool)
                logprobs += [0.0] * len(tool)
        traces.append({
            "session_id": session_id, "task_id": task_id, "sample_index": 0, "harness": harness,
            "builder": "prefix_merging", "status": status, "session_reward": reward, "trace_index": chain,
            "prompt_ids": prompt, "response_ids": response, "loss_mask": mask,
            "response_logprobs": [{"token": None, "token_id": i, "logprob": lp} for i, lp in zip(response, logprobs,
                                                                                                   strict=True)],
            "prompt_messages": [{"role": "system", "content": "you are a test"},
                                {"role": "user", "content": f"task {task_id}"}],
            "response_messages": messages, "tools": [], "finish_reason": "stop", "reward": reward,
            "metadata": {"session_id": session_id, "chain": chain, "chain_cause": "first" if chain == 0 else "drift",
                         "spans": spans, "policy_versions": [chain], "side_request": False}})
    diagnostics = {"completions": turns, "chains": chains, "completions_merged": turns - chains,
                   "breaks": {"drift": chains - 1} if chains > 1 else {}, "traces": chains,
                   "trainable_tokens": sum(sum(t["loss_mask"]) for t in traces),
                   "masked_tokens": sum(len(t["loss_mask"]) - sum(t["loss_mask"]) for t in traces)}
    result = {"session_id": session_id, "task_id": task_id, "status": status,
              "reason": None if status == "COMPLETED" else f"run: {content}",
              "evaluation": {"reward": reward, "passed": bool(reward)} if reward is not None else None,
              "timings": {"init": 0.5, "run": 3.0, "postrun": 0.2, "total": 3.7},
              "metadata": {"sample_index": 0, "status_history": [{"status": "REGISTERED", "stage": "queued",
                                                                   "at": started}, {"status": status, "stage": "done",
                                                                                    "at": started + 3.7}]},
              "harness": harness, "traces": chains, "completions": turns, "seconds": 3.7, "error_cause": error_cause,
              "trajectory_diagnostics": diagnostics}
    return FakeSession(result, traces, records)


#: a 2x2 PNG as a data URL (the card of the multimodal demo task, smaller)
PNG_URL = "data:image/png;base64," + base64.b64encode(solid_png(2, 2, (30, 60, 220))).decode()
_PAD = 151655


def with_images(session: FakeSession, urls: list[str], placeholders: int = 6) -> FakeSession:
    """``session`` with an image part per URL in its first trace's user message, each image's run of placeholder
    tokens at the head of that trace's prompt and its span in ``metadata.images``, as builders write them."""
    trace = session.traces[0]
    parts: list[dict[str, Any]] = [{"type": "text", "text": "look at these"}]
    images, prompt = [], []
    for url in urls:
        parts.append({"type": "image_url", "image_url": {"url": url}})
        start = len(prompt) + 1
        prompt += [151652, *([_PAD] * placeholders), 151653]
        images.append({"sha256": hashlib.sha256(url.encode()).hexdigest(), "media_type": "image/png", "size": 9,
                       "prompt_span": {"start": start, "end": start + placeholders}})
    trace["prompt_ids"] = prompt + trace["prompt_ids"]
    trace["prompt_messages"][1] = {"role": "user", "content": parts}
    trace["metadata"]["images"] = images
    return session


def write_run(out_dir: Path, sessions: list[FakeSession]) -> Path:
    """A run's folder holding ``sessions``: results.jsonl, trajectories.jsonl, capture/<session>/attempts/a1/."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "results.jsonl").open("w") as fh:
        for s in sessions:
            fh.write(json.dumps(s.result) + "\n")
    with (out_dir / "trajectories.jsonl").open("w") as fh:
        for s in sessions:
            for trace in s.traces:
                fh.write(json.dumps(trace) + "\n")
    for s in sessions:
        if not s.records:
            continue
        session_dir = out_dir / "capture" / s.session_id
        stream = session_dir / "attempts" / "a1"
        stream.mkdir(parents=True, exist_ok=True)
        (session_dir / CURRENT_ATTEMPT).write_text("a1")
        store = SessionStore()
        with (stream / RECORDS_FILE).open("wb") as lines, (stream / TOKENS_FILE).open("wb") as tokens, \
                (stream / LOGPROBS_FILE).open("wb") as lps:
            for record in s.records:
                line, token_bytes, logprob_bytes = store.encode(record)
                tokens.write(token_bytes)
                lps.write(logprob_bytes)
                lines.write(line)
    return out_dir


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


def printed_url(output: str) -> str | None:
    """The URL the viewer printed (with its one-time token unless started with --no-token)."""
    found = re.search(r"polar_gym viewer of .*: (http://\S+)", output)
    return found.group(1) if found else None


@contextlib.contextmanager
def running_viewer(out_dir: Path, *extra: str, port: int | None = None
                   ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``python -m polar_gym.view OUT_DIR`` on a free loopback port (``port=0``: no ``--port``, the viewer picks
    one); yields (the URL it printed, process) once it listens."""
    chosen = free_port() if port is None else port
    log = out_dir.parent / f"viewer-{chosen or free_port()}.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "polar_gym.view", str(out_dir),
                                 *(("--port", str(chosen)) if chosen else ()), *extra],
                                cwd=_ROOT, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ,
                                                                                      "PYTHONUNBUFFERED": "1"})
    try:
        until_sync(lambda: proc.poll() is not None or printed_url(log.read_text()) is not None, timeout=60,
                   what="the viewer to print its URL")
        if proc.poll() is not None:
            raise AssertionError(f"the viewer exited: {log.read_text()[-3000:]}")
        url = printed_url(log.read_text())
        assert url is not None and url.startswith("http://127.0.0.1:")
        listening = urllib.parse.urlsplit(url).port
        assert listening and (not chosen or listening == chosen)
        until_sync(lambda: _listening(listening), timeout=10, what="the viewer to listen")
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
