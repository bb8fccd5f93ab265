"""An LLM judge that scores traces against a rubric, batched across the sessions a gateway evaluates at once.

Where a judge lives is the operator's choice, never a task's: the gateway's ``judges`` setting names each one
(:class:`JudgeEndpoint`: an OpenAI-compatible base URL, a model, optionally a key file), and a task's evaluator
only names which judge to ask. Why: a task is untrusted input, and a URL it named would receive every trace of the
session (and the key). The judge may be an engine of the fleet (its ``/v1``) or any other server.

Batching: :class:`JudgeBatcher` queues the traces every concurrent evaluation asks about and sends up to
``batch_size`` of them (Polar upstream: 32) in one call, so a judge's prompt prefix and its queue are shared. A judge
that cannot be reached, answers an HTTP error, or answers anything but one score per trace in range is a
:class:`JudgeError` for every session of that call, with its cause (``judge_unreachable`` or ``judge_garbage``):
never a silent 0, which a trainer would read as the policy's failure.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from polar_gym.causes import JUDGE_GARBAGE, JUDGE_UNREACHABLE
from polar_gym.evaluate.errors import EvaluationError

__all__ = ["JUDGE_GARBAGE", "JUDGE_UNREACHABLE", "JudgeBatcher", "JudgeEndpoint", "JudgeError", "JudgeItem",
           "judge_prompt", "read_scores", "scores_regex", "transcript"]

#: characters of one trace's transcript shown to the judge (its end is kept: the outcome is there)
TRANSCRIPT_CHARS = 12_000


class JudgeEndpoint(BaseModel):
    """One judge the operator runs (``GatewayPools.judges``)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="OpenAI-compatible base URL, ending in /v1")
    model: str = Field(description="the model name to ask")
    api_key_file: Path | None = Field(default=None, description="a file holding the API key (none: no key)")
    batch_size: int = Field(default=32, ge=1, description="traces per judge call")
    batch_window_seconds: float = Field(default=0.2, ge=0, description="how long a call waits for more traces")
    timeout_seconds: float = Field(default=300.0, gt=0)
    max_tokens: int = Field(default=2048, ge=16)
    structured: Literal["vllm", "none"] = Field(
        default="vllm", description="vllm: the answer's shape is enforced while sampling (vLLM's structured_outputs "
        "regex, thinking off); none: a plain chat request, for servers that refuse vLLM's fields")


