"""The run's files: trajectories.jsonl (one line per trace), results.jsonl (SessionResults without trajectories),
calls.jsonl (per session, the model calls' timings, engine and status the gateway shipped with its result),
summary.md (a table per session plus totals and the token-fidelity line, :mod:`polar_gym.merge.fidelity`), the
resolved config and, for a datagen run, the SFT dataset.

Errors are reported by cause (a line per cause with its count, in the console and summary.md; ``error_cause`` on
every line of results.jsonl), so a broken upstream is not mistaken for a policy that scores 0. The gateway's rule
for model calls that fail for infrastructure reasons (upstream unreachable, 5xx, timeout; a 4xx the server answers
to the harness's own request does not count): if no call succeeded after the last such failure the session ends
ERROR, unscored, with the cause first in its reason; a failure the harness got past keeps the session's status and
is counted (``model_call_failures``). The launch exits 3 when a session has an infrastructure cause."""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from polar_gym.causes import INVALID_TASK
from polar_gym.merge.fidelity import Fidelity, run_fidelity
from polar_gym.private_files import open_private, private_dir, write_secret
from polar_gym.report import INFRA_CAUSES, HarnessFailureRow, RunData, SessionRow, error_cause, harness_failed
from polar_gym.report import stderr_tail as read_stderr_tail
from polar_gym.report import write_report as write_report_file
from polar_gym.report.files import lost_jobs
from polar_gym.schema import AgentSpec, SessionResult, SessionSpec, SessionStatus
from polar_gym.tasks.refused import RefusedTask

if TYPE_CHECKING:
    from polar_gym.launch.config import LaunchJob

__all__ = ["INFRA_CAUSES", "REPORT", "HarnessFailure", "SessionOutcome", "error_cause", "errors_by_cause", "finish",
           "harness_failures", "print_summary", "refused_outcome", "result_row", "summary_rows", "write_outputs",
           "write_report"]

_FAILED = {SessionStatus.ERROR, SessionStatus.CANCELLED}
#: the run report's file name, beside summary.md
REPORT = "report.html"


def errors_by_cause(outcomes: list[SessionOutcome]) -> dict[str, tuple[int, str]]:
    """cause -> (sessions, the first one's reason), most frequent first."""
    counts: collections.Counter[str] = collections.Counter()
    example: dict[str, str] = {}
    for o in outcomes:
        cause = error_cause(o.result)
        if cause is not None:
            counts[cause] += 1
            example.setdefault(cause, o.result.reason or "")
    return {cause: (n, example[cause]) for cause, n in counts.most_common()}


def _failed_calls(outcomes: list[SessionOutcome]) -> tuple[int, int]:
    """Model calls that failed for infrastructure reasons in all, and in how many sessions."""
    per = []
    for o in outcomes:
        artifacts = o.result.metadata.get("artifacts")
        failures = artifacts.get("model_call_failures") if isinstance(artifacts, dict) else None
        if isinstance(failures, dict):
            per.append(int(failures.get("failed", 0)))
    return sum(per), len(per)


@dataclass(frozen=True)
class HarnessFailure:
    """A session whose harness did not exit cleanly (it may still have completed, scored 0): the harness's own
    status and exit code, and the end of its stderr (``artifacts/harness.stderr`` in the session's folder)."""

    outcome: SessionOutcome
    status: str
    exit_code: int | None
    stderr_tail: str


def harness_failures(outcomes: list[SessionOutcome], tail_bytes: int = 2000) -> list[HarnessFailure]:
    """Every session whose harness failed, timed out or exited non-zero, with the tail of its stderr."""
    out = []
    for o in outcomes:
        failed = harness_failed(o.result.metadata)
        if failed is not None:
            out.append(HarnessFailure(o, failed[0], failed[1], read_stderr_tail(o.result.metadata, tail_bytes)))
    return out


def _last_lines(text: str, lines: int = 3, limit: int = 300) -> str:
    """The last lines of what a harness wrote, on one line and printable only: the sandboxed agent writes it, and
    terminal escape sequences must not reach the user's console."""
    kept = " / ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())
    kept = "".join(c if c.isprintable() else "\N{REPLACEMENT CHARACTER}" for c in kept)
    return kept if len(kept) <= limit else "…" + kept[-(limit - 1):]


