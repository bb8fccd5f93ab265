"""The gateway's Prometheus families (rendered by polar_gym.prometheus): stage counts and latencies, queue depths,
tokens captured and errors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polar_gym.prometheus import render

__all__ = ["gateway_metrics"]


def gateway_metrics(health: Mapping[str, Any], proxy_stats: Mapping[str, int]) -> str:
    """A gateway's /gateway/health and its proxy's counters as Prometheus families."""
    latency = health.get("latency_seconds", {})
    return render([
        ("polar_gateway_accepting", "gauge", "1 while the gateway accepts sessions.",
         [({}, 1 if health.get("accepting") else 0)]),
        ("polar_gateway_sessions_live", "gauge", "Unfinished sessions by stage.",
         [({"stage": k}, v) for k, v in health.get("stages", {}).items()]),
        ("polar_gateway_sessions_finished_total", "counter", "Finished sessions by final status.",
         [({"status": k}, v) for k, v in sorted(health.get("finished", {}).items())]),
        ("polar_gateway_queue_depth", "gauge", "Sessions waiting for a slot, by stage.",
         [({"stage": k}, v) for k, v in health.get("queue_depths", {}).items()]),
        ("polar_gateway_stage_runs_total", "counter", "Stage executions measured.",
         [({"stage": k}, v["count"]) for k, v in latency.items()]),
        ("polar_gateway_stage_seconds_total", "counter", "Total seconds spent per stage.",
         [({"stage": k}, v["mean"] * v["count"]) for k, v in latency.items()]),
        ("polar_gateway_stage_latency_seconds_max", "gauge", "Longest stage execution seen.",
         [({"stage": k}, v["max"]) for k, v in latency.items()]),
        ("polar_gateway_runtimes_live", "gauge", "Live sandboxes.", [({}, health.get("runtimes_live", 0))]),
        ("polar_gateway_model_requests_total", "counter", "Model calls through the proxy.",
         [({}, proxy_stats.get("requests", 0))]),
        ("polar_gateway_tokens_captured_total", "counter", "Tokens captured, by kind.",
         [({"kind": "prompt"}, proxy_stats.get("prompt_tokens", 0)),
          ({"kind": "response"}, proxy_stats.get("response_tokens", 0))]),
        ("polar_gateway_errors_total", "counter", "Errors by cause.",
         [({"cause": "model_call"}, proxy_stats.get("errors", 0)),
          ({"cause": "session_error"}, health.get("finished", {}).get("ERROR", 0)),
          ({"cause": "session_timeout"}, health.get("finished", {}).get("TIMEOUT", 0))]),
    ])
