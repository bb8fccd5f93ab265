"""Issue 35, break 7: an output folder holding an earlier run is refused (exit 2, the folder and the override named)
unless ``resume=true``; a resume says what came from the old store, and refuses a changed config or task. Real
configs (Hydra compose), real rollout stores (SQLite through the server's Store), real files; one real launch pair
is in test_run_folder.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from polar_gym.launch import CONF_DIR, LaunchJob, build_job, run
from polar_gym.launch.earlier_run import check_earlier_run, config_changes
from polar_gym.schema import SessionResult, SessionSpec, SessionStatus, TaskRequest
from polar_gym.server import Store
from polar_gym.settings import ConfigError

TWO = "tasks.ids=[demo-calc-add,demo-slugify]"


def composed(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def job(out: Path, *overrides: str) -> LaunchJob:
    return build_job(composed(f"out_dir={out}", *overrides))


def store_tasks(db: Path, requests: list[TaskRequest], finished: int = 0) -> None:
    """A store as an earlier run left it: ``requests`` submitted, the first ``finished`` sessions COMPLETED."""

    async def fill() -> None:
        store = Store(db)
        try:
            specs = []
            for request in requests:
                mine = [SessionSpec.from_task(request, i) for i in range(request.num_samples)]
                assert await store.add_task(request, mine)
                specs += mine
            for spec in specs[:finished]:
                await store.finish(SessionResult(session_id=spec.session_id, task_id=spec.task_id,
                                                 status=SessionStatus.COMPLETED))
        finally:
            store.close()

    db.parent.mkdir(parents=True, exist_ok=True)
    asyncio.run(fill())


def earlier(out: Path, *overrides: str, finished: int = 1) -> LaunchJob:
    """The folder an earlier launch with ``overrides`` left: its config.yaml and its store."""
    first = job(out, *overrides)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(first.resolved_config)
    store_tasks(first.store, first.requests, finished)
    return first


def test_a_folder_with_an_earlier_store_is_refused_naming_it_and_the_override(tmp_path: Path) -> None:
    out = tmp_path / "run"
    earlier(out, TWO)
    with pytest.raises(ConfigError) as info:
        check_earlier_run(job(out, TWO, "num_samples=2", "+builder=per_request"))
    assert info.value.keys == ["out_dir"]
    assert str(info.value) == (f"out_dir: {out} holds an earlier run (server.sqlite with 2 task(s)); pick another "
                               "out_dir, or add resume=true to resume it")


def test_run_refuses_it_with_exit_2_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    earlier(out, TWO)
    config = (out / "config.yaml").read_text()
    assert run(composed(f"out_dir={out}", TWO, "num_samples=2")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds an earlier run" in err and "resume=true" in err
    assert (out / "config.yaml").read_text() == config  # the earlier run's config is left as it was
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "server.sqlite"]


@pytest.mark.parametrize("name", ["results.jsonl", "trajectories.jsonl", "summary.md",
                                  "trainer/train_metrics.jsonl"])  # an SFT run writes only the last
def test_the_run_files_alone_also_mark_an_earlier_run(tmp_path: Path, name: str) -> None:
    (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / name).write_text("")
    with pytest.raises(ConfigError, match=rf"holds an earlier run \({name}\)"):
        check_earlier_run(job(tmp_path))


def test_a_folder_without_a_run_is_a_new_run(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("num_samples: 7\n")  # a launch that stopped before anything ran
    (tmp_path / "notes.txt").write_text("mine")
    store_tasks(tmp_path / "server.sqlite", [])  # a store with no task: nothing to resume
    assert check_earlier_run(job(tmp_path)) is None
    assert check_earlier_run(job(tmp_path / "missing")) is None
    assert check_earlier_run(job(tmp_path, "resume=true")) == (f"resume=true: no earlier run in {tmp_path}; this is "
                                                                "a new run")


def test_resume_says_how_many_tasks_and_sessions_come_from_the_old_store(tmp_path: Path) -> None:
    out = tmp_path / "run"
    earlier(out, "tasks.ids=[demo-calc-add]", finished=1)
    # the same config, where the fleet runs changed (allowed), the tasks asked for grown by one: refused, the
    # config differs at tasks.ids
    with pytest.raises(ConfigError, match=r"resume: the config differs .* at tasks\.ids"):
        check_earlier_run(job(out, TWO, "resume=true"))
    (out / "config.yaml").unlink()  # no config to compare: the stored tasks still are
    line = check_earlier_run(job(out, TWO, "resume=true", "launcher.port=0", "launcher.progress=false"))
    assert line == (f"resume=true: 1 of 2 task(s) come from the earlier run's store ({out / 'server.sqlite'}): "
                    "1 session(s) finished there, 0 to run; 1 new task(s)")


def test_resume_with_the_same_config_counts_unfinished_sessions(tmp_path: Path) -> None:
    out = tmp_path / "run"
    earlier(out, TWO, "num_samples=2", finished=3)
    line = check_earlier_run(job(out, TWO, "num_samples=2", "resume=true", "launcher.run_slots=2"))
    assert line is not None and "2 of 2 task(s)" in line and "3 session(s) finished there, 1 to run" in line


@pytest.mark.parametrize(("overrides", "keys"), [
    (["num_samples=2", "+builder=per_request"], "builder.strategy ('prefix_merging' -> 'per_request'), "
                                                "num_samples (1 -> 2)"),
    (["timeout_seconds=30"], "timeout_seconds (600.0 -> 30)"),
    (["runtime.cpus=2"], "runtime.cpus (None -> 2)"),
])
def test_a_resume_whose_config_differs_is_refused_naming_each_key(tmp_path: Path, overrides: list[str],
                                                                 keys: str) -> None:
    out = tmp_path / "run"
    earlier(out, TWO)
    with pytest.raises(ConfigError) as info:
        check_earlier_run(job(out, TWO, "resume=true", *overrides))
    assert info.value.keys == ["resume"]
    assert f"({out / 'config.yaml'}) at {keys}; a resumed run keeps its config" in str(info.value)


def test_a_resume_whose_stored_task_differs_is_refused_naming_the_task(tmp_path: Path) -> None:
    """An edited task (its instruction) under the same id and config: the old results would answer the new task."""
    out = tmp_path / "run"
    first = job(out, TWO)
    edited = [first.requests[0].model_copy(update={"instruction": "an older instruction"}), first.requests[1]]
    store_tasks(first.store, edited)
    with pytest.raises(ConfigError, match=r"task 'demo-calc-add' differs from the one in .*server\.sqlite at "
                                          r"instruction; a resumed run keeps its tasks"):
        check_earlier_run(job(out, TWO, "resume=true"))


def test_the_store_is_looked_for_in_state_dir(tmp_path: Path) -> None:
    out, state = tmp_path / "run", tmp_path / "local-disk"
    first = earlier(out, "tasks.ids=[demo-calc-add]", f"state_dir={state}")
    assert first.store == state / "server.sqlite" and not (out / "server.sqlite").exists()
    with pytest.raises(ConfigError, match=r"server\.sqlite with 1 task"):
        check_earlier_run(job(out, "tasks.ids=[demo-calc-add]", f"state_dir={state}"))
    assert check_earlier_run(job(out, "tasks.ids=[demo-calc-add]")) is None  # out_dir itself has no store


def test_an_unreadable_store_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "server.sqlite").write_text("not a database, but long enough to be read as one " * 40)
    with pytest.raises(ConfigError, match=r"state_dir: .*server\.sqlite cannot be read as a rollout store"):
        check_earlier_run(job(tmp_path))


def test_config_changes_ignore_where_the_fleet_runs() -> None:
    old = "num_samples: 1\nlauncher:\n  port: 0\ninference:\n  engine: oracle\n  upstreams: []\nresume: false\n"
    new = ("num_samples: 1\nlauncher:\n  port: 9000\n  progress: false\ninference:\n  engine: vllm\n  upstreams: "
           "[http://gpu:8000]\nresume: true\nlogging:\n  tensorboard: {enabled: true}\n")
    assert config_changes(old, new) == ["inference.engine ('oracle' -> 'vllm')"]


def test_a_resume_whose_earlier_config_cannot_be_read_is_refused(tmp_path: Path) -> None:
    earlier(tmp_path, TWO)
    (tmp_path / "config.yaml").write_text("num_samples: [1\n  : {\n")
    with pytest.raises(ConfigError, match=r"resume: .*config\.yaml cannot be read"):
        check_earlier_run(job(tmp_path, TWO, "resume=true"))
