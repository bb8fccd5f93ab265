"""Dispatch: claim waiting sessions in batches and post each to the least-loaded healthy gateway with a free slot.
A claim is a store transaction (it counts the attempt), so a restart finds every session either waiting or owned by
a gateway; a session whose post fails goes back to the queue through the ledger."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from polar_gym.gateway.errors import GatewayBadReply, GatewayCallError, GatewayRefused, GatewayUnreachable
from polar_gym.server.counters import ServerCounters
from polar_gym.server.fleet import DRAINING, HEALTHY, Fleet, GatewayState
from polar_gym.server.ledger import Ledger
from polar_gym.server.links import Links
from polar_gym.server.store import SessionRow, Store
from polar_gym.server.watching import Watching

__all__ = ["Dispatcher", "free_slots", "plan"]

log = logging.getLogger(__name__)

#: sessions claimed per round, and posts in flight at once (a 1000-session burst would only queue in the HTTP pool)
BATCH, CONCURRENT_POSTS = 1000, 64
#: with other workers: seconds a session waits for the worker a fleet-wide plan gave it before any worker takes it,
#: and the age past which their gateways' loads are read again
SHARE_PATIENCE, OTHERS_REFRESH = 5.0, 0.25


def free_slots(fleet: Fleet) -> int:
    """Sessions the fleet can take now: free slots of the healthy gateways not under suspicion."""
    return sum(max(0, g.row.capacity - len(g.sessions)) for g in fleet.gateways.values()
               if g.row.state == HEALTHY and not g.suspect)


def plan(fleet: Fleet, waiting: list[SessionRow]) -> list[tuple[SessionRow, GatewayState]]:
    """A gateway for each waiting session, in order, as long as one has a free slot (pure: the fleet's counts are
    restored before it returns)."""
    chosen: list[tuple[SessionRow, GatewayState]] = []
    for row in waiting:
        gw = fleet.pick(row.session_id)
        if gw is None:
            break
        gw.sessions.add(row.session_id)  # so the next pick() counts it
        chosen.append((row, gw))
    for row, gw in chosen:
        gw.sessions.discard(row.session_id)
    return chosen


class Dispatcher:
    def __init__(self, store: Store, fleet: Fleet, counters: ServerCounters, ledger: Ledger, links: Links,
                 watching: Watching) -> None:
        self.store, self.fleet, self.counters, self.ledger = store, fleet, counters, ledger
        self.links, self.watching = links, watching
        #: the other workers' gateways as last read from the store, and when (fleet_wide)
        self._others: list[GatewayState] = []
        self._others_read = self._others_wall = -float("inf")
        #: the last round left sessions to other workers
        self._elsewhere = False

    async def loop(self) -> None:
        """Each round claims a batch of waiting sessions in one store transaction and posts them concurrently.
        Why batches: one store round trip and one gateway POST awaited per session, on a loop busy with watchers,
        held dispatch to ~100 sessions/s and let the queue (and scheduling latency) grow with every submit.
        Nothing ends the loop: a round that fails is logged and counted, and the next one runs."""
        wake = self.ledger.wake
        while True:
            wake.clear()
            try:
                if await self.round():
                    continue  # maybe more waiting: another round before sleeping
            except Exception:
                self.counters.errors["dispatch_round_failed"] += 1
                log.exception("a dispatch round failed; dispatching goes on")
            # sessions a fleet-wide plan gave another worker's gateways: looked at again once the view may change
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), OTHERS_REFRESH if self._elsewhere else 1.0)

    async def round(self) -> bool:
        """One round; True when a full batch was handled (more may be waiting)."""
        self._elsewhere = False
        if not free_slots(self.fleet):
            return False  # a full fleet reloads nothing
        fleet = await self.fleet_wide() if self.store.shared else self.fleet
        limit = min(free_slots(fleet), BATCH)
        waiting = await self.store.undispatched(limit) if limit else []
        quarantined = [r for r in waiting if r.status.terminal]
        for row in quarantined:
            await self.ledger.ended(row.task_id, row.session_id, row.status, row.reason)
        dispatchable = [r for r in waiting if not r.status.terminal]
        if fleet is not self.fleet:
            if any(row.created > self._others_wall for row in dispatchable):
                fleet = await self.fleet_wide(refresh=True)
            dispatchable = self.my_share(plan(fleet, dispatchable))
        return bool(await self.batch(dispatchable) or quarantined) and len(waiting) == limit

    async def fleet_wide(self, *, refresh: bool = False) -> Fleet:
        """This worker's gateways and the other workers' healthy ones, loaded as the store counted their sessions at
        most ``OTHERS_REFRESH`` seconds ago (a count per round, at every finished session, was most of the store's
        work). ``refresh`` reads them now: :meth:`round` asks for it when a session to plan is newer than the last
        read, so a gateway that registered with another worker before the session's task was submitted is in its plan
        (a view read 0.2 s earlier, between two gateways' registrations, sent a new run's three sessions to one of
        them, queued behind one run slot, and left the other idle)."""
        if refresh or time.monotonic() - self._others_read > OTHERS_REFRESH:
            counts, others = await self.store.in_flight_counts(), []
            for row in await self.store.gateways():
                if row.gateway_id not in self.fleet.gateways and row.state == HEALTHY:
                    other = GatewayState(row)
                    other.sessions = {f"{row.gateway_id}#{i}" for i in range(counts.get(row.gateway_id, 0))}
                    others.append(other)
            self._others, self._others_read, self._others_wall = others, time.monotonic(), time.time()
        view = Fleet()
        view.gateways = dict(self.fleet.gateways)
        view.gateways.update((gw.gateway_id, gw) for gw in self._others if gw.gateway_id not in view.gateways)
        return view

    def my_share(self, chosen: list[tuple[SessionRow, GatewayState]]) -> list[SessionRow]:
        """Of a fleet-wide plan, the sessions it gives this worker's gateways, and those it gives another's that
        have waited past ``SHARE_PATIENCE`` (that worker may be gone): other workers take the rest. Without it, a
        worker took every session its own gateways had room for, and a small batch ran on one worker's gateways."""
        now = time.time()
        mine = [row for row, gw in chosen if gw.gateway_id in self.fleet.gateways or now - row.created > SHARE_PATIENCE]
        self._elsewhere = len(mine) < len(chosen)
        return mine

    async def batch(self, waiting: list[SessionRow]) -> int:
        """Pick a gateway of this worker for each waiting session (as many as have a free slot), claim them, post
        them."""
        chosen = plan(self.fleet, waiting)
        if not chosen:
            return 0
        attempts = await self.store.assign_many([(r.session_id, g.gateway_id) for r, g in chosen])
        claimed = [(r, g, attempts[r.session_id]) for r, g in chosen if r.session_id in attempts]
        for row, gw, _ in claimed:  # the others were cancelled while waiting, or another worker claimed them
            gw.sessions.add(row.session_id)
            gw.posting.add(row.session_id)  # until its post is answered (Dispatcher.post)
        if len(claimed) < len(chosen):  # their slots are free again: another round at once
            self.ledger.wake.set()
        sem = asyncio.Semaphore(CONCURRENT_POSTS)
        await asyncio.gather(*(self._post_claimed(sem, *c) for c in claimed))
        return len(chosen)

    async def _post_claimed(self, sem: asyncio.Semaphore, row: SessionRow, gw: GatewayState, attempt: int) -> None:
        async with sem:
            if gw.row.state == HEALTHY and not gw.suspect:
                await self.post(row, gw, attempt)
                return
        # the gateway stopped accepting after the plan (drained, or a dispatch to it failed): as if never picked
        gw.sessions.discard(row.session_id)
        gw.posting.discard(row.session_id)
        await self.store.release(row.session_id, gw.gateway_id)
        self.ledger.wake.set()

    async def post(self, row: SessionRow, gw: GatewayState, attempt: int) -> None:
        """Hand a claimed session (already counted in ``gw.sessions`` and ``gw.posting``) to its gateway; re-queue it
        on failure."""
        try:
            view = await self.links.gateway(gw).start_session(row.spec)
            if view.attempt_id:
                gw.attempts[row.session_id] = view.attempt_id
                gw.stale.discard(row.session_id)
        except GatewayRefused as exc:
            if exc.status == 409 and row.session_id in gw.stale:
                await self._stale(row, gw)
                return
            if exc.status != 409:  # 409 otherwise: it already runs there (a dispatch before a restart)
                await self._refused(row, gw, attempt, exc)
                return
        except GatewayBadReply as exc:  # a 201 all the same: the session runs there (a new attempt)
            gw.stale.discard(row.session_id)
            self.counters.errors["dispatch_bad_reply"] += 1
            log.warning("%s accepted %s with an unreadable answer: %s", gw.gateway_id, row.session_id, exc)
        except GatewayCallError as exc:
            await self._unreachable(row, gw, attempt, exc)
            return
        finally:
            gw.posting.discard(row.session_id)
        self.counters.dispatch(time.time() - row.created)
        await self.ledger.notify(row.task_id, {"event": "dispatched", "session_id": row.session_id,
                                               "gateway_id": gw.gateway_id, "attempt": attempt})
        self.watching.ensure_watcher(gw)

    async def _stale(self, row: SessionRow, gw: GatewayState) -> None:
        """The gateway still runs an attempt of this session that the server gave up (it came back after being
        declared dead): never adopt it. Ask it to stop and put the session back, uncounted; the next round (at
        most a second later, no wake-up: no hot loop) posts a fresh attempt, to another gateway if one is free."""
        self.counters.errors["dispatch_stale_attempt"] += 1
        gw.sessions.discard(row.session_id)
        with contextlib.suppress(GatewayCallError):
            await self.links.gateway(gw).cancel_session(row.session_id)
        await self.store.release(row.session_id, gw.gateway_id)

    async def _unreachable(self, row: SessionRow, gw: GatewayState, attempt: int, exc: GatewayCallError) -> None:
        self.counters.errors["dispatch_unreachable"] += 1
        gw.sessions.discard(row.session_id)
        gw.suspect = True  # not picked again until a health probe answers
        unreached = isinstance(exc, GatewayUnreachable) and not exc.connected  # it never got there: not a try
        row.attempts = attempt - 1 if unreached else attempt
        if unreached:
            await self.store.refund_attempt(row.session_id)
        else:  # it may have got there: if that attempt runs, it is not the one the server will take
            gw.stale.add(row.session_id)
        await self.ledger.lost(row, f"dispatch to {gw.gateway_id} failed: {exc}", gw.gateway_id,
                               given_up=not unreached)

    async def _refused(self, row: SessionRow, gw: GatewayState, attempt: int, exc: GatewayRefused) -> None:
        self.counters.errors[f"dispatch_http_{exc.status}"] += 1
        gw.sessions.discard(row.session_id)
        if exc.status == 503:
            gw.row.state = DRAINING
            await self.store.save_gateway(gw.row)
        row.attempts = attempt
        await self.ledger.lost(row, f"{gw.gateway_id} refused the session ({exc.status}): {exc.text}", gw.gateway_id)
