"""``per_request``: one trace per completion, lossless (every sampled token trained once, in its exact context)."""

from __future__ import annotations

from polar_gym.merge.base import MergeConfig, TraceBuilder, partition, trajectory
from polar_gym.schema import CompletionSession, Trajectory

__all__ = ["per_request"]


def per_request(session: CompletionSession, config: MergeConfig | None = None) -> Trajectory:
    config = config or MergeConfig()
    usable, excluded = partition(session, config)
    traces = [TraceBuilder(rec).build(i) for i, rec in enumerate(usable)]
    diagnostics = {"completions": len(session.completions), "chains": len(traces), "completions_merged": 0,
                   "breaks": {}, "excluded": excluded}
    return trajectory(session, "per_request", traces, diagnostics)
