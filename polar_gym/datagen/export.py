"""The dataset on disk, in the shape of the Polar paper's released SFT corpus (§4.2).

Released shape (paper p. 11, as summarised from the paper text; the Hugging Face dataset
``nvidia/polar-swegym-pi-qwen35-122b-a10b-trajectories`` itself is gated, so its exact columns could not be checked):
each accepted record holds the SWE-Gym instance metadata ``instance_id``, ``repo``, ``problem_statement``,
``base_commit``, ``version`` and the full multi-turn conversation as OpenAI-style ``messages`` (``role``,
``content``, ``tool_calls``, ``tool_call_id``) ending with the assistant turn that produced the accepted patch;
a repository-stratified 90/10 train/test split. :class:`DatagenRecord` is polar_gym's :class:`SFTRecord` (from
:func:`polar_gym.merge.sft_records`, one per trace) plus those instance fields and where the record came from.

Files written by :func:`write_dataset` under ``out_dir``::

    sft/train.jsonl, sft/test.jsonl   accepted records (one line per trace of an accepted session); with
                                      sft_include_failures also the failed non-empty ones (passed=false, their
                                      reward); every record's metadata.oracle_variant names the oracle script
    verifier/failures.jsonl           with keep_failures: failed non-empty sessions, passed=false, reason in metadata
    datagen_summary.json              counts (see DatagenSummary)
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from polar_gym.datagen.selection import (
    Verdict,
    attempt_of,
    final_attempts,
    is_empty_generation,
    oracle_variant_of,
    rejection_sample,
    sample_key,
    stratified_split,
)
from polar_gym.merge.exports import SFTRecord, sft_records
from polar_gym.private_files import open_private, private_dir, write_secret
from polar_gym.schema import SessionResult, TaskRequest

__all__ = ["DatagenConfig", "DatagenRecord", "DatagenSummary", "DatasetExport", "build_dataset", "pass_at_k",
           "write_dataset"]


class DatagenConfig(BaseModel):
    """The ``datagen`` settings: what to keep and how to split (paper: reward 1.0, failures optional, 90/10)."""

    model_config = ConfigDict(extra="forbid")

    min_reward: float = Field(default=1.0, description="a session passes with evaluator reward >= this (and not "
                              "passed=false)")
    keep_failures: bool = Field(default=False, description="also write failed trajectories (labelled) for "
                                "verifier / preference data")
    test_fraction: float = Field(default=0.1, ge=0.0, le=1.0, description="share of repositories held out for "
                                 "test (whole repositories, so test repos are unseen in training)")
    seed: int = Field(default=0, description="seed of the repository split")
    #: (the launcher reads this; the pure functions never retry twice anyway)
    retry_empty: bool = Field(default=True, description="resubmit sessions that produced no generation, once")
    include_reasoning: bool = Field(default=True, description="keep the model's reasoning in the SFT messages")
    sft_include_failures: bool = Field(default=False, description="also write failed sessions with model output "
                                       "(reward below min_reward) to the SFT files, labelled with their reward and "
                                       "passed=false (trainer.min_reward can still filter them): e.g. the wrong "
                                       "variant of a forked task")


class DatagenRecord(SFTRecord):
    """One SFT conversation in the released shape: SFTRecord plus the instance metadata and its provenance."""

    repo: str
    problem_statement: str
    base_commit: str | None = None
    version: str | None = None
    sample_index: int
    attempt: int = 1


class DatagenSummary(BaseModel):
    """Counts of a datagen run. ``sessions`` counts every attempt (first attempts and retries); the other counts
    are over samples (the latest attempt of each): ``passed + failed + empty == samples``; ``retried`` samples whose
    latest attempt is the retry; ``kept`` accepted sessions (they give ``sft_records`` train + test lines, one per
    trace); ``per_repo`` is the paper's Table 2 (attempts, accepted, acceptance rate)."""

    model_config = ConfigDict(extra="forbid")

    tasks: int
    sessions: int
    samples: int
    retried: int
    empty: int
    passed: int
    failed: int
    kept: int
    kept_failures: int
    acceptance_rate: float | None
    sft_records: dict[str, int]
    instances: dict[str, int]
    repos: dict[str, list[str]]
    per_repo: dict[str, dict[str, Any]]
    per_task: dict[str, dict[str, Any]]
    mean_pass_at_1: float | None
    config: DatagenConfig


