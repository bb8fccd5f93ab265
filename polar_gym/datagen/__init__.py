"""Offline data generation (Polar paper §4.2): a dataset of tasks fanned out across the fleet, ``num_samples``
sessions per task, rejection sampling by the evaluator, one retry for empty generations, and an SFT export in the
paper's released shape with a repository-stratified train/test split. Pure core; :func:`write_dataset` is the only
function that touches the disk.

How a launcher drives it (the ``datagen`` section validates as :class:`DatagenConfig`)::

    from polar_gym.datagen import DatagenConfig, retry_plan, retry_requests, write_dataset

    config = DatagenConfig.model_validate(cfg_datagen)            # min_reward, keep_failures, test_fraction, seed,
                                                                  # retry_empty, include_reasoning
    tasks = job.requests                                          # e.g. from tasks=dataset (dataset_requests)
    results = run_through_rollout_server(tasks)                   # list[SessionResult], every sample
    if config.retry_empty:
        plan = retry_plan(results)                                # [(task_id, sample_index)] empty, attempt 1 only
        retries = retry_requests(plan, tasks)                     # TaskRequests "<task_id>--retry", markers set
        results += run_through_rollout_server(retries)            # once: never call retry_plan again to resubmit
    summary = write_dataset(job.out_dir / "datagen", results, tasks, config)

``write_dataset`` takes every result (first attempts and retries mixed) and the *original* TaskRequests; a retry
result maps back to its original sample through the markers :func:`retry_requests` put in the task metadata
(the gateway copies them into ``SessionResult.metadata["task_metadata"]``). If a launcher builds SessionResults
itself, it sets ``metadata["datagen_attempt"]``, ``["retry_of"]``, ``["retry_samples"]`` and ``["sample_index"]``.

Public functions:

- ``dataset_requests(template, path, limit=None, ids=None) -> list[TaskRequest]``: the ``tasks=dataset`` source
  (conf/tasks/dataset.yaml); ``load_dataset(path) -> list[DatasetRow]``; ``row_request(row, template)``.
- ``is_empty_generation(result) -> bool``; ``retry_plan(results) -> list[tuple[str, int]]``;
  ``retry_requests(plan, tasks) -> list[TaskRequest]``; ``final_attempts(results)``; ``attempt_of(result)``;
  ``sample_key(result) -> (task_id, sample_index)``.
- ``oracle_variant_of(result) -> str``: the oracle script a session carried (a forked task's variant).
- ``judge(result, min_reward=1.0) -> Verdict``; ``rejection_sample(results, keep_failures=False, min_reward=1.0)
  -> Selection(accepted, failures, dropped)``.
- ``stratified_split(records, key, test_fraction=0.1, seed=0) -> (train, test)``: grouped by key (repository).
- ``build_dataset(results, tasks, config=None) -> DatasetExport`` (pure); ``write_dataset(out_dir, results, tasks,
  config=None) -> DatagenSummary`` (writes sft/train.jsonl, sft/test.jsonl, verifier/failures.jsonl with
  keep_failures, datagen_summary.json); ``pass_at_k(n, c, k)``.
"""

from polar_gym.datagen.dataset import DatasetError, DatasetRow, dataset_requests, load_dataset, row_request
from polar_gym.datagen.export import (
    DatagenConfig,
    DatagenRecord,
    DatagenSummary,
    DatasetExport,
    build_dataset,
    pass_at_k,
    write_dataset,
)
from polar_gym.datagen.selection import (
    ATTEMPT_KEY,
    MAX_ATTEMPTS,
    RETRY_SUFFIX,
    Selection,
    Verdict,
    attempt_of,
    final_attempts,
    is_empty_generation,
    judge,
    oracle_variant_of,
    rejection_sample,
    retry_plan,
    retry_requests,
    sample_key,
    stratified_split,
)
from polar_gym.datagen.template import TaskTemplate

__all__ = [
    "ATTEMPT_KEY",
    "MAX_ATTEMPTS",
    "RETRY_SUFFIX",
    "DatagenConfig",
    "DatagenRecord",
    "DatagenSummary",
    "DatasetError",
    "DatasetExport",
    "DatasetRow",
    "Selection",
    "TaskTemplate",
    "Verdict",
    "attempt_of",
    "build_dataset",
    "dataset_requests",
    "final_attempts",
    "is_empty_generation",
    "judge",
    "load_dataset",
    "oracle_variant_of",
    "pass_at_k",
    "rejection_sample",
    "retry_plan",
    "retry_requests",
    "row_request",
    "sample_key",
    "stratified_split",
    "write_dataset",
]
