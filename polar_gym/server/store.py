"""The rollout server's durable state: tasks, their sessions (status, gateway, attempts, result) and the registered
gateways. In SQLite by default (one file survives a restart and needs no service), or in PostgreSQL, which several
server workers share (polar_gym.server.sql). The driver runs in a worker thread (``asyncio.to_thread``) behind one
lock, so the event loop never blocks on the database.

A result is stored packed (polar_gym.result_codec: about its unique token bytes, where JSON took ~30x), with its
head beside it as JSON for the viewer's queries; rows written before (a JSON ``result``) read unchanged."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polar_gym.httpguard import excerpt
from polar_gym.result_codec import PackedResult, head, pack, unpack, without_tokens
from polar_gym.schema import AgentSpec, EvalResult, SessionResult, SessionSpec, SessionStatus, TaskRequest
from polar_gym.server.sql import open_database

__all__ = ["QUARANTINED", "GatewayRow", "PackedRow", "SessionRow", "Store", "TaskRow"]

log = logging.getLogger(__name__)

#: the reason of a stored row that could not be read back starts with this
QUARANTINED = "quarantined:"
#: the agent of a spec or request that could not be read back (a placeholder: such a session never runs)
_UNREADABLE_AGENT = AgentSpec(harness="unreadable")

@dataclass
class TaskRow:
    request: TaskRequest
    created: float
    cancelled: bool
    callback_state: str | None
    callback_error: str | None
    #: why the stored request could not be read back (``request`` is then a stand-in with the task_id only)
    quarantined: str | None = None


@dataclass
class SessionRow:
    spec: SessionSpec
    status: SessionStatus
    gateway_id: str | None
    attempts: int
    reason: str | None
    result: SessionResult | None
    created: float
    dispatched: float | None

    @property
    def session_id(self) -> str:
        return self.spec.session_id

    @property
    def task_id(self) -> str:
        return self.spec.task_id


@dataclass
class PackedRow:
    """A session as a task's packed view needs it: no spec, the result as stored (never decoded)."""

    session_id: str
    status: SessionStatus
    gateway_id: str | None
    finished: float | None
    result: PackedResult | None


@dataclass
class GatewayRow:
    gateway_id: str
    url: str
    capacity: int
    admin_token: str | None
    state: str
    #: the server worker that watches and dispatches to it (None: a store of one worker, before workers existed)
    owner: str | None = None


#: one attempt fewer, never below zero (an attempt refunded)
_ONE_FEWER = "CASE WHEN attempts > 0 THEN attempts - 1 ELSE 0 END"


def _session(row: Mapping[str, Any]) -> SessionRow:
    return SessionRow(
        spec=SessionSpec.model_validate_json(row["spec"]), status=SessionStatus(row["status"]),
        gateway_id=row["gateway_id"], attempts=row["attempts"], reason=row["reason"],
        result=unpack(row["packed"]) if row["packed"] is not None
        else SessionResult.model_validate_json(row["result"]) if row["result"] else None,
        created=row["created"], dispatched=row["dispatched"])