class DatasetExport(BaseModel):
    """Everything :func:`write_dataset` writes, built purely by :func:`build_dataset`."""

    train: list[DatagenRecord]
    test: list[DatagenRecord]
    failures: list[DatagenRecord]
    summary: DatagenSummary


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) for ``c`` passing samples out of ``n``."""
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n (k={k}, n={n})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _task_fields(task: TaskRequest | None, task_id: str) -> dict[str, Any]:
    meta = task.metadata.model_dump() if task is not None else {}
    return {"instance_id": str(meta.get("instance_id") or task_id), "repo": str(meta.get("repo") or task_id),
            "problem_statement": task.instruction if task is not None else "",
            "base_commit": meta.get("base_commit"),
            "version": None if meta.get("version") is None else str(meta["version"])}


def _records(verdict: Verdict, task: TaskRequest | None, include_reasoning: bool) -> list[DatagenRecord]:
    result = verdict.result
    task_id, index = sample_key(result)
    fields = _task_fields(task, task_id)
    out = []
    variant = oracle_variant_of(result)
    for record in sft_records(result, instance_id=fields["instance_id"], include_reasoning=include_reasoning):
        data = record.model_dump()
        data["passed"] = verdict.passed
        # which oracle script played (a forked task's right or wrong demo); "reference" for a task without variants
        data["metadata"] = {**data["metadata"], "oracle_variant": variant}
        if not verdict.passed:
            data["metadata"] = {**data["metadata"], "rejection_reason": verdict.reason}
        out.append(DatagenRecord(**data, **{k: v for k, v in fields.items() if k != "instance_id"},
                                 sample_index=index, attempt=attempt_of(result)))
    return out


def _repo(task: TaskRequest | None, task_id: str) -> str:
    return str(_task_fields(task, task_id)["repo"])


def build_dataset(results: Iterable[SessionResult], tasks: Sequence[TaskRequest],
                  config: DatagenConfig | None = None) -> DatasetExport:
    """Pure: every result of the run (first attempts and retries, in any order) and the original TaskRequests to
    the records and summary. Retries replace their empty first attempt (:func:`final_attempts`), sessions are
    judged (:func:`rejection_sample`), accepted records split by repository (:func:`stratified_split`)."""
    config = config or DatagenConfig()
    every = list(results)
    by_id = {t.task_id: t for t in tasks}
    finals = final_attempts(every)
    selection = rejection_sample(finals, keep_failures=config.keep_failures or config.sft_include_failures,
                                 min_reward=config.min_reward)
    accepted = [r for v in selection.accepted
                for r in _records(v, by_id.get(sample_key(v.result)[0]), config.include_reasoning)]
    failed = [r for v in selection.failures
              for r in _records(v, by_id.get(sample_key(v.result)[0]), config.include_reasoning)]
    failures = failed if config.keep_failures else []
    # with sft_include_failures the failed records join the split (a test repository's stay out of train)
    pool = [*accepted, *failed] if config.sft_include_failures else accepted
    train, test = stratified_split(pool, key=lambda r: r.repo, test_fraction=config.test_fraction,
                                   seed=config.seed)

    verdicts = [*selection.accepted, *selection.failures, *selection.dropped]
    per_task: dict[str, dict[str, Any]] = {}
    per_repo: dict[str, dict[str, Any]] = {}
    task_ids = list(dict.fromkeys([*(t.task_id for t in tasks), *(sample_key(v.result)[0] for v in verdicts)]))
    for task_id in task_ids:
        mine = [v for v in verdicts if sample_key(v.result)[0] == task_id]
        n, c = len(mine), sum(v.passed for v in mine)
        per_task[task_id] = {"repo": _repo(by_id.get(task_id), task_id), "samples": n, "passed": c,
                             "empty": sum(v.empty for v in mine),
                             "pass@1": pass_at_k(n, c, 1) if n else None,
                             f"pass@{n}": pass_at_k(n, c, n) if n else None}
    for stats in per_task.values():
        repo = per_repo.setdefault(stats["repo"], {"tasks": 0, "attempts": 0, "accepted": 0})
        repo["tasks"] += 1
        repo["attempts"] += stats["samples"]
        repo["accepted"] += stats["passed"]
    for repo in per_repo.values():
        repo["acceptance_rate"] = repo["accepted"] / repo["attempts"] if repo["attempts"] else None
    pass1 = [s["pass@1"] for s in per_task.values() if s["pass@1"] is not None]
    empty = sum(is_empty_generation(r) for r in finals)
    summary = DatagenSummary(
        tasks=len(task_ids), sessions=len(every), samples=len(finals),
        retried=sum(attempt_of(r) > 1 for r in finals),
        empty=empty,
        passed=len(selection.accepted), failed=len(finals) - len(selection.accepted) - empty,
        kept=len(selection.accepted), kept_failures=len(selection.failures) if config.keep_failures else 0,
        acceptance_rate=len(selection.accepted) / len(finals) if finals else None,
        sft_records={"train": len(train), "test": len(test), "failures": len(failures)},
        instances={"train": len({r.instance_id for r in train}), "test": len({r.instance_id for r in test})},
        repos={"train": sorted({r.repo for r in train}), "test": sorted({r.repo for r in test})},
        per_repo=per_repo, per_task=per_task,
        mean_pass_at_1=sum(pass1) / len(pass1) if pass1 else None, config=config)
    return DatasetExport(train=train, test=test, failures=failures, summary=summary)


def _write_jsonl(path: Path, records: Sequence[BaseModel]) -> None:
    private_dir(path.parent)  # prompts and completions: the owner's only
    with open_private(path) as f:
        for record in records:
            f.write(record.model_dump_json() + "\n")


def write_dataset(out_dir: str | Path, results: Iterable[SessionResult], tasks: Sequence[TaskRequest],
                  config: DatagenConfig | Mapping[str, Any] | None = None) -> DatagenSummary:
    """Build the dataset (:func:`build_dataset`) and write its files under ``out_dir``; returns the summary.
    ``verifier/failures.jsonl`` is written only with ``keep_failures``; train/test files always (maybe empty)."""
    if config is not None and not isinstance(config, DatagenConfig):
        config = DatagenConfig.model_validate(dict(config))
    export = build_dataset(results, tasks, config)
    out = Path(out_dir)
    _write_jsonl(out / "sft" / "train.jsonl", export.train)
    _write_jsonl(out / "sft" / "test.jsonl", export.test)
    if export.summary.config.keep_failures:
        _write_jsonl(out / "verifier" / "failures.jsonl", export.failures)
    private_dir(out)
    write_secret(out / "datagen_summary.json", json.dumps(export.summary.model_dump(mode="json"), indent=2) + "\n")
    return export.summary
