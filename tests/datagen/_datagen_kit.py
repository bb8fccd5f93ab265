"""Real SessionResults for the datagen tests: completions captured as the proxy records them, built into a
Trajectory by the real prefix_merging builder, then wrapped with a status, an evaluation and the gateway's metadata.

Token IDs: 1-3 the prompt, 10-11 and 20-21 sampled replies, 50-51 a tool result, EOT (99) the end-of-turn token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polar_gym.datagen.template import TaskTemplate
from polar_gym.merge import build_trajectory
from polar_gym.schema import (
    AgentSpec,
    BuilderSpec,
    CompletionRecord,
    CompletionSession,
    EvalResult,
    EvaluatorSpec,
    RuntimeSpec,
    SessionResult,
    SessionStatus,
)

__all__ = ["EOT", "EXAMPLE", "ROOT", "TOOLS", "completion", "empty_result", "session_result", "template"]

EOT = 99
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "datagen" / "demo_dataset.jsonl"
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
_BUILDER = BuilderSpec(strategy="prefix_merging", config={"end_of_turn_ids": [EOT]})


def template(evaluator: EvaluatorSpec | None = None, num_samples: int = 2) -> TaskTemplate:
    return TaskTemplate(agent=AgentSpec(harness="shell"), runtime=RuntimeSpec(), builder=BuilderSpec(),
                        evaluator=evaluator or EvaluatorSpec(strategy="test_on_output"), num_samples=num_samples)


def completion(session_id: str, index: int, prompt: list[int], response: list[int],
               messages: list[dict[str, Any]], reply: dict[str, Any]) -> CompletionRecord:
    return CompletionRecord(
        completion_id=f"{session_id}-c{index}", session_id=session_id, index=index, provider="openai_chat",
        engine="oracle", normalized_request={"model": "policy", "messages": messages, "tools": TOOLS},
        response={"message": reply}, prompt_ids=prompt, response_ids=response,
        response_logprobs=[-0.1] * len(response), finish_reason="stop", started_at=float(index))


def _two_turns(session_id: str, instruction: str) -> CompletionSession:
    """user → assistant calls bash → tool answers → assistant's final answer."""
    user = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": instruction}]
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]}
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "calc.py"}
    final = {"role": "assistant", "content": "Fixed calc.py."}
    return CompletionSession(session_id=session_id, completions=[
        completion(session_id, 0, [1, 2, 3], [10, 11, EOT], user, call),
        completion(session_id, 1, [1, 2, 3, 10, 11, EOT, 50, 51], [20, 21, EOT], [*user, call, tool], final),
    ])


def _metadata(task_id: str, sample_index: int, task_meta: dict[str, Any] | None) -> dict[str, Any]:
    return {"sample_index": sample_index, "status_history": [], "task_metadata": dict(task_meta or {}),
            "artifacts": {}}


def session_result(task_id: str, sample_index: int = 0, *, reward: float = 1.0, passed: bool | None = True,
                   status: SessionStatus = SessionStatus.COMPLETED,
                   task_meta: dict[str, Any] | None = None) -> SessionResult:
    """A session whose model answered in two turns, evaluated with ``reward`` / ``passed``."""
    session_id = f"{task_id}-{sample_index}-{sample_index:08x}"
    traj = build_trajectory(_two_turns(session_id, f"Fix {task_id}."), _BUILDER)
    return SessionResult(session_id=session_id, task_id=task_id, status=status, trajectory=traj,
                         evaluation=EvalResult(reward=reward, passed=passed),
                         metadata=_metadata(task_id, sample_index, task_meta))


def empty_result(task_id: str, sample_index: int = 0, *, kind: str = "blank",
                 task_meta: dict[str, Any] | None = None) -> SessionResult:
    """An empty generation: ``blank`` (the model answered only its end-of-turn token), ``no_trace`` (a trajectory
    without traces) or ``error`` (ERROR before any model call: no trajectory)."""
    session_id = f"{task_id}-{sample_index}-{sample_index + 1000:08x}"
    meta = _metadata(task_id, sample_index, task_meta)
    if kind == "error":
        return SessionResult(session_id=session_id, task_id=task_id, status=SessionStatus.ERROR,
                             reason="runtime start failed", metadata=meta)
    if kind == "no_trace":
        traj = build_trajectory(CompletionSession(session_id=session_id), _BUILDER)
    else:
        user = [{"role": "user", "content": "Fix it."}]
        traj = build_trajectory(CompletionSession(session_id=session_id, completions=[
            completion(session_id, 0, [1, 2, 3], [EOT], user, {"role": "assistant", "content": "  "})]), _BUILDER)
    return SessionResult(session_id=session_id, task_id=task_id, status=SessionStatus.COMPLETED, trajectory=traj,
                         evaluation=EvalResult(reward=0.0, passed=False), metadata=meta)
