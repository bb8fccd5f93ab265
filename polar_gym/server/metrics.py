"""The rollout server's Prometheus families (rendered by polar_gym.prometheus)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polar_gym.prometheus import render
from polar_gym.server.counters import ServerCounters

__all__ = ["server_metrics"]


def server_metrics(sessions: Mapping[str, int], tasks: Mapping[str, int], gateways: list[dict[str, Any]],
                   counters: ServerCounters) -> str:
    return render([
        ("polar_server_sessions", "gauge", "Sessions by status.",
         [({"status": k}, v) for k, v in sorted(sessions.items())]),
        ("polar_server_tasks", "gauge", "Tasks by whether all their sessions ended.",
         [({"state": k}, v) for k, v in sorted(tasks.items())]),
        ("polar_server_gateways", "gauge", "Registered gateways by state.",
         [({"state": s}, sum(g["state"] == s for g in gateways)) for s in ("healthy", "draining", "dead")]),
        ("polar_server_gateway_in_flight", "gauge", "Sessions handed to each gateway and not finished.",
         [({"gateway": g["gateway_id"]}, g["in_flight"]) for g in gateways]),
        ("polar_server_dispatches_total", "counter", "Sessions dispatched to a gateway.", [({}, counters.dispatched)]),
        ("polar_server_dispatch_latency_seconds_total", "counter",
         "Total submission-to-dispatch seconds (divide by polar_server_dispatches_total for the mean).",
         [({}, counters.dispatch_seconds)]),
        ("polar_server_redispatched_total", "counter", "Sessions re-queued after their gateway lost them.",
         [({}, counters.redispatched)]),
        ("polar_server_errors_total", "counter", "Errors by cause.",
         [({"cause": k}, v) for k, v in sorted(counters.errors.items())]),
        ("polar_server_callbacks_total", "counter", "Callback deliveries by outcome.",
         [({"outcome": k}, v) for k, v in sorted(counters.callbacks.items())]),
    ])
