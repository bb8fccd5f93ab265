"""Watching the fleet: one batch long poll per gateway for the sessions handed to it (results, statuses, sessions
it lost), a health probe of every live gateway each interval, and the death of a gateway that stops answering (its
sessions are re-queued through the ledger)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from polar_gym.causes import UNSTORABLE_RESULT
from polar_gym.gateway.client import PolledSessions
from polar_gym.gateway.errors import GatewayCallError, GatewayRefused
from polar_gym.result_codec import PackedResult
from polar_gym.schema import SessionStatus
from polar_gym.server.background import Background
from polar_gym.server.counters import ServerCounters
from polar_gym.server.fleet import DEAD, Fleet, GatewayState
from polar_gym.server.ledger import Ledger, ended_as
from polar_gym.server.links import Links
from polar_gym.server.store import Store

__all__ = ["Watching"]

log = logging.getLogger(__name__)
S = SessionStatus


class Watching:
    def __init__(self, store: Store, fleet: Fleet, counters: ServerCounters, ledger: Ledger, links: Links,
                 background: Background, *, heartbeat_interval: float, dead_after: float, result_wait: float) -> None:
        self.store, self.fleet, self.counters, self.ledger = store, fleet, counters, ledger
        self.links, self.background = links, background
        self.heartbeat_interval, self.dead_after, self.result_wait = heartbeat_interval, dead_after, result_wait

    # -- liveness --------------------------------------------------------------------------------------------

    async def monitor_loop(self) -> None:
        while True:
            try:
                await asyncio.gather(*(self.probe(gw) for gw in self.fleet.live()))
                now = time.monotonic()
                for gw in self.fleet.live():
                    if now - gw.last_seen > self.dead_after:
                        await self.declare_dead(gw)
            except Exception:
                self.counters.errors["monitor_round_failed"] += 1
                log.exception("a gateway monitoring round failed; monitoring goes on")
            await asyncio.sleep(self.heartbeat_interval)

    async def probe(self, gw: GatewayState) -> None:
        """Gateways need not push heartbeats: a health answer counts as one."""
        try:
            health = await self.links.gateway(gw).health(timeout=max(self.heartbeat_interval, 1.0))
        except GatewayRefused:
            return  # it answers, though not yet (or no longer) with its health: heartbeats decide
        except GatewayCallError:
            self.counters.errors["heartbeat_failed"] += 1
            return
        gw.last_seen, gw.health, gw.suspect = time.monotonic(), health.model_dump(mode="json"), False

    async def declare_dead(self, gw: GatewayState, left: bool = False) -> None:
        """``gw`` is gone: it missed its heartbeats (an error), or it ``left`` (shut down, and said so)."""
        why = "left the fleet" if left else "missed heartbeats"
        log.warning("gateway %s (%s) %s: re-dispatching %d sessions", gw.gateway_id, gw.url, why, len(gw.sessions))
        if not left:
            self.counters.errors["gateway_dead"] += 1
        gw.row.state = DEAD
        await self.store.save_gateway(gw.row)
        lost, gw.sessions = list(gw.sessions), set()
        gw.stale.update(lost)  # if it comes back (a partition, a stopped process), its late results are refused
        for session_id in lost:
            gw.attempts.pop(session_id, None)
        for session_id in lost:
            row = await self.store.session(session_id)
            if row is not None and not row.status.terminal:
                await self.ledger.lost(row, f"gateway {gw.gateway_id} ({gw.url}) "
                                       + ("left the fleet" if left else "stopped answering"), gw.gateway_id,
                                       given_up=True)
        self.ledger.wake.set()

    # -- results ---------------------------------------------------------------------------------------------

    def ensure_watcher(self, gw: GatewayState) -> None:
        """One watcher per gateway (not one long poll per session: a thousand of those starved the event loop and
        the HTTP pool after a restart); a new session wakes it."""
        gw.added.set()
        if gw.watcher is None or gw.watcher.done():
            gw.watcher = self.background.spawn(self.watch(gw))

    async def watch(self, gw: GatewayState) -> None:
        """Batch long polls (POST /sessions/poll) for every session this server handed to ``gw``, until the
        gateway is declared dead; sessions dispatched meanwhile join the next poll (a poll waits at most
        ``result_wait`` seconds)."""
        last: dict[str, str] = {}
        while gw.row.state != DEAD and not gw.released:
            gw.added.clear()
            # a session re-posted where a stale attempt of it may sit is polled once the gateway named its new one
            # and one being posted once the gateway has answered the post
            ids = [i for i in gw.sessions if (i not in gw.stale or i in gw.attempts) and i not in gw.posting]
            if not ids:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(gw.added.wait(), 60.0)
                continue
            try:
                polled = await self.links.gateway(gw).poll(ids, self.result_wait)
            except GatewayCallError as exc:  # a gateway shutting down or overloaded: ask again, heartbeats decide
                cause = f"result_http_{exc.status}" if isinstance(exc, GatewayRefused) else "result_poll_failed"
                self.counters.errors[cause] += 1
                await asyncio.sleep(min(1.0, self.heartbeat_interval))
                continue
            await self.unreadable(gw, polled)
            for result in polled.results:
                last.pop(result.session_id, None)
            mine = [r for r in polled.results if r.session_id in gw.sessions
                    and not (r.session_id in gw.withdrawing and r.head.status is S.CANCELLED)]  # queued again
            stale = [r for r in mine if not _current_attempt(gw, r)]
            for result in stale:  # an attempt this server did not hand out: never stored, never trained
                self.counters.errors["result_stale_attempt"] += 1
                log.warning("refused a result of %s from %s: attempt %s is not the one dispatched there (%s)",
                            result.session_id, gw.gateway_id, result.head.attempt_id,
                            gw.attempts.get(result.session_id))
                gw.sessions.discard(result.session_id)
                gw.stale.add(result.session_id)
                row = await self.store.session(result.session_id)
                if row is not None and not row.status.terminal:
                    await self.ledger.lost(row, f"{gw.gateway_id} answered with a stale attempt", gw.gateway_id,
                                           given_up=True)
            mine = [r for r in mine if _current_attempt(gw, r)]
            for result in mine:
                gw.attempts.pop(result.session_id, None)
            for start in range(0, len(mine), 64):  # concurrently: each finish waits on the store and callbacks
                await asyncio.gather(*(self.ledger.finish(r, gw) for r in mine[start:start + 64]))
            for session_id, status in polled.statuses.items():
                if session_id in gw.sessions and status != last.get(session_id) and status in S.__members__ \
                        and not S(status).terminal:
                    last[session_id] = status
                    await self.ledger.status(session_id, S(status))
            for session_id in polled.unknown:
                if session_id in gw.sessions:
                    self.counters.errors["result_http_404"] += 1
                    gw.sessions.discard(session_id)
                    last.pop(session_id, None)
                    row = await self.store.session(session_id)
                    if row is not None and not row.status.terminal:
                        await self.ledger.lost(row, f"{gw.gateway_id} does not know the session any more",
                                               gw.gateway_id)


    async def unreadable(self, gw: GatewayState, polled: PolledSessions) -> None:
        """Results that did not validate: one bad result must not stop the watch of the others, and it is set aside
        once (the session ends ERROR, cause unstorable_result). It used to stay watched, and the gateway answered
        the next poll at once with the same result: a loop of thousands of log lines a minute, and a run that
        never ended."""
        named = {why for _, why in polled.unreadable_ids.values()}
        for why in polled.unreadable:
            if why not in named:  # no session id to end: counted and logged, nothing to retry
                self.counters.errors["result_unreadable"] += 1
                log.error("unreadable result from %s: %s", gw.gateway_id, why)
        for session_id, (attempt, why) in polled.unreadable_ids.items():
            if session_id not in gw.sessions:
                continue
            self.counters.errors["result_unreadable"] += 1
            gw.sessions.discard(session_id)
            expected = gw.attempts.pop(session_id, None)
            row = await self.store.session(session_id)
            if row is None or row.status.terminal:
                continue
            if (expected is not None and attempt not in (None, expected)) or (expected is None
                                                                              and session_id in gw.stale):
                gw.stale.add(session_id)  # an attempt this server did not hand out, as for a readable one
                await self.ledger.lost(row, f"{gw.gateway_id} answered with a stale attempt", gw.gateway_id,
                                           given_up=True)
                continue
            reason = f"{UNSTORABLE_RESULT}: the result {gw.gateway_id} sent could not be read: {why}"
            log.error("session %s ends ERROR, its result set aside: %s", session_id, reason)
            await self.ledger.finish(ended_as(row, S.ERROR, reason), gw)


def _current_attempt(gw: GatewayState, result: PackedResult) -> bool:
    """Whether a result comes from the attempt the gateway accepted (unknown after a server restart: accepted)."""
    expected = gw.attempts.get(result.session_id)
    if expected is None:
        return result.session_id not in gw.stale
    return result.head.attempt_id == expected