def _excerpt(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


@dataclass
class SessionOutcome:
    """One finished session with what the launcher measured around it."""

    spec: SessionSpec
    result: SessionResult
    completions: int
    seconds: float

    @property
    def reward(self) -> float | None:
        return self.result.evaluation.reward if self.result.evaluation is not None else None

    @property
    def traces(self) -> int:
        return len(self.result.trajectory.traces) if self.result.trajectory is not None else 0


def _trace_lines(o: SessionOutcome) -> list[str]:
    if o.result.trajectory is None:
        return []
    head = {"session_id": o.spec.session_id, "task_id": o.spec.task_id, "sample_index": o.spec.sample_index,
            "harness": o.spec.agent.harness, "builder": o.result.trajectory.builder, "status": o.result.status.value,
            "session_reward": o.reward}
    return [json.dumps({**head, "trace_index": i, **trace.model_dump(mode="json")})
            for i, trace in enumerate(o.result.trajectory.traces)]


def result_row(o: SessionOutcome) -> dict[str, Any]:
    """One line of results.jsonl: the SessionResult without its trajectory, plus the launch's columns and the
    builder's diagnostics."""
    data: dict[str, Any] = o.result.model_dump(mode="json", exclude={"trajectory"})
    artifacts = (data.get("metadata") or {}).get("artifacts")
    if isinstance(artifacts, dict):
        artifacts.pop("call_log", None)  # in calls.jsonl: the rows stay small
    data.update(harness=o.spec.agent.harness, traces=o.traces, completions=o.completions, seconds=round(o.seconds, 3),
                error_cause=error_cause(o.result))
    if o.result.trajectory is not None:
        data["trajectory_diagnostics"] = o.result.trajectory.diagnostics
    return data


def summary_rows(outcomes: list[SessionOutcome]) -> list[list[str]]:
    """One row per session: task, sample, harness, status, reward, traces, completions, seconds."""
    return [[o.spec.task_id, str(o.spec.sample_index), o.spec.agent.harness, o.result.status.value,
             "-" if o.reward is None else f"{o.reward:g}", str(o.traces), str(o.completions), f"{o.seconds:.1f}"]
            for o in outcomes]


def _fidelity(outcomes: list[SessionOutcome]) -> Fidelity:
    return run_fidelity(o.result.trajectory for o in outcomes)


def _totals(outcomes: list[SessionOutcome], wall: float) -> dict[str, Any]:
    rewards = [o.reward for o in outcomes if o.reward is not None]
    return {"sessions": len(outcomes),
            "completed": sum(o.result.status is SessionStatus.COMPLETED for o in outcomes),
            "errored": sum(o.result.status is SessionStatus.ERROR for o in outcomes),
            "mean_reward": sum(rewards) / len(rewards) if rewards else None,
            "errors_by_cause": {cause: n for cause, (n, _) in errors_by_cause(outcomes).items()},
            "failed_model_calls": _failed_calls(outcomes)[0],
            "traces": sum(o.traces for o in outcomes), "completions": sum(o.completions for o in outcomes),
            "wall_seconds": wall, "fidelity": _fidelity(outcomes).model_dump()}


def _summary_md(outcomes: list[SessionOutcome], wall: float, t: dict[str, Any]) -> str:
    header = ["task", "sample", "harness", "status", "reward", "traces", "completions", "seconds"]
    lines = ["# polar_gym launch summary", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in summary_rows(outcomes)]
    mean = "-" if t["mean_reward"] is None else f"{t['mean_reward']:.3f}"
    lines += [f"| **total** ({t['sessions']} sessions) | | | {t['completed']} completed, {t['errored']} errored "
              f"| mean {mean} | {t['traces']} | {t['completions']} | {wall:.1f} wall |", "",
              Fidelity.model_validate(t["fidelity"]).line(), "",
              f"Report: [{REPORT}]({REPORT}) (plots, token fidelity, harness failures, config); rebuild it with "
              "`python -m polar_gym.report OUT_DIR`." if "report_error" not in t else
              f"Report: {REPORT} was not written ({_excerpt(t['report_error'])}); "
              "`python -m polar_gym.report OUT_DIR` retries it.",
              "Traces: `python -m polar_gym.view OUT_DIR` opens the sessions, their messages and token streams (by "
              "loss mask, with logprobs) in a browser.", ""]
    lines += _lost_jobs_md(t.get("lost_jobs") or [])
    causes = errors_by_cause(outcomes)
    if causes:
        lines += ["## Errors by cause", "", "| cause | sessions | first reason |", "|---|---|---|"]
        lines += [f"| {cause} | {n} | {_excerpt(reason).replace('|', '/')} |" for cause, (n, reason) in causes.items()]
        lines.append("")
    calls, sessions = _failed_calls(outcomes)
    if calls:
        lines += [f"{calls} model call(s) failed for infrastructure reasons, in {sessions} session(s); "
                  "see `model_call_failures` in results.jsonl.", ""]
    failures = harness_failures(outcomes)
    if failures:
        lines += ["## Harness failures", "",
                  "| task | sample | harness | status | exit code | session | stderr (end) |", "|" + "---|" * 7]
        lines += [f"| {f.outcome.spec.task_id} | {f.outcome.spec.sample_index} | {f.outcome.spec.agent.harness} | "
                  f"{f.status} | {'-' if f.exit_code is None else f.exit_code} | `{f.outcome.spec.session_id}` | "
                  f"{_last_lines(f.stderr_tail).replace('|', '/') or '(empty)'} |" for f in failures]
        lines.append("")
    problems = [o for o in outcomes if o.result.status is not SessionStatus.COMPLETED]
    if problems:
        lines += ["## Sessions that did not complete", ""]
        lines += [f"- `{o.spec.session_id}` ({o.result.status.value}): {o.result.reason}" for o in problems]
        lines.append("")
    return "\n".join(lines)


def _lost_jobs_md(lost: list[dict[str, Any]]) -> list[str]:
    """summary.md's section on the Slurm jobs lost mid-run (empty when none was)."""
    if not lost:
        return []
    lines = ["## Lost jobs", "", "A gateway's sessions were re-dispatched to the others by the rollout server; a lost "
             "server or inference job ended the run (its unfinished sessions are ERROR `job_lost`).", "",
             "| job | name | role | state | after (s) | replaced by |", "|---|---|---|---|---|---|"]
    lines += [f"| {j['job_id']} | {j['name']} | {j['role']} | {j['state']} | {float(j['seconds']):.0f} | "
              f"{j.get('replaced_by') or '-'} |" for j in lost]
    return [*lines, ""]


def write_outputs(out_dir: Path, outcomes: list[SessionOutcome], wall: float, *, title: str = "launch",
                  lost_jobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Write trajectories.jsonl, results.jsonl, summary.md and report.html under ``out_dir``; returns the totals
    (``lost_jobs``: the Slurm jobs the run lost, :mod:`polar_gym.launch.lost_jobs`)."""
    private_dir(out_dir)  # prompts and completions: every file here is the owner's only (0600)
    with open_private(out_dir / "trajectories.jsonl") as f:
        for o in outcomes:
            for line in _trace_lines(o):
                f.write(line + "\n")
    with open_private(out_dir / "calls.jsonl") as f:
        for o in outcomes:
            calls = (o.result.metadata.get("artifacts") or {}).get("call_log")
            if isinstance(calls, list):
                f.write(json.dumps({"session_id": o.spec.session_id, "calls": calls}) + "\n")
    rows = [result_row(o) for o in outcomes]
    with open_private(out_dir / "results.jsonl") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    totals = _totals(outcomes, wall)  # once: the fidelity totals walk every trace
    totals["lost_jobs"] = list(lost_jobs or [])
    try:
        write_report(out_dir, outcomes, rows, Fidelity.model_validate(totals["fidelity"]), wall=wall, title=title)
    except Exception as exc:  # the run's data files are written: a failed page must not cost its exit code
        totals["report_error"] = f"{type(exc).__name__}: {exc}"
    write_secret(out_dir / "summary.md", _summary_md(outcomes, wall, totals))
    return totals


def write_report(out_dir: Path, outcomes: list[SessionOutcome], rows: list[dict[str, Any]], fidelity: Fidelity, *,
                 wall: float | None, title: str, train_rows: list[dict[str, Any]] | None = None,
                 train_keys: list[str] | None = None) -> Path:
    """report.html (:mod:`polar_gym.report`) from the run's outcomes, their results.jsonl rows, the fidelity
    totals and config.yaml (written by the launcher before the run)."""
    config = out_dir / "config.yaml"
    failures = [HarnessFailureRow(f.outcome.spec.session_id, f.outcome.spec.task_id, f.outcome.spec.sample_index,
                                  f.outcome.spec.agent.harness, f.status, f.exit_code, f.stderr_tail)
                for f in harness_failures(outcomes)]
    run = RunData(title=title, sessions=[SessionRow.from_row(r) for r in rows], fidelity=fidelity,
                  config_text=config.read_text(encoding="utf-8", errors="replace") if config.exists() else "",
                  harness_failures=failures, wall_seconds=wall, out_dir=str(out_dir), train_rows=train_rows or [],
                  train_keys=train_keys or [], lost_jobs=lost_jobs(out_dir))
    return write_report_file(run, out_dir / REPORT)


def print_summary(console: Console, outcomes: list[SessionOutcome], totals: dict[str, Any], out_dir: Path) -> None:
    """The per-session table and the totals line at the end of a launch."""
    table = Table(title="polar_gym launch")
    for column in ["task", "sample", "harness", "status", "reward", "traces", "completions", "seconds"]:
        table.add_column(column)
    for row in summary_rows(outcomes):
        table.add_row(*row)
    console.print(table)
    mean = totals["mean_reward"]
    console.print(f"{totals['completed']}/{totals['sessions']} completed, mean reward "
                  f"{'-' if mean is None else f'{mean:.3f}'}, {totals['traces']} traces, "
                  f"{totals['completions']} completions in {totals['wall_seconds']:.1f}s; files in {out_dir}")
    if "report_error" in totals:
        console.print(f"[bold red]{REPORT} was not written[/]: {escape(totals['report_error'])} (`python -m "
                      f"polar_gym.report {escape(str(out_dir))}` retries it)", highlight=False)
    else:
        console.print(f"report: {escape(str(out_dir / REPORT))}", highlight=False)
    console.print(f"traces: python -m polar_gym.view {escape(str(out_dir))}", highlight=False)
    fidelity = Fidelity.model_validate(totals["fidelity"])
    style = "bold red" if fidelity.not_contiguous else "default"
    console.print(f"[{style}]{escape(fidelity.line())}[/]", highlight=False)
    for lost in totals.get("lost_jobs") or []:
        replaced = f", replaced by job {lost['replaced_by']}" if lost.get("replaced_by") else ""
        console.print(f"[bold red]lost job[/] {escape(str(lost['job_id']))} ({escape(str(lost['name']))}): "
                      f"{escape(str(lost['state']))}{replaced}", highlight=False)
    causes = errors_by_cause(outcomes)
    if causes:
        console.print("errors by cause:")
        for cause, (n, reason) in causes.items():
            style = "bold red" if cause in INFRA_CAUSES else "yellow"
            detail = reason.removeprefix(f"{cause}: ")
            console.print(f"  [{style}]{cause}[/]: {n} session(s), e.g. {escape(_excerpt(detail))}", highlight=False)
    calls, sessions = _failed_calls(outcomes)
    if calls:
        console.print(f"{calls} model call(s) failed for infrastructure reasons, in {sessions} session(s)")
    failures = harness_failures(outcomes)
    if failures:
        console.print(f"[yellow]{len(failures)} session(s) whose harness failed[/] (summary.md lists them):")
        for f in failures[:5]:
            code = "" if f.exit_code is None else f" exit {f.exit_code}"
            console.print(f"  {escape(f.outcome.spec.task_id)}#{f.outcome.spec.sample_index} "
                          f"{f.outcome.spec.agent.harness}: {f.status}{code}; stderr: "
                          f"{escape(_last_lines(f.stderr_tail, 2, 200)) or '(empty)'}", highlight=False)


def refused_outcome(task: RefusedTask, agent: AgentSpec) -> SessionOutcome:
    """A task the source refused, as the one session it never had: ERROR, cause ``invalid_task``, the problem (naming
    the task) as its reason, nothing run and nothing scored."""
    spec = SessionSpec(session_id=f"{task.task_id}-0-refused", task_id=task.task_id, instruction="", agent=agent)
    result = SessionResult(session_id=spec.session_id, task_id=task.task_id, status=SessionStatus.ERROR,
                           reason=f"{INVALID_TASK}: {task.problem}")
    return SessionOutcome(spec, result, 0, 0.0)


def finish(console: Console, job: LaunchJob, outcomes: list[SessionOutcome], wall: float, *,
           lost_jobs: list[dict[str, Any]] | None = None) -> int:
    """Write the run's files (and the datagen export), print the summary; the exit code: 3 if a session failed for
    infrastructure reasons (its model calls did not reach a working upstream), else 1 if any session ended ERROR or
    CANCELLED or a task was refused (a datagen run counts only what it kept, so its empty generations do not fail
    the run). Each refused task is one ERROR session (:func:`refused_outcome`) after the ones that ran."""
    ran = outcomes
    if job.refused and job.requests:
        outcomes = [*outcomes, *(refused_outcome(t, job.requests[0].agent) for t in job.refused)]
    totals = write_outputs(job.out_dir, outcomes, wall, title="datagen" if job.datagen is not None else "launch",
                           lost_jobs=lost_jobs)
    print_summary(console, outcomes, totals, job.out_dir)
    from polar_gym.launch.run_metrics import log_run_metrics  # logging.wandb / logging.tensorboard

    log_run_metrics(job, outcomes, totals)
    infra = sorted(set(totals["errors_by_cause"]) & INFRA_CAUSES)
    if infra:
        console.print(f"[bold red]sessions failed for infrastructure reasons ({', '.join(infra)}): the rewards of "
                      "this run do not measure the policy[/]")
    if job.datagen is None:
        if infra:
            return 3
        return 1 if any(o.result.status in _FAILED for o in outcomes) else 0
    from polar_gym.datagen import write_dataset

    summary = write_dataset(job.out_dir / "datagen", [o.result for o in ran], job.requests, job.datagen)
    console.print(f"datagen: {summary.passed}/{summary.samples} samples passed ({summary.empty} empty, "
                  f"{summary.retried} retried), {summary.sft_records.get('train', 0)} train / "
                  f"{summary.sft_records.get('test', 0)} test SFT records in {job.out_dir / 'datagen'}")
    return 3 if infra else 1 if job.refused or not summary.kept else 0
