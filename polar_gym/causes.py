"""Why a session did not complete cleanly, and whether its harness failed: one word per session, read the same way
by the launch (console, summary.md, results.jsonl's ``error_cause``, the exit code), the run report and the trace
viewer (a ground module so the report and the viewer, independent siblings, share one rule).

Infrastructure causes (:data:`INFRA_CAUSES`) say the fleet failed, not the policy: the gateway's rule for model
calls that fail for infrastructure reasons (upstream unreachable, 5xx, timeout; a 4xx the server answers to the
harness's own request does not count) ends a session ERROR, unscored, with the cause first in its reason when no
call succeeded after the last such failure. ``harness_not_run`` is one too: the harness command could not start
(exit 126 or 127, no model call), so the policy was never asked.

Other named causes (:data:`NAMED_CAUSES`) end a session ERROR, unscored, for a reason the run's data holds:
``invalid_reward`` (an evaluator's reward is not a finite number within ±MAX_REWARD), ``unstorable_result`` (the
rollout server could not read or store the gateway's result, and set it aside once) and ``invalid_task`` (the task
itself was refused before anything ran: a Harbor task directory with a link out, a FIFO, an oversized file or an env
name the host's loader reads, or a request that does not validate; the task's author must fix it, the fleet is fine).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from polar_gym.schema import SessionResult, SessionStatus

__all__ = ["HARNESS_NOT_RUN", "INFRA_CAUSES", "INVALID_REWARD", "INVALID_TASK", "JUDGE_GARBAGE", "JUDGE_UNREACHABLE",
           "NAMED_CAUSES", "STDERR_TAIL",
           "UNSTORABLE_RESULT", "cause_of", "error_cause", "harness_failed", "stderr_tail"]

#: the harness command could not start (exit 126 or 127 before any model call): its CLI is missing or not executable
HARNESS_NOT_RUN = "harness_not_run"
#: an evaluator's reward is not a finite number within ±MAX_REWARD (polar_gym.evaluate.errors.InvalidReward)
INVALID_REWARD = "invalid_reward"
#: a task its source refused (polar_gym.tasks.refused): the session never ran, the task must be fixed
INVALID_TASK = "invalid_task"
#: the rollout server could not read or store a session's result: set aside once, with this cause
UNSTORABLE_RESULT = "unstorable_result"

#: the rubric evaluator's judge could not be reached or answered an HTTP error; it answered no usable scores
#: (polar_gym.evaluate.judge)
JUDGE_UNREACHABLE = "judge_unreachable"
JUDGE_GARBAGE = "judge_garbage"

#: causes that say the infrastructure failed, not the policy: the launch exits 3 when a session has one
INFRA_CAUSES = frozenset({"upstream_unreachable", "upstream_timeout", "upstream_error", "engine_error",
                          "job_lost",  # a Slurm job the run needed was lost (polar_gym.launch.lost_jobs)
                          HARNESS_NOT_RUN, JUDGE_UNREACHABLE})
#: causes named first in an ERROR's reason (``cause: ...``), infrastructure or not
NAMED_CAUSES = INFRA_CAUSES | {INVALID_REWARD, INVALID_TASK, UNSTORABLE_RESULT, JUDGE_GARBAGE}
#: the artifacts key of a failed harness's stderr tail in its result
STDERR_TAIL = "harness_stderr_tail"
_STAGES = {"queued", "init", "ready", "run", "postrun", "build", "evaluate", "prewarm"}
_CAUSE = re.compile(r"([a-z_]+): ")


def error_cause(result: SessionResult) -> str | None:
    """Why a session did not complete cleanly, as one short word (None: it did). The gateway names model-call
    failures (``artifacts.error_cause``: upstream_unreachable, upstream_timeout, upstream_error, engine_error);
    other errors are named by the stage that failed (``init_failed``), or by their status (timeout, cancelled)."""
    return cause_of(result.status.value, result.reason, result.metadata)


def cause_of(status: str, reason: str | None, metadata: Mapping[str, Any]) -> str | None:
    """:func:`error_cause` on a result's parts as they are on the wire (a results.jsonl row, a stored result)."""
    artifacts = metadata.get("artifacts")
    cause = artifacts.get("error_cause") if isinstance(artifacts, dict) else None
    if cause:
        return str(cause)
    if status == SessionStatus.COMPLETED.value:
        return None
    if status != SessionStatus.ERROR.value:
        return status.lower() or None
    match = _CAUSE.match(reason or "")
    if match and match.group(1) in NAMED_CAUSES:
        return match.group(1)
    if match and match.group(1) in _STAGES:
        return f"{match.group(1)}_failed"
    return "error"


def harness_failed(metadata: Mapping[str, Any]) -> tuple[str, int | None] | None:
    """(the harness's status, its exit code) when a session's harness failed, timed out or exited non-zero (from
    the session's ``metadata.harness``); None when it exited cleanly or never ran."""
    harness = metadata.get("harness")
    if not isinstance(harness, dict):
        return None
    status, code = str(harness.get("status") or ""), harness.get("exit_code")
    if status in ("", "ok", "completed") and code in (0, None):
        return None
    return status, code if isinstance(code, int) else None


def stderr_tail(metadata: Mapping[str, Any], tail_bytes: int = 2000) -> str:
    """The end of the harness's stderr (``artifacts/harness.stderr`` in the session's folder; else the tail a
    failed harness's result carries, for a session dir on a node's scratch), "" if none."""
    artifacts = metadata.get("artifacts")
    shipped = artifacts.get(STDERR_TAIL) if isinstance(artifacts, dict) else None
    fallback = shipped[-tail_bytes:] if isinstance(shipped, str) else ""
    session_dir = metadata.get("session_dir")
    if not isinstance(session_dir, str):
        return fallback
    path = Path(session_dir) / "artifacts" / "harness.stderr"
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - tail_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return fallback
