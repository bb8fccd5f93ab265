"""What the rollout server counts for ``/metrics``: one typed record every part updates, so the Prometheus families
read fields (an int is an int) instead of a list of mixed numbers."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

__all__ = ["ServerCounters"]


@dataclass
class ServerCounters:
    #: errors by cause (``dispatch_unreachable``, ``result_http_404``, ``gateway_dead``, ...)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    #: callback deliveries by outcome: delivered, retried, failed
    callbacks: collections.Counter[str] = field(default_factory=collections.Counter)
    #: sessions a gateway accepted
    dispatched: int = 0
    #: total seconds from submission to dispatch over those sessions
    dispatch_seconds: float = 0.0
    #: sessions re-queued after their gateway lost them
    redispatched: int = 0

    def dispatch(self, waited: float) -> None:
        """A gateway accepted a session ``waited`` seconds after it was submitted."""
        self.dispatched += 1
        self.dispatch_seconds += max(0.0, waited)