class JudgeError(EvaluationError):
    """The judge gave no usable score; ``cause`` names why (the session's error cause)."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class JudgeItem:
    """One trace to score: its transcript and the rubric (items of one call share the call's rubric)."""

    rubric: str
    text: str
    max_score: int


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def transcript(messages: list[dict[str, Any]], limit: int = TRANSCRIPT_CHARS) -> str:
    """A trace's conversation as the judge reads it: each message's role and text, tool calls with their
    arguments, tool outputs; the end kept when it is longer than ``limit``."""
    lines = []
    for m in messages:
        text = _text(m.get("content"))
        calls = [f"{c.get('function', {}).get('name')}({c.get('function', {}).get('arguments')})"
                 for c in m.get("tool_calls") or [] if isinstance(c, dict)]
        lines.append(f"[{m.get('role')}] {text}" + "".join(f"\n  -> call {c}" for c in calls))
    out = "\n".join(lines)
    return out if len(out) <= limit else "…" + out[-limit:]


def judge_prompt(items: list[JudgeItem]) -> list[dict[str, str]]:
    """The chat messages of one judge call over ``items`` (same rubric and scale)."""
    scale = items[0].max_score
    system = (f"You grade an AI agent's work against a rubric. Give each trace an integer score from 0 (worst) to "
              f"{scale} (best).\n\nRubric:\n{items[0].rubric}\n\nAnswer with JSON only, no other text: "
              f'{{"scores": [N0, N1, ...]}}, one score per trace, in the order of the traces.')
    body = "\n\n".join(f"### Trace {i}\n{item.text}" for i, item in enumerate(items))
    return [{"role": "system", "content": system}, {"role": "user", "content": body}]


def scores_regex(count: int, max_score: int) -> str:
    """A regular expression for exactly the answer scoring ``count`` traces, ``{"scores": [N, N, ...]}`` (a JSON
    schema leaves whitespace free, and a weak judge then samples whitespace until max_tokens)."""
    score = "(?:" + "|".join(str(n) for n in range(max_score, -1, -1)) + ")"
    return r'\{"scores": \[' + score + f"(?:, {score}){{{count - 1}}}" + r"\]\}"


def read_scores(answer: str, count: int, max_score: int) -> list[float]:
    """The scores in a judge's answer (the JSON object in it, code fences and thinking allowed around it): one
    number per trace in order, or ``{trace, score}`` entries; a JudgeError(judge_garbage) naming what is wrong when
    it does not hold one score in range per trace."""
    answer = re.sub(r"<think>.*?</think>", "", answer, flags=re.S)
    start, end = answer.find("{"), answer.rfind("}")
    try:
        data = json.loads(answer[start:end + 1]) if 0 <= start < end else None
    except ValueError:
        data = None
    entries = data.get("scores") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise JudgeError(JUDGE_GARBAGE, f"the judge's answer holds no {{\"scores\": [...]}} JSON: {answer[:200]!r}")
    scores: dict[int, float] = {}
    for position, entry in enumerate(entries):
        index, score = ((entry.get("trace"), entry.get("score")) if isinstance(entry, dict) else (position, entry))
        if (isinstance(index, int) and not isinstance(index, bool) and isinstance(score, int | float)
                and not isinstance(score, bool) and 0 <= score <= max_score):
            scores[index] = float(score)
    missing = [i for i in range(count) if i not in scores]
    if missing:
        raise JudgeError(JUDGE_GARBAGE, f"the judge gave no score from 0 to {max_score} for traces {missing} of "
                         f"{count}: {answer[:200]!r}")
    return [scores[i] for i in range(count)]


@dataclass
class _Pending:
    item: JudgeItem
    future: asyncio.Future[float]


@dataclass
class JudgeBatcher:
    """Scores traces for every evaluation of one gateway, ``batch_size`` per call (see the module docstring)."""

    endpoint: JudgeEndpoint
    client: httpx.AsyncClient | None = None
    _queue: list[_Pending] = field(default_factory=list)
    _flusher: asyncio.Task[None] | None = None

    async def score(self, items: list[JudgeItem]) -> list[float]:
        """One score per item, in order; JudgeError when the judge fails any call holding one of them."""
        loop = asyncio.get_running_loop()
        pending = [_Pending(item, loop.create_future()) for item in items]
        self._queue += pending
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return list(await asyncio.gather(*(p.future for p in pending)))

    async def _flush(self) -> None:
        while self._queue:
            if len(self._queue) < self.endpoint.batch_size:
                await asyncio.sleep(self.endpoint.batch_window_seconds)  # let concurrent evaluations join the call
            self._queue = [p for p in self._queue if not p.future.done()]  # an evaluation cancelled meanwhile
            if not self._queue:
                break
            rubric = (self._queue[0].item.rubric, self._queue[0].item.max_score)
            batch = [p for p in self._queue if (p.item.rubric, p.item.max_score) == rubric][:self.endpoint.batch_size]
            self._queue = [p for p in self._queue if p not in batch]
            try:
                scores = await self._call([p.item for p in batch])
            except JudgeError as exc:
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(JudgeError(exc.cause, str(exc)))
                continue
            for p, s in zip(batch, scores, strict=True):
                if not p.future.done():
                    p.future.set_result(s)

    async def _call(self, items: list[JudgeItem]) -> list[float]:
        headers = {}
        if self.endpoint.api_key_file is not None:
            headers["authorization"] = f"Bearer {self.endpoint.api_key_file.read_text().strip()}"
        body = {"model": self.endpoint.model, "messages": judge_prompt(items), "temperature": 0.0,
                "max_tokens": self.endpoint.max_tokens}
        if self.endpoint.structured == "vllm":
            body["structured_outputs"] = {"regex": scores_regex(len(items), items[0].max_score)}
            body["chat_template_kwargs"] = {"enable_thinking": False}
        url = self.endpoint.url.rstrip("/") + "/chat/completions"
        client = self.client or httpx.AsyncClient(timeout=self.endpoint.timeout_seconds)
        try:
            resp = await client.post(url, json=body, headers=headers, timeout=self.endpoint.timeout_seconds)
        except httpx.HTTPError as exc:
            raise JudgeError(JUDGE_UNREACHABLE, f"the judge at {url} could not be reached: "
                             f"{exc.__class__.__name__}: {exc}") from exc
        finally:
            if self.client is None:
                await client.aclose()
        if resp.status_code != 200:
            raise JudgeError(JUDGE_UNREACHABLE, f"the judge at {url} answered HTTP {resp.status_code}: "
                             f"{resp.text[:200]!r}")
        try:
            answer = resp.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise JudgeError(JUDGE_GARBAGE, f"the judge at {url} answered no chat completion: "
                             f"{resp.text[:200]!r}") from None
        return read_scores(str(answer or ""), len(items), items[0].max_score)
