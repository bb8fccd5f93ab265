"""The I/O shell of the report: read a finished run's folder into :class:`RunData`, and write report.html.

A run's folder holds results.jsonl (one SessionResult per line, without trajectories), trajectories.jsonl (one
trace per line; the fidelity numbers are computed from it exactly as the launch computed them), config.yaml and,
for a training run, trainer/train_metrics.jsonl. A harness's stderr is read from the session folder its result
names. report.html embeds the resolved config, which may hold a key, so it is written readable by its owner only
(as config.yaml is)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from polar_gym.causes import harness_failed, stderr_tail
from polar_gym.merge.fidelity import Fidelity, run_fidelity
from polar_gym.private_files import write_secret
from polar_gym.report.model import TIMED_STAGES, HarnessFailureRow, RunData, SessionRow
from polar_gym.schema import Trace, Trajectory

__all__ = ["TRAIN_KEYS", "build_report", "failures_of_rows", "fidelity_of_diagnostics", "fidelity_of_files",
           "load_run", "lost_jobs", "read_jsonl", "train_keys_of", "write_report"]

#: what the training figure plots from train_metrics.jsonl, each only when some row has it (SFT: loss; GRPO: the
#: sampled reward with its band from reward_se, the noise-free evaluation, loss; older runs simply lack the new keys)
TRAIN_KEYS = ["reward_mean", "eval/share_right", "eval/p_right", "eval/greedy_success", "loss", "grad_norm",
              "audit/logprob_abs_diff_max", "seconds"]
#: an asynchronous run's panels besides (trainer.max_staleness >= 1): how old its samples were, how long steps waited
ASYNC_TRAIN_KEYS = ["staleness/max", "staleness/mean", "rollout_seconds"]


def train_keys_of(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The training figure's keys for these train_metrics.jsonl rows: :data:`TRAIN_KEYS`, and the staleness panels
    when some sample was sampled by an older version than the one trained (a synchronous run's are all 0)."""
    stale = any(isinstance(r.get("staleness/max"), int | float) and r["staleness/max"] > 0 for r in rows)
    return TRAIN_KEYS + (ASYNC_TRAIN_KEYS if stale else [])


_TRACE_FIELDS = set(Trace.model_fields)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every JSON object of a JSONL file (blank lines skipped); [] when the file is missing."""
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def failures_of_rows(rows: Iterable[Mapping[str, Any]]) -> list[HarnessFailureRow]:
    """The sessions of results.jsonl rows whose harness failed, with the end of their stderr."""
    out = []
    for row in rows:
        metadata = row.get("metadata") if isinstance(row.get("metadata"), dict) else {}
        assert isinstance(metadata, dict)
        failed = harness_failed(metadata)
        if failed is not None:
            out.append(HarnessFailureRow(str(row.get("session_id", "")), str(row.get("task_id", "")),
                                         int(metadata.get("sample_index", 0) or 0), str(row.get("harness") or ""),
                                         failed[0], failed[1], stderr_tail(metadata)))
    return out


def fidelity_of_files(rows: list[dict[str, Any]], traces: Iterable[Mapping[str, Any]]) -> Fidelity:
    """The launch's fidelity numbers again, from results.jsonl (each session's builder diagnostics) and
    trajectories.jsonl (its traces): a session with diagnostics built a trajectory, one without built none."""
    by_session: dict[str, list[Trace]] = {}
    for line in traces:
        by_session.setdefault(str(line.get("session_id")), []).append(
            Trace.model_validate({k: v for k, v in line.items() if k in _TRACE_FIELDS}))

    def trajectory(row: Mapping[str, Any]) -> Trajectory | None:
        diagnostics = row.get("trajectory_diagnostics")
        if not isinstance(diagnostics, dict):
            return None
        session = str(row.get("session_id"))
        return Trajectory(session_id=session, traces=by_session.get(session, []), diagnostics=diagnostics)

    return run_fidelity(trajectory(row) for row in rows)


def fidelity_of_diagnostics(rows: Iterable[Mapping[str, Any]]) -> Fidelity:
    """What results.jsonl alone says (no trajectories.jsonl): token counts, breaks and retries from each
    session's builder diagnostics; contiguity, side requests and prompt modes need the traces."""
    out, breaks = Fidelity(), Counter[str]()
    for row in rows:
        out.sessions += 1
        d = row.get("trajectory_diagnostics")
        if not isinstance(d, dict):
            continue
        out.traces += int(d.get("traces") or 0)
        out.trainable_tokens += int(d.get("trainable_tokens") or 0)
        out.masked_tokens += int(d.get("masked_tokens") or 0)
        out.prompt_tokens += int(d.get("prompt_tokens") or 0)
        out.superseded += len(d.get("superseded") or [])
        out.rerender_merged += int(d.get("rerender_merged") or 0)
        out.without_logprobs += int(d.get("traces_without_logprobs") or 0)
        out.malformed_tool_calls += int(d.get("malformed_tool_calls") or 0)
        breaks.update({str(k): int(v) for k, v in (d.get("breaks") or {}).items()})
    out.breaks = dict(breaks.most_common())
    return out


def load_run(out_dir: Path, title: str | None = None) -> RunData:
    """A finished run's folder as report data."""
    rows = read_jsonl(out_dir / "results.jsonl")
    traces = read_jsonl(out_dir / "trajectories.jsonl")
    note = ""
    if traces or (out_dir / "trajectories.jsonl").exists():
        fidelity = fidelity_of_files(rows, traces)
    else:
        fidelity = fidelity_of_diagnostics(rows)
        note = ("from results.jsonl's builder diagnostics (no launch trajectories.jsonl here): contiguity, "
                "side requests and prompt modes are not counted")
    config = out_dir / "config.yaml"
    train_rows = read_jsonl(out_dir / "trainer" / "train_metrics.jsonl")
    return RunData(title=title or ("training run" if train_rows else "launch"),
                   sessions=[SessionRow.from_row(r) for r in rows], fidelity=fidelity,
                   config_text=config.read_text(encoding="utf-8", errors="replace") if config.exists() else "",
                   harness_failures=failures_of_rows(rows), out_dir=str(out_dir), train_rows=train_rows,
                   train_keys=train_keys_of(train_rows), fidelity_note=note, lost_jobs=lost_jobs(out_dir))


def lost_jobs(out_dir: Path) -> list[dict[str, Any]]:
    """The jobs a launcher=slurm run lost, from its jobs.json (none when there is no such file)."""
    try:
        rows = json.loads((out_dir / "jobs.json").read_text())
    except (OSError, ValueError):
        return []
    return [r for r in rows if isinstance(r, dict) and str(r.get("state", "")).startswith("lost: ")] \
        if isinstance(rows, list) else []


def build_report(run: RunData) -> str:
    """report.html's text (plots drawn here: matplotlib loads on the first report)."""
    from polar_gym.report.figures import figures
    from polar_gym.report.render import render_html

    return render_html(run, figures(run, TIMED_STAGES))


def write_report(run: RunData, path: Path) -> Path:
    """Write report.html (owner-only: it holds the resolved config)."""
    return write_secret(path, build_report(run))
