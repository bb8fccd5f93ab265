"""Where GRPO's groups come from: the rollout server samples ahead of the trainer, up to ``max_staleness`` versions.

A *round* is one group (one TaskRequest of ``num_samples`` sessions) per task; the trainer trains one round's worth
of groups per step. Round ``r`` may be submitted once the trainer has pushed ``r - 1 - max_staleness`` updates:

- ``max_staleness: 0``: round ``r`` is submitted after update ``r - 1``, and the step waits for all of it: the
  synchronous loop (sample, train, push, repeat), sampled entirely by the weights it trains;
- ``max_staleness: k``: rounds up to ``step + k`` are in flight while step ``step`` trains, so the rollout server
  keeps sampling (with the weights it has) while the trainer trains, evaluates and pushes, and a step takes the
  first groups that *complete*, from any round (Polar's and AReaL's asynchronous pipelines).

A group that completes more than ``max_staleness`` versions behind the trainer (a slow one, overtaken by later
rounds) is *stale*: dropped and replaced by a fresh group of the same task (``stale_groups: drop``), or trained with
the rollout correction (``correct``). The staleness of each sample (trainer version - the oldest version among its
trained tokens, :mod:`polar_gym.trainer.staleness`) goes into the step's row.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from polar_gym.schema import SessionResult, SessionStatus, TaskRequest
from polar_gym.trainer.staleness import trace_age
from polar_gym.trainer.step_eval import greedy_request

__all__ = ["Batch", "DroppedGroup", "GroupFeed", "group_staleness", "step_request"]


def step_request(task: TaskRequest, label: str, round_number: int) -> TaskRequest:
    """``task`` as one GRPO group of round ``round_number``: its id ``TASK-LABEL`` (e.g. ``demo-calc-add-step3``),
    the task as group id, the round as ``metadata.rollout_step``."""
    meta = task.metadata.model_copy(update={"group_id": task.task_id, "rollout_step": round_number})
    return task.model_copy(update={"task_id": f"{task.task_id}-{label}", "metadata": meta})


def group_staleness(results: Sequence[SessionResult], trainer_version: int, completed_only: bool = True) -> int:
    """The oldest sample's staleness in a group (0 when no trained token carries a numbered version)."""
    ages = [trace_age(t, trainer_version).staleness for r in results if r.trajectory is not None
            and not (completed_only and r.status is not SessionStatus.COMPLETED)
            for t in r.trajectory.traces]
    return max(ages, default=0)


@dataclass(frozen=True)
class DroppedGroup:
    """A stale group the step did not train on: its task id, staleness and the sampled tokens thrown away."""

    task_id: str
    staleness: int
    tokens: int


@dataclass
class Batch:
    """What one step trains on: ``groups`` in the order they completed, the round each came from, the stale groups
    dropped on the way, the step's greedy evaluation sessions, and how long the trainer waited for all of it."""

    groups: list[list[SessionResult]]
    rounds: list[int]
    dropped: list[DroppedGroup] = field(default_factory=list)
    greedy: list[SessionResult] = field(default_factory=list)
    wait_seconds: float = 0.0

    @property
    def results(self) -> list[SessionResult]:
        return [r for group in self.groups for r in group]


@dataclass
class _Ticket:
    task: TaskRequest  # the task as the run was given it
    request: TaskRequest  # the group submitted for it
    round: int
    greedy: bool = False


