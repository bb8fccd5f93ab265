"""Tasks as the API sees them: a request expanded into its sessions (checked to be bounded and readable back), and
the view of a task (its status, per-session results and an aggregate). Pure functions, plus the one read of the
store a view needs."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from polar_gym.httpguard import MAX_JSON_DEPTH, check_upstream_url, excerpt, json_depth
from polar_gym.result_codec import frame_results
from polar_gym.schema import SessionSpec, SessionStatus, TaskRequest
from polar_gym.server.errors import ServerError
from polar_gym.server.store import PackedRow, SessionRow, Store, TaskRow

__all__ = ["expand", "packed_task_view", "task_state", "task_view"]

S = SessionStatus


def task_state(rows: list[SessionRow] | list[PackedRow], cancelled: bool) -> SessionStatus:
    """One status for a task: running until every session ended, then completed unless none completed."""
    statuses = [r.status for r in rows]
    if not all(s.terminal for s in statuses):
        return S.REGISTERED if all(s == S.REGISTERED for s in statuses) else S.RUNNING
    if cancelled or all(s == S.CANCELLED for s in statuses):
        return S.CANCELLED
    return S.COMPLETED if S.COMPLETED in statuses else S.ERROR


def expand(task: TaskRequest, max_samples: int, max_task_bytes: int) -> list[SessionSpec]:
    """The sessions of a task, after checking it is bounded and can be read back once stored (a pure function,
    run in a worker thread: thousands of specs would hold the event loop). Raises ServerError 413/422."""
    if task.num_samples > max_samples:
        raise ServerError(413, "too_many_samples", f"num_samples {task.num_samples} exceeds this server's limit of "
                                                   f"{max_samples} sessions per task")
    try:
        stored, dumped = task.model_dump_json(), task.model_dump(mode="json")
    except ValueError as exc:  # nested past the serializer's own guard (a few hundred levels)
        raise ServerError(422, "unreadable_task", f"the task cannot be stored: {excerpt(exc, 300)}") from exc
    if len(stored) * (task.num_samples + 1) > max_task_bytes:
        raise ServerError(413, "task_too_large", f"{task.num_samples} samples of a {len(stored)}-byte request exceed "
                                                 f"this server's limit of {max_task_bytes} stored bytes per task")
    if task.callback_url is not None:
        try:
            check_upstream_url(task.callback_url)
        except ValueError as exc:
            raise ServerError(422, "invalid_callback_url", str(exc)) from exc
    depth = json_depth(dumped)
    if depth > MAX_JSON_DEPTH:
        raise ServerError(422, "too_deep", f"the task nests JSON {depth} levels deep; the limit is {MAX_JSON_DEPTH}")
    specs = [SessionSpec.from_task(task, i) for i in range(task.num_samples)]
    try:  # what is stored must read back (e.g. an infinite float is written as null and then fails)
        TaskRequest.model_validate_json(stored)
        SessionSpec.model_validate_json(specs[0].model_dump_json())
    except ValueError as exc:
        raise ServerError(422, "unreadable_task", f"the task would not read back once stored: {excerpt(exc, 300)}") \
            from exc
    return specs


async def task_view(store: Store, task_id: str) -> dict[str, Any]:
    """TaskStatus plus an aggregate: counts by status and the mean reward of the evaluated sessions."""
    task = await store.task(task_id)
    if task is None:
        raise ServerError(404, "unknown_task", f"no task {task_id!r}")
    rows = await store.sessions_of(task_id)
    return await asyncio.to_thread(_view, task_id, task, rows)  # thousands of results: off the event loop


def _view(task_id: str, task: TaskRow, rows: list[SessionRow]) -> dict[str, Any]:
    """TaskStatus plus an aggregate, as JSON-ready data (pure; run in a worker thread). Built entry by entry, not as
    one TaskStatus dump: one call over thousands of results would hold the GIL, and so the event loop, throughout."""
    rewards = [r.result.evaluation.reward for r in rows if r.result and r.result.evaluation]
    counts = collections.Counter(r.status.value for r in rows)
    view = {"task_id": task_id, "status": task_state(rows, task.cancelled).value,
            "sessions": {r.session_id: r.status.value for r in rows},
            "results": [r.result.model_dump(mode="json") for r in rows if r.result is not None],
            "aggregate": {"counts": dict(counts), "num_sessions": len(rows),
                          "finished": sum(r.status.terminal for r in rows),
                          "mean_reward": sum(rewards) / len(rewards) if rewards else None},
            "gateways": {r.session_id: r.gateway_id for r in rows},
            "callback": {"state": task.callback_state, "error": task.callback_error}}
    if task.quarantined:
        view["quarantined"] = task.quarantined
    return view


async def packed_task_view(store: Store, task_id: str, after: tuple[float, str] | None = None) -> bytes:
    """The task view with its results packed, as stored (polar_gym.result_codec.frame_results): the JSON part is
    the view without ``results`` plus ``cursor``; the results are the finished ones after ``after`` (a
    ``(finished, session_id)`` cursor a previous answer gave), in that order. Nothing is decoded: the server's
    cost is the bytes it reads."""
    task = await store.task(task_id)
    if task is None:
        raise ServerError(404, "unknown_task", f"no task {task_id!r}")
    rows = await store.packed_sessions(task_id)
    return await asyncio.to_thread(_packed_view, task_id, task, rows, after)


def _packed_view(task_id: str, task: TaskRow, rows: list[PackedRow], after: tuple[float, str] | None) -> bytes:
    rewards = [r.result.head.reward for r in rows if r.result is not None and r.result.head.reward is not None]
    counts = collections.Counter(r.status.value for r in rows)
    done = sorted((r for r in rows if r.result is not None and r.finished is not None),
                  key=lambda r: (r.finished or 0.0, r.session_id))
    new = [r for r in done if after is None or (r.finished or 0.0, r.session_id) > after]
    cursor = [done[-1].finished, done[-1].session_id] if done else None
    view: dict[str, Any] = {
        "task_id": task_id, "status": task_state(rows, task.cancelled).value,
        "sessions": {r.session_id: r.status.value for r in rows},
        "aggregate": {"counts": dict(counts), "num_sessions": len(rows),
                      "finished": sum(r.status.terminal for r in rows),
                      "mean_reward": sum(rewards) / len(rewards) if rewards else None},
        "gateways": {r.session_id: r.gateway_id for r in rows},
        "callback": {"state": task.callback_state, "error": task.callback_error}, "cursor": cursor}
    if task.quarantined:
        view["quarantined"] = task.quarantined
    return frame_results([r.result.data for r in new if r.result is not None], view)
