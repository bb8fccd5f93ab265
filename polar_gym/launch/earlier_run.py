"""An output folder that already holds a run: refused, unless ``resume=true`` asks for it.

Why: the rollout store is durable and a task id names the same task in every launch, so a launch into a folder
holding an earlier run's ``server.sqlite`` gets the old sessions back as its own (the old single merged trace for
``num_samples=2 +builder=per_request``, "in 0.0 s"), while config.yaml says otherwise. So a folder holding an
earlier run (a rollout store with tasks, or the run files) is a configuration error naming the folder and the
override; ``resume=true`` resumes it, and then the console says how many tasks and sessions came from the old
store. A resumed run keeps its config: the new one may differ only where the fleet runs (:data:`MAY_CHANGE`), and a
stored task whose request differs from the new one (an edited task file) is refused too, each naming what differs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from polar_gym.fleet.server_workers import postgres_folder
from polar_gym.schema import TaskRequest
from polar_gym.server import Store
from polar_gym.server.postgres_local import PrivatePostgres
from polar_gym.settings import ConfigError, flat_items

if TYPE_CHECKING:
    from polar_gym.launch.config import LaunchJob

__all__ = ["MAY_CHANGE", "RUN_FILES", "StoredTasks", "check_earlier_run", "config_changes", "request_changes",
           "stored_tasks"]

#: the files of a finished (or interrupted) run's outputs, besides its store
RUN_FILES = ("results.jsonl", "trajectories.jsonl", "summary.md", "trainer/train_metrics.jsonl")
#: config keys (and the keys under them) a resumed run may change: where and how the fleet runs, and the metrics
MAY_CHANGE = ("resume", "out_dir", "state_dir", "launcher", "inference.upstreams", "inference.await_upstreams",
              "logging", "telemetry")


@dataclass(frozen=True)
class StoredTasks:
    """What an earlier run's store holds: how many tasks, and of the tasks asked for, each one's stored request and
    how many of its sessions have not ended."""

    count: int
    requests: dict[str, TaskRequest]
    unfinished: dict[str, int]


def stored_tasks(db: Path | str, task_ids: list[str]) -> StoredTasks:
    """The store at ``db`` (a SQLite file, or a PostgreSQL URL): its task count, and the requests and open sessions
    of ``task_ids`` (counted, not read: a result is megabytes). An unreadable store is a ConfigError naming it."""

    async def read() -> StoredTasks:
        store = Store(db)
        try:
            _, tasks = await store.counts()
            requests, unfinished = {}, {}
            for task_id in task_ids:
                row = await store.task(task_id)
                if row is not None:
                    requests[task_id] = row.request
                    unfinished[task_id] = await store.unfinished(task_id)
            return StoredTasks(int(tasks["open"]) + int(tasks["finished"]), requests, unfinished)
        finally:
            store.close()

    try:
        return asyncio.run(read())
    except Exception as exc:  # not SQLite, a store of another schema, unreadable
        raise ConfigError(f"{db} cannot be read as a rollout store ({type(exc).__name__}: {exc}); move it away, or "
                          "pick another out_dir", key="state_dir") from None



def _may_change(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in MAY_CHANGE)


def _yaml(text: str) -> Any:
    """A config.yaml as plain data (its interpolations were resolved when it was written; kept as text if not)."""
    return OmegaConf.to_container(OmegaConf.create(text), resolve=False) if text.strip() else {}


def config_changes(old_yaml: str, new_yaml: str) -> list[str]:
    """``key (old -> new)`` for each config key that differs and a resumed run may not change."""
    old, new = dict(flat_items(_yaml(old_yaml))), dict(flat_items(_yaml(new_yaml)))
    missing = object()
    return [f"{key} ({old.get(key, 'unset')!r} -> {new.get(key, 'unset')!r})" for key in sorted(old.keys() | new.keys())
            if not _may_change(key) and old.get(key, missing) != new.get(key, missing)]


def request_changes(stored: TaskRequest, new: TaskRequest) -> list[str]:
    """The fields (dotted) where a stored task's request and the new one differ."""
    old, now = dict(flat_items(stored.model_dump(mode="json"))), dict(flat_items(new.model_dump(mode="json")))
    return sorted(key for key in old.keys() | now.keys() if old.get(key) != now.get(key))


def _earlier(job: LaunchJob) -> tuple[list[str], StoredTasks | None]:
    """What in out_dir (and state_dir) shows an earlier run, and its store's tasks."""
    found = [name for name in RUN_FILES if (job.out_dir / name).exists()]
    stored = None
    postgres = postgres_folder(job.store)
    if job.store.exists():
        stored = stored_tasks(job.store, [r.task_id for r in job.requests])
        if stored.count:
            found.insert(0, f"{job.store.name} with {stored.count} task(s)")
    elif (postgres / "data" / "PG_VERSION").exists():  # several server workers' store
        server = PrivatePostgres(postgres)
        try:
            stored = stored_tasks(server.start(), [r.task_id for r in job.requests])
        finally:
            server.stop()
        if stored.count:
            found.insert(0, f"the server workers' PostgreSQL store ({postgres}) with {stored.count} task(s)")
    return found, stored


def check_earlier_run(job: LaunchJob) -> str | None:
    """Refuse (ConfigError) a launch into a folder holding an earlier run unless ``job.resume``; for a resume,
    refuse a changed config or task, else answer the console line saying what is resumed. None: nothing earlier
    (a new run)."""
    found, stored = _earlier(job)
    if not found:
        return f"resume=true: no earlier run in {job.out_dir}; this is a new run" if job.resume else None
    if not job.resume:
        raise ConfigError(f"{job.out_dir} holds an earlier run ({', '.join(found)}); pick another out_dir, or add "
                          "resume=true to resume it", key="out_dir")
    config = job.out_dir / "config.yaml"
    if config.exists():
        try:
            changed = config_changes(config.read_text(encoding="utf-8", errors="replace"), job.resolved_config)
        except Exception as exc:  # not YAML: nothing says which config the earlier run had
            raise ConfigError(f"{config} cannot be read ({type(exc).__name__}), so the earlier run's config is "
                              "unknown; pick another out_dir", key="resume") from None
        if changed:
            raise ConfigError(f"the config differs from the earlier run's ({config}) at {', '.join(changed)}; a "
                              "resumed run keeps its config: drop those overrides, or pick another out_dir",
                              key="resume")
    if job.trainer is not None:  # its groups are the tasks of each step, re-attached by the trainer
        return (f"resume=true: the GRPO run goes on after the last step it saved in "
                f"{job.out_dir / 'trainer' / 'checkpoints'}, its sessions so far from {job.store}")
    stored = stored or StoredTasks(0, {}, {})
    for request in job.requests:
        old = stored.requests.get(request.task_id)
        if old is not None and (fields := request_changes(old, request)):
            raise ConfigError(f"task {request.task_id!r} differs from the one in {job.store} at "
                              f"{', '.join(fields[:5])}{' ...' if len(fields) > 5 else ''}; a resumed run keeps its "
                              "tasks: pick another out_dir", key="resume")
    resumed = [r.task_id for r in job.requests if r.task_id in stored.requests]
    unfinished = sum(stored.unfinished[task_id] for task_id in resumed)
    finished = sum(stored.requests[task_id].num_samples for task_id in resumed) - unfinished
    return (f"resume=true: {len(resumed)} of {len(job.requests)} task(s) come from the earlier run's store "
            f"({job.store}): {finished} session(s) finished there, {unfinished} to run; "
            f"{len(job.requests) - len(resumed)} new task(s)")

