"""Pure selection over finished sessions: empty generations, the one retry, rejection sampling, the split.

Attempts. A sample of a task is identified by ``(task_id, sample_index)`` of its first attempt. Its retry runs as a
separate TaskRequest (the rollout server answers a resubmitted task_id with the old task), built by
:func:`retry_requests`: task_id ``<task_id>--retry``, ``num_samples`` = how many samples are retried, and metadata
``datagen_attempt = 2``, ``retry_of = <task_id>``, ``retry_samples = [original sample indices]`` (retry sample j
stands for original sample ``retry_samples[j]``). A result reads these from ``result.metadata`` or, as the gateway
writes it, ``result.metadata["task_metadata"]``; no marker means attempt 1.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from polar_gym.schema import SessionResult, SessionStatus, TaskMetadata, TaskRequest, Trace

__all__ = [
    "ATTEMPT_KEY",
    "MAX_ATTEMPTS",
    "RETRY_SUFFIX",
    "Selection",
    "Verdict",
    "attempt_of",
    "final_attempts",
    "is_empty_generation",
    "judge",
    "oracle_variant_of",
    "rejection_sample",
    "retry_plan",
    "retry_requests",
    "sample_key",
    "stratified_split",
]

ATTEMPT_KEY = "datagen_attempt"
#: first attempt + one retry, never more
MAX_ATTEMPTS = 2
RETRY_SUFFIX = "--retry"
_SESSION_ID = re.compile(r"^(?P<task>.+)-(?P<index>\d+)-[0-9a-f]{8}$")

T = TypeVar("T")


# -- attempts ---------------------------------------------------------------------------------------------------------
def _marker(result: SessionResult, key: str) -> Any:
    if key in result.metadata:
        return result.metadata[key]
    task_meta = result.metadata.get("task_metadata")
    return task_meta.get(key) if isinstance(task_meta, Mapping) else None


def attempt_of(result: SessionResult) -> int:
    """1 for a first attempt, 2 for its retry (the ``datagen_attempt`` marker; absent means 1)."""
    value = _marker(result, ATTEMPT_KEY)
    return int(value) if value is not None else 1


def oracle_variant_of(result: SessionResult) -> str:
    """The name of the oracle script the session carried (``task_metadata.oracle_variant``, set by
    :meth:`polar_gym.schema.TaskMetadata.for_sample`: a forked task's right or wrong demo); ``reference`` when none."""
    value = _marker(result, "oracle_variant")
    return str(value) if value else "reference"


def _sample_index(result: SessionResult) -> int:
    """The gateway's ``metadata.sample_index``; else parsed from the session id ``<task>-<i>-<hex8>`` (a result
    the rollout server wrote for a lost session carries no metadata)."""
    value = result.metadata.get("sample_index")
    if value is not None:
        return int(value)
    match = _SESSION_ID.match(result.session_id)
    if match is not None and match["task"] == result.task_id:
        return int(match["index"])
    raise ValueError(f"session {result.session_id}: no sample_index in metadata and none in the session id")


def sample_key(result: SessionResult) -> tuple[str, int]:
    """``(task_id, sample_index)`` of the first attempt this result stands for (a retry maps back)."""
    index = _sample_index(result)
    origin = _marker(result, "retry_of")
    if origin is None:
        return result.task_id, index
    samples = _marker(result, "retry_samples") or []
    if not 0 <= index < len(samples):
        raise ValueError(f"session {result.session_id}: retry sample {index} not in retry_samples {samples}")
    return str(origin), int(samples[index])


def final_attempts(results: Iterable[SessionResult]) -> list[SessionResult]:
    """One result per sample: the latest attempt (a retry replaces the empty first attempt), in first-seen order.
    A retry is relabelled with the original task_id and sample_index (its own task id kept in
    ``metadata["retry_task_id"]``) so exports group it with its instance; applying this twice changes nothing."""
    latest: dict[tuple[str, int], SessionResult] = {}
    for result in results:
        key = sample_key(result)
        held = latest.get(key)
        if held is None or attempt_of(result) >= attempt_of(held):
            latest[key] = result
    out = []
    for (task_id, index), result in latest.items():
        if result.task_id != task_id or result.metadata.get("sample_index") != index:
            # resolved: the top-level markers shadow task_metadata's, so sample_key of the copy is (task_id, index)
            meta = {**result.metadata, "sample_index": index, ATTEMPT_KEY: attempt_of(result), "retry_of": None,
                    "retry_samples": None, "retry_task_id": result.task_id}
            result = result.model_copy(update={"task_id": task_id, "metadata": meta})
        out.append(result)
    return out


# -- empty generations ------------------------------------------------------------------------------------------------
def _has_output(message: Mapping[str, Any]) -> bool:
    if message.get("tool_calls") or str(message.get("reasoning_content") or "").strip():
        return True
    content = message.get("content")
    if isinstance(content, list):
        return any(str(p.get("text") or "").strip() if isinstance(p, Mapping) else bool(p) for p in content)
    return bool(str(content or "").strip())


def _trace_has_output(trace: Trace) -> bool:
    assistant = [m for m in trace.response_messages if m and m.get("role") == "assistant"]
    if assistant:
        return any(_has_output(m) for m in assistant)
    return 1 in trace.loss_mask  # a trace without messages (built elsewhere): sampled tokens count as output


def is_empty_generation(result: SessionResult) -> bool:
    """True when the model produced nothing in this session, whatever its status. Precisely, in order:

    1. no trajectory, or a trajectory without traces (ERROR or TIMEOUT before any model call, a harness that never
       reached the model, a capture that recorded nothing): empty;
    2. otherwise empty unless some trace has output: an assistant response message with non-blank text, non-blank
       ``reasoning_content`` or a tool call (an answer of only an end-of-turn token, or whitespace, is empty); a
       trace that carries no assistant message at all counts as output when its loss mask holds a sampled token.

    The evaluator's verdict plays no part: an empty session that "passed" (tests that already pass) is still empty.
    """
    if result.trajectory is None or not result.trajectory.traces:
        return True
    return not any(_trace_has_output(t) for t in result.trajectory.traces)


def retry_plan(results: Iterable[SessionResult]) -> list[tuple[str, int]]:
    """``(task_id, sample_index)`` of every sample to retry once: its latest attempt is a first attempt, is an
    empty generation and was not cancelled. A sample that already has a retry is never planned again, empty or not.
    Sorted, so the plan is deterministic."""
    plan = []
    for result in final_attempts(results):
        if attempt_of(result) >= MAX_ATTEMPTS or result.status is SessionStatus.CANCELLED:
            continue
        if is_empty_generation(result):
            plan.append(sample_key(result))
    return sorted(plan)


def retry_requests(plan: Sequence[tuple[str, int]], tasks: Sequence[TaskRequest]) -> list[TaskRequest]:
    """The TaskRequests that run ``plan`` (one per task, in task order): the original request with task_id
    ``<task_id>--retry``, ``num_samples`` = retried samples and the attempt markers in metadata; ``callback_url``
    is kept. Raises ValueError for a plan entry naming an unknown task."""
    wanted: dict[str, list[int]] = {}
    for task_id, index in plan:
        wanted.setdefault(task_id, []).append(index)
    by_id = {t.task_id: t for t in tasks}
    unknown = sorted(set(wanted) - set(by_id))
    if unknown:
        raise ValueError(f"retry plan names unknown task(s) {unknown}")
    out = []
    for task in tasks:
        samples = sorted(set(wanted.get(task.task_id, [])))
        if not samples:
            continue
        meta = TaskMetadata(**{**task.metadata.model_dump(), ATTEMPT_KEY: MAX_ATTEMPTS, "retry_of": task.task_id,
                               "retry_samples": samples})
        out.append(task.model_copy(update={"task_id": f"{task.task_id}{RETRY_SUFFIX}", "num_samples": len(samples),
                                           "metadata": meta}))
    return out


# -- rejection sampling -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    """A session judged for the dataset: ``passed`` is the label; ``reason`` says why it did not pass."""

    result: SessionResult
    passed: bool
    reward: float | None
    empty: bool
    reason: str


def judge(result: SessionResult, min_reward: float = 1.0) -> Verdict:
    """Passing means: COMPLETED, not an empty generation, evaluated, reward >= ``min_reward`` and the evaluator
    did not say ``passed=False`` (a binary verifier such as swebench_harness gives reward 1.0 and passed=True)."""
    evaluation = result.evaluation
    reward = evaluation.reward if evaluation is not None else None
    empty = is_empty_generation(result)
    if empty:
        reason = "empty generation"
    elif result.status is not SessionStatus.COMPLETED:
        reason = f"status {result.status.value}" + (f": {result.reason}" if result.reason else "")
    elif evaluation is None or reward is None:
        reason = "not evaluated"
    elif evaluation.passed is False:
        reason = f"evaluator: not passed (reward {reward:g})"
    elif reward < min_reward:
        reason = f"reward {reward:g} below {min_reward:g}"
    else:
        return Verdict(result, True, reward, False, "passed")
    return Verdict(result, False, reward, empty, reason)


@dataclass(frozen=True)
class Selection:
    """The outcome of rejection sampling: ``accepted`` for SFT, ``failures`` kept for verifier / preference data
    (only with keep_failures), ``dropped`` everything else (empty generations always; failures without
    keep_failures)."""

    accepted: list[Verdict]
    failures: list[Verdict]
    dropped: list[Verdict]


def rejection_sample(results: Iterable[SessionResult], keep_failures: bool = False,
                     min_reward: float = 1.0) -> Selection:
    """Keep the passing sessions (see :func:`judge`); with ``keep_failures`` also keep the failed ones that have
    model output, labelled (``passed=False``, reward, reason). Empty generations carry no signal and are dropped.
    Pass :func:`final_attempts` of the results so a superseded empty first attempt is not counted twice."""
    accepted: list[Verdict] = []
    failures: list[Verdict] = []
    dropped: list[Verdict] = []
    for result in results:
        verdict = judge(result, min_reward)
        if verdict.passed:
            accepted.append(verdict)
        elif keep_failures and not verdict.empty:
            failures.append(verdict)
        else:
            dropped.append(verdict)
    return Selection(accepted, failures, dropped)


# -- split ------------------------------------------------------------------------------------------------------------
def _rank(seed: int | str, group: Hashable) -> str:
    return hashlib.sha256(f"{seed}\x00{group}".encode()).hexdigest()


def stratified_split(records: Sequence[T], key: Callable[[T], Hashable], test_fraction: float = 0.1,
                     seed: int | str = 0) -> tuple[list[T], list[T]]:
    """``(train, test)`` with every group (``key(record)``, the repository) wholly on one side, so test repositories
    are unseen in training: the paper's "repository-stratified" split read as a grouped split.

    Groups are ordered by ``sha256(seed, group)`` (deterministic across runs, platforms and Python versions; adding
    a repository does not reshuffle the others) and each joins the test side when that brings the test record count
    closer to ``test_fraction`` of all records. With at least two groups and ``0 < test_fraction < 1`` both sides
    get at least one group. Records keep their input order on each side.
    """
    if not 0.0 <= test_fraction <= 1.0:
        raise ValueError(f"test_fraction must be within [0, 1], got {test_fraction}")
    sizes: dict[Hashable, int] = {}
    for record in records:
        group = key(record)
        sizes[group] = sizes.get(group, 0) + 1
    order = sorted(sizes, key=lambda g: _rank(seed, g))
    target = test_fraction * len(records)
    test_groups: list[Hashable] = []
    count = 0
    if test_fraction >= 1.0:
        test_groups = list(order)
    elif test_fraction > 0.0:
        for group in order:
            if abs(count + sizes[group] - target) < abs(count - target):
                test_groups.append(group)
                count += sizes[group]
        if not test_groups and len(order) >= 2:
            test_groups.append(order[0])
        if len(test_groups) == len(order) and len(order) >= 2:
            test_groups.pop()
    chosen = set(test_groups)
    train = [r for r in records if key(r) not in chosen]
    test = [r for r in records if key(r) in chosen]
    return train, test
