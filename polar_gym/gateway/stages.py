"""The stage functions the node schedules: the seam that makes the node's scheduling testable and benchmarkable on
its own. The node decides *when* a session runs which stage (pools, deadline, cancellation, statuses); a
:class:`Stages` implementation decides *what* a stage does. :class:`~polar_gym.gateway.sandbox.SandboxStages` is
the real one (runtimes, harness, proxy journal, builder, evaluator); benchmarks inject ``asyncio.sleep`` stages.

Contract: every method may be cancelled at any await (the node cancels on ``cancel(session_id)``, ``stop()`` and at
the deadline) and must then leave whatever it started findable by ``teardown``, which is always called exactly once
per session, must be idempotent about partial state, and must not raise.
"""

from __future__ import annotations

import abc

from polar_gym.gateway.session import Session
from polar_gym.gateway.sizing import NodePressure
from polar_gym.schema import SessionResult

__all__ = ["Stages"]


class Stages(abc.ABC):
    def registered(self, session: Session) -> None:
        """At submit, before the caller hears of the session (synchronous): e.g. make its attempt the one that
        reading the session returns, so no reader sees an earlier attempt's captures as this one's."""
        return None

    @abc.abstractmethod
    async def init(self, session: Session) -> None:
        """INIT: create the session's runtime and prepare it (prepare actions, harness files)."""

    @abc.abstractmethod
    async def run(self, session: Session) -> None:
        """RUNNING: register the session's key, run the harness until it exits or the deadline, keep its logs.
        Sets ``session.harness_result``; a harness killed at the deadline is reported there (status TIMEOUT)."""

    def wants_prewarm(self, session: Session) -> bool:
        """Whether evaluation needs a fresh runtime, prepared by :meth:`prewarm` while the harness runs."""
        return False

    async def prewarm(self, session: Session) -> None:
        """Prepare the fresh evaluation runtime (``session.eval_runtime``); runs concurrently with :meth:`run`."""
        return None

    @abc.abstractmethod
    async def build(self, session: Session) -> None:
        """BUILDING: read the session's completions and build ``session.trajectory``."""

    @abc.abstractmethod
    async def evaluate(self, session: Session) -> None:
        """EVALUATING: score the trajectory (``session.evaluation``) and put the rewards on its traces."""

    @abc.abstractmethod
    async def teardown(self, session: Session) -> None:
        """Stop every runtime of the session and forget its key. Never raises."""

    async def finished(self, session: Session, result: SessionResult) -> None:
        """After the result is final (e.g. write it next to the artifacts). Exceptions are logged."""
        return None

    def pressure(self) -> NodePressure:
        """The node's resources as self-sizing pools see them (memory, disk, model-call times); unknown: no limit."""
        return NodePressure()

    def live_runtimes(self) -> int:
        """Runtimes started and not yet stopped (for health and leak checks)."""
        return 0
