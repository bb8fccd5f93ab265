"""Prometheus text exposition (format 0.0.4), rendered by a pure function so the rollout server and the gateway
expose ``/metrics`` without a client library: a cluster's existing Prometheus scrapes a run as it is.

Ground layer: imports nothing else of ours; each service keeps the families it exposes next to its own code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["PROMETHEUS_CONTENT_TYPE", "Family", "Sample", "render"]

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: (labels, value) of one time series
Sample = tuple[Mapping[str, str], float]
#: (name, type, help, samples)
Family = tuple[str, str, str, list[Sample]]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if value != value:  # NaN
        return "NaN"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def render(families: Iterable[Family]) -> str:
    """The exposition text of ``families``: HELP and TYPE lines, then one line per sample."""
    lines: list[str] = []
    for name, kind, help_, samples in families:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
            lines.append(f"{name}{{{text}}} {_number(value)}" if text else f"{name} {_number(value)}")
    return "\n".join(lines) + "\n"