class GroupFeed:
    """Submits rounds of groups to a rollout source ahead of the trainer and hands each step the groups that
    completed first (see the module docstring). ``close`` cancels what is still in flight at the end of a run."""

    def __init__(self, client: Any, tasks: Sequence[TaskRequest], *, steps: int, max_staleness: int = 0,
                 stale_groups: Literal["drop", "correct"] = "drop", greedy_samples: int = 0,
                 completed_only: bool = True, timeout: float = 3600.0) -> None:
        self.client, self.tasks, self.steps = client, list(tasks), steps
        self.max_staleness, self.stale_groups = max_staleness, stale_groups
        self.greedy_samples, self.completed_only, self.timeout = greedy_samples, completed_only, timeout
        self.submitted_rounds = 0
        self._done: asyncio.Queue[tuple[_Ticket, list[SessionResult] | Exception]] = asyncio.Queue()
        self._greedy: dict[int, list[_Ticket]] = {}
        self._greedy_done: dict[str, list[SessionResult]] = {}
        self._collectors: dict[str, asyncio.Task[None]] = {}
        self._early: list[tuple[_Ticket, list[SessionResult]]] = []  # groups done while a step waited for greedy
        self._retries = 0
        #: every group submitted and not yet taken by a step (what a resumed run re-attaches to)
        self._outstanding: dict[str, _Ticket] = {}

    async def _submit(self, ticket: _Ticket) -> None:
        self._outstanding[ticket.request.task_id] = ticket
        await self.client.submit(ticket.request)
        self._collectors[ticket.request.task_id] = asyncio.create_task(self._collect(ticket))

    async def _collect(self, ticket: _Ticket) -> None:
        try:
            results = [r async for r in self.client.results([ticket.request.task_id], timeout=self.timeout)]
        except Exception as exc:  # handed to the step that waits, which raises it
            self._done.put_nowait((ticket, exc))
            return
        self._done.put_nowait((ticket, results))

    async def _submit_rounds(self, step: int) -> None:
        """Every round the trainer may have in flight at ``step`` (``step + max_staleness``, at most ``steps``)."""
        while self.submitted_rounds < min(self.steps, step + self.max_staleness):
            number = self.submitted_rounds + 1
            self.submitted_rounds = number
            label = f"step{number}"
            for task in self.tasks:
                await self._submit(_Ticket(task, step_request(task, label, number), number))
            if self.greedy_samples:
                greedy = [_Ticket(t, greedy_request(step_request(t, label, number), self.greedy_samples), number,
                                  greedy=True) for t in self.tasks]
                self._greedy[number] = greedy
                for ticket in greedy:
                    await self._submit(ticket)

    async def _from_queue(self) -> tuple[_Ticket, list[SessionResult]]:
        ticket, outcome = await self._done.get()
        self._collectors.pop(ticket.request.task_id, None)
        if isinstance(outcome, Exception):
            raise outcome
        return ticket, outcome

    async def _next_done(self) -> tuple[_Ticket, list[SessionResult]]:
        return self._early.pop(0) if self._early else await self._from_queue()

    async def next_batch(self, step: int, trainer_version: int) -> Batch:
        """The groups step ``step`` trains on, with the trainer at ``trainer_version``: waits for one group per task
        (the first to complete), dropping and replacing stale ones when configured to, and for the step's greedy
        sessions. Raises what a rollout call raised (a timeout, an unreachable server)."""
        started = time.monotonic()
        await self._submit_rounds(step)
        batch = Batch(groups=[], rounds=[])
        taken: list[_Ticket] = []  # leave the outstanding groups only with the whole batch (a step cut short
        while len(batch.groups) < len(self.tasks):  # by a hand-over leaves them to the next job)
            ticket, outcome = await self._next_done()
            if ticket.greedy:
                self._greedy_done[ticket.request.task_id] = outcome
                continue
            staleness = group_staleness(outcome, trainer_version, self.completed_only)
            if staleness > self.max_staleness and self.stale_groups == "drop":
                tokens = sum(sum(t.loss_mask) for r in outcome if r.trajectory for t in r.trajectory.traces)
                batch.dropped.append(DroppedGroup(ticket.request.task_id, staleness, tokens))
                self._outstanding.pop(ticket.request.task_id, None)
                self._retries += 1
                await self._submit(_Ticket(ticket.task, step_request(
                    ticket.task, f"step{ticket.round}-retry{self._retries}", ticket.round), ticket.round))
                continue
            batch.groups.append(outcome)
            batch.rounds.append(ticket.round)
            taken.append(ticket)
        for ticket in self._greedy.get(step, []):
            while ticket.request.task_id not in self._greedy_done:
                ticket_done, outcome = await self._from_queue()
                if ticket_done.greedy:
                    self._greedy_done[ticket_done.request.task_id] = outcome
                else:  # a training group done early: first in line for the next step
                    self._early.append((ticket_done, outcome))
            batch.greedy += self._greedy_done.pop(ticket.request.task_id)
            taken.append(ticket)
        self._greedy.pop(step, None)
        for ticket in taken:
            self._outstanding.pop(ticket.request.task_id, None)
        batch.wait_seconds = time.monotonic() - started
        return batch

    def state(self) -> dict[str, Any]:
        """The feed as JSON, for a resumed run (:mod:`polar_gym.trainer.resume`): rounds submitted, retries, and
        every group submitted and not yet taken by a step."""
        groups = [{"task_id": t.task.task_id, "request": t.request.model_dump(mode="json"), "round": t.round,
                   "greedy": t.greedy} for t in self._outstanding.values()]
        return {"submitted_rounds": self.submitted_rounds, "retries": self._retries, "groups": groups}

    async def restore(self, state: dict[str, Any]) -> int:
        """Continue from :meth:`state`: re-submit every group it holds (the rollout server answers a known task id
        with its stored sessions; the unfinished ones run) and collect it; the number of groups."""
        by_id = {t.task_id: t for t in self.tasks}
        self.submitted_rounds, self._retries = int(state["submitted_rounds"]), int(state["retries"])
        for group in state["groups"]:
            task = by_id.get(group["task_id"])
            if task is None:
                raise ValueError(f"the resumed feed holds a group of task {group['task_id']!r}, not one of the run")
            ticket = _Ticket(task, TaskRequest.model_validate(group["request"]), int(group["round"]),
                             bool(group["greedy"]))
            if ticket.greedy:
                self._greedy.setdefault(ticket.round, []).append(ticket)
            await self._submit(ticket)
        return len(state["groups"])

    async def detach(self) -> int:
        """Stop collecting without cancelling anything on the rollout server (a hand-over: the next job takes the
        groups over); the number of groups left outstanding."""
        await self._stop_collectors()
        return len(self._outstanding)

    async def _stop_collectors(self) -> list[str]:
        left = list(self._collectors)
        for collector in self._collectors.values():
            collector.cancel()
        for collector in self._collectors.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await collector
        self._collectors.clear()
        return left

    async def close(self) -> int:
        """Stop collecting and cancel every group still in flight (the rollout server's ``cancel`` when the client
        has one); the number of groups submitted but never trained on."""
        left = await self._stop_collectors()
        cancel = getattr(self.client, "cancel", None)
        if cancel is not None:
            for task_id in left:
                with contextlib.suppress(Exception):
                    await cancel(task_id)
        return len(left) + self._done.qsize() + len(self._early)
