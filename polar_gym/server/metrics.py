"""Prometheus text exposition (format 0.0.4), rendered by pure functions so both the rollout server and the gateway
expose ``/metrics`` without a client library: a cluster's existing Prometheus scrapes a run as it is."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["PROMETHEUS_CONTENT_TYPE", "gateway_metrics", "render", "server_metrics"]

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: (name, type, help, [(labels, value), ...])
Family = tuple[str, str, str, list[tuple[Mapping[str, str], float]]]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if value != value:  # NaN
        return "NaN"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def render(families: Iterable[Family]) -> str:
    lines: list[str] = []
    for name, kind, help_, samples in families:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
            lines.append(f"{name}{{{text}}} {_number(value)}" if text else f"{name} {_number(value)}")
    return "\n".join(lines) + "\n"


def server_metrics(sessions: Mapping[str, int], tasks: Mapping[str, int], gateways: list[dict[str, Any]],
                   dispatch_count: int, dispatch_seconds: float, redispatched: int, errors: Mapping[str, int],
                   callbacks: Mapping[str, int]) -> str:
    return render([
        ("polar_server_sessions", "gauge", "Sessions by status.",
         [({"status": k}, v) for k, v in sorted(sessions.items())]),
        ("polar_server_tasks", "gauge", "Tasks by whether all their sessions ended.",
         [({"state": k}, v) for k, v in sorted(tasks.items())]),
        ("polar_server_gateways", "gauge", "Registered gateways by state.",
         [({"state": s}, sum(g["state"] == s for g in gateways)) for s in ("healthy", "draining", "dead")]),
        ("polar_server_gateway_in_flight", "gauge", "Sessions handed to each gateway and not finished.",
         [({"gateway": g["gateway_id"]}, g["in_flight"]) for g in gateways]),
        ("polar_server_dispatches_total", "counter", "Sessions dispatched to a gateway.", [({}, dispatch_count)]),
        ("polar_server_dispatch_latency_seconds_total", "counter",
         "Total submission-to-dispatch seconds (divide by polar_server_dispatches_total for the mean).",
         [({}, dispatch_seconds)]),
        ("polar_server_redispatched_total", "counter", "Sessions re-queued after their gateway lost them.",
         [({}, redispatched)]),
        ("polar_server_errors_total", "counter", "Errors by cause.",
         [({"cause": k}, v) for k, v in sorted(errors.items())]),
        ("polar_server_callbacks_total", "counter", "Callback deliveries by outcome.",
         [({"outcome": k}, v) for k, v in sorted(callbacks.items())]),
    ])


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
