"""The trace viewer over the rollout server's own store (a live run): the ViewSource that
``create_server_app`` mounts under ``/view`` (polar_gym.view.router; admin token or the viewer cookie).

Reads only, and cheap for the server's real clients: a finished session's row never changes, so each is read out
of the store once (SQLite extracts the few result fields; the result is not parsed here) and kept; later table
loads read only the sessions finished since, and the unfinished ones' light columns. Opening a session parses its
stored result in a worker thread; the last few opened are kept for their per-trace token requests. The live
server has no capture journal (the gateways keep it): per-call timings come from the call log a gateway ships with
each result.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

from polar_gym.server.store import SessionRow, Store
from polar_gym.view.model import MAX_ROWS, SessionData, session_row
from polar_gym.view.tokens import TokenText, find_tokenizer

__all__ = ["StoreViewSource", "lazy_source"]

#: finished rows read per store call (SQLite parses each stored result to extract its fields, under the store's
#: lock: short calls let the server's own reads and writes go between them) and store calls per table load
_PAGE = 50
_PAGES = 40
_OPENED = 8


def _row(r: dict[str, Any]) -> dict[str, Any]:
    """A store row in results.jsonl's shape, for polar_gym.view.model.session_row."""
    out: dict[str, Any] = {"session_id": r["session_id"], "task_id": r["task_id"], "status": r["status"],
                           "reason": r["reason"], "harness": r["harness"] or "",
                           "metadata": {"sample_index": r["sample_index"]}}
    if "reward" in r:
        out.update(evaluation={"reward": r["reward"]} if r["reward"] is not None else None,
                   traces=r["traces"] or 0, completions=r["completions"], seconds=r["seconds"])
        out["metadata"]["artifacts"] = {"error_cause": r["artifacts_cause"]} if r["artifacts_cause"] else {}
    return out


def _data(row: SessionRow) -> SessionData:
    result = row.result
    if result is None:
        return SessionData(row={"session_id": row.session_id, "task_id": row.task_id, "status": row.status.value,
                                "reason": row.reason, "harness": row.spec.agent.harness,
                                "metadata": {"sample_index": row.spec.sample_index}}, traces=[], calls=[])
    data = result.model_dump(mode="json", exclude={"trajectory"})
    traces = [t.model_dump(mode="json") for t in result.trajectory.traces] if result.trajectory else []
    data.update(harness=row.spec.agent.harness, traces=len(traces),
                trajectory_diagnostics=result.trajectory.diagnostics if result.trajectory else {})
    metadata = data.setdefault("metadata", {})
    metadata.setdefault("sample_index", row.spec.sample_index)
    calls = (metadata.get("artifacts") or {}).pop("call_log", None)  # shipped by the gateway with the result
    return SessionData(row=data, traces=traces,
                       calls=[c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else [])


class StoreViewSource:
    """A ViewSource over a rollout server's Store."""

    title = "live rollout server"

    def __init__(self, store: Store, *, max_rows: int = 100_000, max_open_rows: int = MAX_ROWS,
                 tokens: TokenText | None = None) -> None:
        self.store = store
        self.max_rows, self.max_open_rows = max_rows, max_open_rows
        self._finished: dict[str, dict[str, Any]] = {}
        self._after: tuple[float, str] = (0.0, "")
        self._lock = asyncio.Lock()
        self._opened: collections.OrderedDict[str, SessionData] = collections.OrderedDict()
        if tokens is None:
            found = find_tokenizer(None)
            tokens = TokenText(found) if found is not None else None
        self._tokens = tokens

    def tokens(self) -> TokenText | None:
        return self._tokens

    async def _catch_up(self) -> None:
        """Read the sessions finished since the last load, a page at a time (each page one short store call); a
        backlog larger than one load's budget is read on by the next loads."""
        async with self._lock:
            for _ in range(_PAGES):
                if len(self._finished) >= self.max_rows:
                    break
                page = await self.store.finished_session_rows(self._after, _PAGE)
                for r in page:
                    self._finished[r["session_id"]] = session_row(_row(r))
                if page:
                    self._after = (float(page[-1]["finished"]), str(page[-1]["session_id"]))
                if len(page) < _PAGE:
                    break

    async def rows(self) -> list[dict[str, Any]]:
        await self._catch_up()
        live = await self.store.open_session_rows(self.max_open_rows)
        return list(self._finished.values()) + [session_row(_row(r)) for r in live
                                                if r["session_id"] not in self._finished]

    async def session(self, session_id: str) -> SessionData | None:
        if session_id in self._opened:
            self._opened.move_to_end(session_id)
            return self._opened[session_id]
        row = await self.store.session(session_id)
        if row is None:
            return None
        data = await asyncio.to_thread(_data, row)
        if row.status.terminal:
            self._opened[session_id] = data
            while len(self._opened) > _OPENED:
                self._opened.popitem(last=False)
        return data


def lazy_source(store: Callable[[], Store]) -> Callable[[], StoreViewSource]:
    """The source made at the first viewer request (an app is built before its server has started)."""
    made: list[StoreViewSource] = []

    def get() -> StoreViewSource:
        if not made:
            made.append(StoreViewSource(store()))
        return made[0]

    return get
