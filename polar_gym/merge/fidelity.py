"""A run's token fidelity in a few numbers: what a researcher checks before training on its traces (the launch's
summary.md and console, and anything else that reports a run). Pure: it reads built trajectories only.

- trainable vs masked tokens: mask-1 tokens were sampled by the engine; mask-0 ones are bridges (tool results, user
  turns the harness added between calls);
- chains per session and new chains by cause (``drift``, ``thinking_dropped``, ``compaction``, ``new_context``,
  ``fork``...): more chains than conversations means context the builder could not prove;
- superseded retries, side-request traces, traces without logprobs, replies merged over a re-rendering;
- contiguity: traces that break NeMo RL's rule (each turn's prompt extends the last), which must be none;
- prompt modes: how the prompts reached the engine (``token_in``: the proxy's exact ids; ``chat``: re-rendered);
- malformed tool calls: blocks the parser could not read, the traces holding them, and what the run's policy did
  with those traces (:mod:`polar_gym.merge.tool_calls`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from pydantic import BaseModel, Field

from polar_gym.merge.exports import ContiguityError, check_contiguity, nemo_items
from polar_gym.schema import Trajectory

__all__ = ["Fidelity", "run_fidelity"]


class Fidelity(BaseModel):
    """Token-fidelity totals of a run (see the module docstring)."""

    sessions: int = 0
    traces: int = 0
    trainable_tokens: int = 0
    masked_tokens: int = 0
    prompt_tokens: int = 0
    breaks: dict[str, int] = Field(default_factory=dict)
    superseded: int = 0
    side_request_traces: int = 0
    without_logprobs: int = 0
    rerender_merged: int = 0
    not_contiguous: int = 0
    prompt_modes: dict[str, int] = Field(default_factory=dict)
    malformed_tool_calls: int = 0
    malformed_traces: int = 0
    #: traces with a malformed call, by the policy applied to them
    malformed_policies: dict[str, int] = Field(default_factory=dict)

    def malformed_text(self) -> str:
        """``N in M traces (policy K, ...)``, or ``none``."""
        if not self.malformed_tool_calls:
            return "none"
        policies = ", ".join(f"{p} {n}" for p, n in self.malformed_policies.items())
        return f"{self.malformed_tool_calls} in {self.malformed_traces} traces" + (f" ({policies})" if policies else "")

    def line(self) -> str:
        """One line of text with every number, for summary.md and the console."""
        per = f"{self.traces / self.sessions:.2f}" if self.sessions else "-"
        breaks = ", ".join(f"{cause} {n}" for cause, n in self.breaks.items()) or "none"
        modes = ", ".join(f"{mode} {n}" for mode, n in self.prompt_modes.items()) or "unknown"
        return (f"fidelity: {self.trainable_tokens} trainable / {self.masked_tokens} masked tokens in {self.traces} "
                f"traces ({per} per session); new chains by cause: {breaks}; {self.superseded} superseded "
                f"retries; {self.side_request_traces} side-request traces; {self.without_logprobs} without "
                f"logprobs; {self.rerender_merged} merged over a re-rendering; contiguity "
                f"{'ok' if not self.not_contiguous else f'BROKEN in {self.not_contiguous} traces'}; prompt mode "
                f"{modes} (calls); malformed tool calls {self.malformed_text()}")


def run_fidelity(trajectories: Iterable[Trajectory | None]) -> Fidelity:
    """The fidelity totals of a run's trajectories (None: a session that built none, still counted)."""
    out = Fidelity()
    breaks: Counter[str] = Counter()
    modes: Counter[str] = Counter()
    policies: Counter[str] = Counter()
    for traj in trajectories:
        out.sessions += 1
        if traj is None:
            continue
        diagnostics = traj.diagnostics
        breaks.update({str(k): int(v) for k, v in (diagnostics.get("breaks") or {}).items()})
        out.superseded += len(diagnostics.get("superseded") or [])
        out.rerender_merged += int(diagnostics.get("rerender_merged") or 0)
        for trace in traj.traces:
            if trace.metadata.get("superseded"):
                continue  # kept for inspection (keep_superseded), not for training
            out.traces += 1
            trained = sum(trace.loss_mask)
            out.trainable_tokens += trained
            out.masked_tokens += len(trace.loss_mask) - trained
            out.prompt_tokens += len(trace.prompt_ids)
            out.side_request_traces += bool(trace.metadata.get("side_request"))
            out.without_logprobs += trace.metadata.get("has_logprobs") is False
            modes.update(str(span.get("prompt_mode") or "unknown") for span in trace.metadata.get("spans") or [])
            if trace.metadata.get("tool_call_parse") == "malformed":
                out.malformed_traces += 1
                out.malformed_tool_calls += len(trace.metadata.get("malformed_tool_calls") or ())
                policies[str(trace.metadata.get("malformed_tool_call_policy") or "none")] += 1
            try:
                check_contiguity(nemo_items(trace))
            except ContiguityError:
                out.not_contiguous += 1
    out.breaks = dict(breaks.most_common())
    out.prompt_modes = dict(modes.most_common())
    out.malformed_policies = dict(policies.most_common())
    return out