class Store:
    """Every method is a coroutine that runs its SQL in a thread; the lock serializes the one connection."""

    def __init__(self, target: str | Path) -> None:
        #: a SQLite file's path, or a ``postgresql://`` URL (several server workers share that database)
        self.path = str(target)
        self.db = open_database(self.path)

    def _run(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return self.db.run(sql, args)

    async def _q(self, sql: str, *args: Any) -> list[Any]:
        return await asyncio.to_thread(self._run, sql, args)

    async def _sessions(self, sql: str, *args: Any) -> list[SessionRow]:
        """Session rows, parsed in the worker thread (thousands of specs would hold the event loop); a row that
        cannot be read back is quarantined instead of failing the whole read."""

        def run() -> list[SessionRow]:
            out = []
            for row in self._run(sql, args):
                try:
                    out.append(_session(row))
                except Exception as exc:  # any corruption: bad JSON, a spec of an older schema, a bad status
                    out.append(self._quarantine(row, exc))
            return out

        return await asyncio.to_thread(run)

    def _quarantine(self, row: Mapping[str, Any], exc: Exception) -> SessionRow:
        """Mark an unreadable session ERROR with the reason, for good (dispatch and restarts skip it)."""
        session_id, task_id = str(row["session_id"]), str(row["task_id"])
        reason = f"{QUARANTINED} the stored session could not be read back ({type(exc).__name__}: {excerpt(exc, 200)})"
        log.error("session %s of task %s %s", session_id, task_id, reason)
        result = SessionResult(session_id=session_id, task_id=task_id, status=SessionStatus.ERROR, reason=reason)
        # the stand-in replaces a packed result too: left there, it would be read (and fail) first every time
        self.db.run("UPDATE sessions SET status = ?, reason = ?, result = ?, packed = NULL, "
                             "result_head = NULL, finished = ? WHERE session_id = ?",
                             (SessionStatus.ERROR.value, reason, result.model_dump_json(), time.time(), session_id))
        spec = SessionSpec.model_construct(session_id=session_id, task_id=task_id,  # never dispatched: ERROR already
                                           sample_index=_int(row["sample_index"]), instruction="",
                                           agent=_UNREADABLE_AGENT)
        return SessionRow(spec=spec, status=SessionStatus.ERROR, gateway_id=row["gateway_id"],
                          attempts=_int(row["attempts"]), reason=reason, result=result,
                          created=_float(row["created"]), dispatched=None)

    def close(self) -> None:
        self.db.close()

    # -- tasks -----------------------------------------------------------------------------------------------

    async def add_task(self, task: TaskRequest, specs: list[SessionSpec]) -> bool:
        """Insert a task and its sessions in one transaction; False when the task_id already exists."""

        def run() -> bool:
            now = time.time()
            try:
                with self.db.transaction():
                    self.db.run("INSERT INTO tasks(task_id, request, created) VALUES (?, ?, ?)",
                                (task.task_id, task.model_dump_json(), now))
                    self.db.many("INSERT INTO sessions(session_id, task_id, sample_index, spec, status, created) "
                                 "VALUES (?, ?, ?, ?, ?, ?)",
                                 [(s.session_id, s.task_id, s.sample_index, s.model_dump_json(),
                                   SessionStatus.REGISTERED.value, now) for s in specs])
            except self.db.IntegrityError:
                return False
            return True

        return await asyncio.to_thread(run)

    async def task(self, task_id: str) -> TaskRow | None:
        rows = await self._q("SELECT * FROM tasks WHERE task_id = ?", task_id)
        if not rows:
            return None
        r = rows[0]
        try:
            request = await asyncio.to_thread(TaskRequest.model_validate_json, r["request"])
        except Exception as exc:  # a corrupted row: the task's sessions carry their own specs and go on
            reason = f"{QUARANTINED} the stored task request could not be read back ({excerpt(exc, 200)})"
            request = TaskRequest.model_construct(task_id=task_id, callback_url=None, instruction="",
                                                  agent=_UNREADABLE_AGENT)
            return TaskRow(request, _float(r["created"]), bool(r["cancelled"]), r["callback_state"],
                           r["callback_error"], reason)
        return TaskRow(request, r["created"], bool(r["cancelled"]), r["callback_state"], r["callback_error"])

    async def task_ids(self, limit: int = 1000, offset: int = 0) -> list[str]:
        rows = await self._q("SELECT task_id FROM tasks ORDER BY created, task_id LIMIT ? OFFSET ?", limit, offset)
        return [r["task_id"] for r in rows]

    async def mark_task_cancelled(self, task_id: str) -> None:
        await self._q("UPDATE tasks SET cancelled = 1 WHERE task_id = ?", task_id)

    async def set_callback(self, task_id: str, state: str, error: str | None = None) -> None:
        await self._q("UPDATE tasks SET callback_state = ?, callback_error = ? WHERE task_id = ?",
                      state, error, task_id)

    async def claim_callback(self, task_id: str) -> bool:
        """Mark a finished task's callback pending, once: concurrent finishers race here and one wins."""
        rows = await self._q("UPDATE tasks SET callback_state = 'pending' WHERE task_id = ? AND callback_state IS NULL "
                             "RETURNING task_id", task_id)
        return bool(rows)

    async def pending_callbacks(self) -> list[str]:
        rows = await self._q("SELECT task_id FROM tasks WHERE callback_state = 'pending'")
        return [r["task_id"] for r in rows]

    # -- sessions --------------------------------------------------------------------------------------------

    async def sessions_of(self, task_id: str) -> list[SessionRow]:
        return await self._sessions("SELECT * FROM sessions WHERE task_id = ? ORDER BY sample_index", task_id)

    async def packed_sessions(self, task_id: str) -> list[PackedRow]:
        """A task's sessions with their results packed as stored (a JSON result of an older version is packed here,
        in the worker thread; one that cannot be read is left out, its status says ERROR once quarantined)."""

        def run() -> list[PackedRow]:
            out = []
            for row in self._run("SELECT session_id, status, gateway_id, finished, packed, result FROM sessions "
                                 "WHERE task_id = ? ORDER BY sample_index", (task_id,)):
                result = None
                try:
                    if row["packed"] is not None:
                        result = PackedResult.of(row["packed"])
                    elif row["result"]:
                        result = PackedResult.of(pack(SessionResult.model_validate_json(row["result"])))
                    status = SessionStatus(row["status"])
                except ValueError as exc:
                    log.error("session %s: its stored result cannot be read (%s)", row["session_id"], excerpt(exc, 200))
                    result, status = None, SessionStatus.ERROR
                out.append(PackedRow(row["session_id"], status, row["gateway_id"], row["finished"], result))
            return out

        return await asyncio.to_thread(run)

    async def unfinished(self, task_id: str) -> int:
        """How many sessions of a task have not ended: a count, so a finish does not parse every sibling's result."""
        terminal = [s.value for s in SessionStatus if s.terminal]
        rows = await self._q(f"SELECT COUNT(*) AS n FROM sessions WHERE task_id = ? AND status NOT IN "
                             f"({','.join('?' * len(terminal))})", task_id, *terminal)
        return int(rows[0]["n"])

    async def session(self, session_id: str) -> SessionRow | None:
        rows = await self._sessions("SELECT * FROM sessions WHERE session_id = ?", session_id)
        return rows[0] if rows else None

    async def undispatched(self, limit: int = 1000) -> list[SessionRow]:
        """Waiting sessions, oldest first; quarantined ones come back ERROR (the caller reports them)."""
        return await self._sessions("SELECT * FROM sessions WHERE gateway_id IS NULL AND status = ? "
                                    "ORDER BY created LIMIT ?", SessionStatus.REGISTERED.value, limit)

    async def in_flight(self, gateway_id: str | None = None) -> list[SessionRow]:
        """Sessions handed to a gateway (to ``gateway_id``, when given) and not finished: watched again after a
        restart, or by a worker that takes the gateway over."""
        terminal = [s.value for s in SessionStatus if s.terminal]
        which, args = ("gateway_id = ?", (gateway_id,)) if gateway_id else ("gateway_id IS NOT NULL", ())
        return await self._sessions(f"SELECT * FROM sessions WHERE {which} AND status NOT IN "
                                    f"({','.join('?' * len(terminal))})", *args, *terminal)

    async def assign(self, session_id: str, gateway_id: str) -> int | None:
        """Claim a waiting session for a gateway; None when it is no longer waiting (cancelled meanwhile).
        Returns the attempt number."""
        return (await self.assign_many([(session_id, gateway_id)])).get(session_id)

    async def assign_many(self, claims: list[tuple[str, str]]) -> dict[str, int]:
        """Claim a batch of (session_id, gateway_id) in one transaction: one thread hop and one commit
        instead of one per session, which bounded the dispatch rate. Sessions no longer waiting are left out."""

        def run() -> dict[str, int]:
            now, out = time.time(), {}
            with self.db.transaction():
                for session_id, gateway_id in claims:
                    rows = self.db.run(
                        "UPDATE sessions SET gateway_id = ?, attempts = attempts + 1, dispatched = ?, status = ? "
                        "WHERE session_id = ? AND gateway_id IS NULL AND status = ? RETURNING attempts",
                        (gateway_id, now, SessionStatus.INITIALIZING.value, session_id,
                         SessionStatus.REGISTERED.value))
                    if rows:
                        out[session_id] = int(rows[0]["attempts"])
            return out

        return await asyncio.to_thread(run) if claims else {}

    async def release(self, session_id: str, gateway_id: str) -> None:
        """Undo a claim that was never posted: waiting again, the attempt not counted."""
        await self._q(f"UPDATE sessions SET gateway_id = NULL, status = ?, attempts = {_ONE_FEWER} "
                      "WHERE session_id = ? AND gateway_id = ? AND status = ?", SessionStatus.REGISTERED.value,
                      session_id, gateway_id, SessionStatus.INITIALIZING.value)

    async def refund_attempt(self, session_id: str) -> None:
        await self._q(f"UPDATE sessions SET attempts = {_ONE_FEWER} WHERE session_id = ?", session_id)

    async def requeue(self, session_id: str, reason: str, gateway_id: str | None = None,
                      given_up: bool = False) -> bool:
        """Queue a session again; with ``gateway_id``, only while it is still that gateway's (another server worker
        may have queued it and handed it on meanwhile). ``given_up``: that gateway may still hold an attempt of it,
        which is never to be adopted nor its result stored (recorded, so whichever worker watches the gateway
        next, or this one after a restart, knows). False when nothing changed."""
        which, args = ("AND gateway_id = ?", (gateway_id,)) if gateway_id is not None else ("", ())
        mark = ", given_up_on = ?" if given_up and gateway_id is not None else ""
        changed = await self._q(f"UPDATE sessions SET gateway_id = NULL, status = ?, reason = ?{mark} "
                                f"WHERE session_id = ? {which} RETURNING session_id", SessionStatus.REGISTERED.value,
                                reason, *((gateway_id,) if mark else ()), session_id, *args)
        return bool(changed)

    async def given_up_on(self, gateway_id: str) -> set[str]:
        """The open sessions given up on ``gateway_id`` and not handed back to it since (its stale attempts)."""
        rows = await self._q("SELECT session_id FROM sessions WHERE given_up_on = ? AND finished IS NULL AND "
                             "(gateway_id IS NULL OR gateway_id != ?)", gateway_id, gateway_id)
        return {r["session_id"] for r in rows}

    async def withdraw(self, session_id: str) -> bool:
        """Queue a session again whose attempt never ran (withdrawn before its harness started): the attempt is
        refunded. False when it had ended meanwhile."""
        changed = await self._q("UPDATE sessions SET gateway_id = NULL, status = ?, dispatched = NULL, "
                                f"attempts = {_ONE_FEWER}, reason = 'withdrawn before it ran' "
                                "WHERE session_id = ? AND result IS NULL AND packed IS NULL RETURNING session_id",
                                SessionStatus.REGISTERED.value, session_id)
        return bool(changed)

    async def set_status(self, session_id: str, status: SessionStatus) -> None:
        await self._q("UPDATE sessions SET status = ? WHERE session_id = ?", status.value, session_id)

    async def finish(self, result: SessionResult | PackedResult) -> bool:
        """Store a session's final result (packed in the worker thread if it is not); False when it had already
        ended (the first final result stays: a gateway's late answer cannot overwrite the server's giving up, nor
        the reverse)."""
        terminal = [s.value for s in SessionStatus if s.terminal]

        def run() -> list[Any]:
            packed = result if isinstance(result, PackedResult) else PackedResult.of(pack(result))
            return self._run(f"UPDATE sessions SET status = ?, reason = ?, result = NULL, packed = ?, result_head = ?, "
                             f"finished = ? WHERE session_id = ? AND status NOT IN ({','.join('?' * len(terminal))}) "
                             f"RETURNING session_id", (packed.status.value, packed.reason, packed.data,
                                                       packed.head.model_dump_json(), time.time(),
                                                       packed.session_id, *terminal))

        return bool(await asyncio.to_thread(run))

    async def retain(self, task_id: str, mode: str) -> int:
        """Apply a retention mode to a finished task's results once the trainer has them: ``compact`` drops the
        trajectories (tokens, messages) and keeps status, reward, timings and metadata; ``drop`` keeps only the
        head (status, reason, reward). Each result's stored head records it (``retained``). Returns how many
        results changed."""
        if mode not in ("compact", "drop"):
            raise ValueError(f"unknown result retention {mode!r} (keep, compact, drop)")

        def run() -> int:
            rows = self._run("SELECT session_id, packed FROM sessions WHERE task_id = ? AND packed IS NOT NULL",
                             (task_id,))
            changed = []
            for row in rows:
                h = head(row["packed"])
                if h.retained is not None:
                    continue
                if mode == "compact":
                    body = without_tokens(row["packed"])
                    body["trajectory"] = None
                    kept = SessionResult.model_validate(body)
                else:
                    evaluation = EvalResult(reward=h.reward) if h.reward is not None else None
                    kept = SessionResult(session_id=h.session_id, task_id=h.task_id, status=h.status, reason=h.reason,
                                         evaluation=evaluation)
                packed = PackedResult.of(pack(kept, retained=mode))
                changed.append((packed.data, packed.head.model_dump_json(), row["session_id"]))
            with self.db.transaction():
                self.db.many("UPDATE sessions SET packed = ?, result_head = ? WHERE session_id = ?", changed)
            return len(changed)

        return await asyncio.to_thread(run)

    async def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Sessions by status, and tasks by whether every session has finished (for /metrics)."""
        sessions = {r["status"]: r["n"]
                    for r in await self._q("SELECT status, COUNT(*) AS n FROM sessions GROUP BY status")}
        terminal = [s.value for s in SessionStatus if s.terminal]
        open_ = (await self._q(f"SELECT COUNT(DISTINCT task_id) AS n FROM sessions WHERE status NOT IN "
                               f"({','.join('?' * len(terminal))})", *terminal))[0]["n"]
        total = (await self._q("SELECT COUNT(*) AS n FROM tasks"))[0]["n"]
        return sessions, {"open": open_, "finished": total - open_}

    # -- the trace viewer's reads (polar_gym.server.viewer): light columns, bounded pages ---------------------

    def _view_columns(self) -> str:
        return ("session_id, task_id, sample_index, status, reason, created, finished, "
                f"{self.db.json('spec', 'agent', 'harness')} AS harness")

    async def open_session_rows(self, limit: int) -> list[dict[str, Any]]:
        """Sessions not finished yet, oldest first, without their specs' or results' bodies."""
        rows = await self._q(f"SELECT {self._view_columns()} FROM sessions WHERE finished IS NULL "
                             f"ORDER BY created LIMIT ?", limit)
        return [dict(r) for r in rows]

    async def finished_session_rows(self, after: tuple[float, str], limit: int) -> list[dict[str, Any]]:
        """Finished sessions after ``(finished, session_id)`` in that order (a keyset page), with the few result
        fields a table shows (read out of the stored head, or the JSON result of an older version; a finished row
        never changes, so callers keep them)."""
        j = self.db.json
        fields = {"reward": j("result", "evaluation", "reward"),
                  "error_cause": j("result", "metadata", "artifacts", "error_cause"),
                  "traces": self.db.json_length("result", "trajectory", "traces"),
                  "completions": j("result", "trajectory", "diagnostics", "completions"),
                  "seconds": j("result", "timings", "total")}
        columns = ", ".join(f"COALESCE({j('result_head', name)}, {older}) AS "
                            f"{'artifacts_cause' if name == 'error_cause' else name}" for name, older in fields.items())
        rows = await self._q(
            f"SELECT {self._view_columns()}, {columns} FROM sessions WHERE finished IS NOT NULL "
            "AND (finished > ? OR (finished = ? AND session_id > ?)) ORDER BY finished, session_id LIMIT ?",
            after[0], after[0], after[1], limit)
        return [dict(r) for r in rows]

    # -- gateways --------------------------------------------------------------------------------------------

    async def save_gateway(self, gw: GatewayRow) -> None:
        await self._q("INSERT INTO gateways(gateway_id, url, capacity, admin_token, state, owner) "
                      "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(gateway_id) DO UPDATE SET url = excluded.url, "
                      "capacity = excluded.capacity, admin_token = excluded.admin_token, state = excluded.state, "
                      "owner = excluded.owner", gw.gateway_id, gw.url, gw.capacity, gw.admin_token, gw.state, gw.owner)

    async def gateways(self) -> list[GatewayRow]:
        return [_gateway(r) for r in await self._q("SELECT * FROM gateways ORDER BY gateway_id")]

    async def gateway_by_url(self, url: str) -> GatewayRow | None:
        rows = await self._q("SELECT * FROM gateways WHERE url = ?", url)
        return _gateway(rows[0]) if rows else None

    async def in_flight_counts(self) -> dict[str, int]:
        """Sessions handed to each gateway and not finished (another worker's gateways, for the fleet's view)."""
        # a session ends with ``finished`` set (a result, or quarantined): the partial index holds the open ones only
        rows = await self._q("SELECT gateway_id, COUNT(*) AS n FROM sessions WHERE finished IS NULL AND "
                             "gateway_id IS NOT NULL GROUP BY gateway_id")
        return {r["gateway_id"]: int(r["n"]) for r in rows}

    # -- what the whole fleet shares (its LLM backends, its policy version), and the workers' channel ----------

    async def fleet_value(self, key: str) -> str | None:
        rows = await self._q("SELECT value FROM fleet WHERE key = ?", key)
        return str(rows[0]["value"]) if rows else None

    async def set_fleet_value(self, key: str, value: str) -> None:
        await self._q("INSERT INTO fleet(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = "
                      "excluded.value", key, value)

    @property
    def shared(self) -> bool:
        """Whether other server workers may use this store (PostgreSQL)."""
        return self.db.shared

    async def publish(self, payload: str) -> None:
        if self.db.shared:
            await asyncio.to_thread(self.db.publish, payload)

    def listen(self, heard: Callable[[str], None]) -> Callable[[], None]:
        return self.db.listen(heard)

    async def try_lock(self, key: int) -> bool:
        return await asyncio.to_thread(self.db.try_lock, key) if self.db.shared else True

    async def unlock(self, key: int) -> None:
        if self.db.shared:
            await asyncio.to_thread(self.db.unlock, key)


def _gateway(r: Mapping[str, Any]) -> GatewayRow:
    return GatewayRow(r["gateway_id"], r["url"], r["capacity"], r["admin_token"], r["state"], r["owner"])


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _float(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else 0.0
