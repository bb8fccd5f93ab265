"""The Hydra launch: configs compose with overrides (the design card's `+harness=codex +builder=prefix_merging`
included), bad configs fail with clear errors, and one real `python -m polar_gym.launch` run of the default harness
on two demo tasks writes its files with reward 1.0 (:func:`check_two_demo_run`, called by the token-in launch test,
which runs that launch)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from polar_gym.assets import tokenizer_dir
from polar_gym.gateway import GatewayConfig
from polar_gym.launch import CONF_DIR, ConfigError, build_job, build_launcher, run
from polar_gym.launch.local import LocalLauncher
from polar_gym.schema import SessionStatus
from tests._procs import processes_with, take_ctrl_c

ROOT = Path(__file__).resolve().parents[2]


def composed(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_the_embedded_default_is_pi_on_every_demo_task_locally_with_the_oracle(tmp_path):
    cfg = composed(f"out_dir={tmp_path}")
    job = build_job(cfg)
    assert {r.agent.harness for r in job.requests} == {"pi"}
    assert {r.runtime.backend for r in job.requests} == {"local"}
    assert {r.builder.strategy for r in job.requests} == {"prefix_merging"}
    assert len(job.requests) >= 4 and job.inference.engine == "oracle"
    # the demo task's own test command survives the evaluator group
    assert all(r.evaluator.config.model_dump()["command"] for r in job.requests)
    assert cfg.launcher._target_ == "polar_gym.launch.local:LocalLauncher"
    assert job.out_dir == tmp_path and "harness:" in job.resolved_config


def test_the_design_card_command_composes():
    cfg = composed("+harness=codex", "+builder=prefix_merging")
    job = build_job(cfg)
    assert {r.agent.harness for r in job.requests} == {"codex"}
    assert {r.builder.strategy for r in job.requests} == {"prefix_merging"}
    assert str(job.out_dir).startswith("outputs/")


@pytest.mark.parametrize("harness", ["claude_code", "codex", "qwen_code", "gemini_cli", "opencode", "pi", "shell"])
def test_every_harness_option_composes(harness):
    (request, *_) = build_job(composed(f"+harness={harness}", "+builder=per_request")).requests
    assert request.agent.harness == harness and request.builder.strategy == "per_request"


def test_every_group_option_validates_and_any_field_overrides():
    for runtime in ("local", "docker", "apptainer"):
        assert build_job(composed(f"runtime={runtime}")).requests[0].runtime.backend == runtime
    for evaluator in ("test_on_output", "session_completed", "swebench_harness"):
        assert build_job(composed(f"evaluator={evaluator}")).requests[0].evaluator.strategy == evaluator
    for engine in ("oracle", "vllm", "sglang", "openai"):
        assert build_job(composed(f"inference={engine}")).inference.engine == engine
    job = build_job(composed("num_samples=3", "timeout_seconds=42", "runtime.cpus=2", "tasks.ids=[demo-slugify]",
                             "+harness.config.api=openai-responses", "+evaluator.config.timeout=7",
                             "inference=vllm", "inference.upstreams=[http://10.0.0.1:8000]",
                             "inference.max_tokens_cap=512"))
    (request,) = job.requests
    assert (request.task_id, request.num_samples, request.timeout_seconds) == ("demo-slugify", 3, 42)
    assert request.runtime.cpus == 2 and request.agent.config == {"api": "openai-responses"}
    assert request.evaluator.config.model_dump()["timeout"] == 7
    assert job.inference.upstreams == ["http://10.0.0.1:8000"] and job.inference.max_tokens_cap == 512


@pytest.mark.parametrize(("overrides", "message"), [
    (["harness.name=codx"], "harness.name: unknown harness 'codx'; known: aider, claude_code"),
    (["builder.strategy=nope"], "builder.strategy: unknown builder 'nope'"),
    (["runtime.network=wifi"], "runtime.network"),
    (["num_samples=0"], "num_samples: input should be greater than or equal to 1"),
    (["runtime.cpus=lots"], "runtime.cpus"),
    (["inference.engine=tgi"], "inference.engine: unknown engine 'tgi'"),
    (["inference=vllm", "inference.upstreams=[]"], "engine 'vllm' needs at least one upstream URL"),
    (["tasks.ids=[demo-nope]"], "unknown demo task(s) ['demo-nope']"),
    (["tasks._target_=polar_gym.nowhere:tasks"], "tasks._target_: cannot import 'polar_gym.nowhere'"),
    (["harness.name=polar_gym.nowhere:Harness"], "harness.name: cannot import"),
])
def test_bad_configs_fail_with_the_path_in_the_message(overrides, message):
    with pytest.raises(ConfigError) as info:
        build_job(composed(*overrides))
    assert message in str(info.value)


def test_unknown_keys_and_groups_are_refused_by_hydra():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="harness"):
        composed("+harness=nope")
    with pytest.raises(ConfigCompositionException):
        composed("runtime.colour=red")  # struct mode: not a RuntimeSpec field


def test_run_reports_config_errors_with_exit_code_2(capsys):
    assert run(composed("harness.name=codx")) == 2
    assert "configuration error" in capsys.readouterr().err
    assert run(composed("launcher.run_slots=0")) == 2  # GatewayConfig refuses it when the launcher starts


def test_the_launcher_takes_only_its_own_keys():
    with pytest.raises(ConfigError, match=r"launcher\.colour: extra inputs are not permitted"):
        build_launcher(composed("+launcher.colour=red"))
    assert isinstance(build_launcher(composed()), LocalLauncher)


def test_host_reaching_runtime_options_come_from_the_launcher_not_the_task(tmp_path):
    """The gateway's own runtime options (a container CLI, limits) and expose roots are the launcher's keys, handed
    to its GatewayConfig as plain values (a task naming them is refused: tests/gateway/test_host_options.py)."""
    cfg = composed(f"out_dir={tmp_path}", "+launcher.runtime_options.cli=[podman,--runtime,runc]",
                   "+launcher.runtime_options.disk_mb=2048", f"launcher.expose_roots=[{tmp_path}]")
    launcher = build_launcher(cfg)
    assert isinstance(launcher, LocalLauncher)
    assert launcher.pools.runtime_options == {"cli": ["podman", "--runtime", "runc"], "disk_mb": 2048}
    assert type(launcher.pools.runtime_options["cli"]) is list
    assert launcher.pools.expose_roots == [tmp_path]
    config = GatewayConfig(**dict(launcher.pools))
    assert config.runtime_options["disk_mb"] == 2048 and config.expose_roots == [tmp_path]


def check_two_demo_run(out: Path, proc: subprocess.CompletedProcess[str]) -> None:
    """What one real ``python -m polar_gym.launch tasks.ids=[demo-calc-add,demo-slugify]`` run of the default harness
    writes (tests/launch/test_launch_token_in.py runs it): reward 1.0, the files, the rollout server's store."""
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["task_id"] for r in results] == ["demo-calc-add", "demo-slugify"]
    assert all(r["status"] == SessionStatus.COMPLETED.value and r["evaluation"]["reward"] == 1.0 for r in results)
    assert all("trajectory" not in r and r["traces"] >= 1 and r["completions"] >= 1 for r in results)
    # the call logs the gateway shipped: in calls.jsonl, one line per session, not in the results rows
    calls = {c["session_id"]: c["calls"] for c in map(json.loads, (out / "calls.jsonl").read_text().splitlines())}
    assert {sid: len(cs) for sid, cs in calls.items()} == {r["session_id"]: r["completions"] for r in results}
    assert all("call_log" not in r["metadata"]["artifacts"] for r in results)
    traces = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert {t["session_id"] for t in traces} == {r["session_id"] for r in results}
    assert all(t["reward"] == 1.0 and t["task_id"] and t["response_ids"] and len(t["loss_mask"]) ==
               len(t["response_ids"]) for t in traces)
    summary = (out / "summary.md").read_text()
    assert "| task | sample | harness | status | reward | traces | completions | seconds |" in summary
    assert "| demo-calc-add | 0 | pi | COMPLETED | 1 |" in summary and "2 completed, 0 errored" in summary
    assert "name: pi" in (out / "config.yaml").read_text()
    assert "2/2 completed" in proc.stderr
    # the sessions went through the rollout server: its store has both tasks and the gateway that ran them
    info = json.loads((out / "server.json").read_text())
    assert info["url"].startswith("http://127.0.0.1:") and info["admin_token"]
    assert (out / "server.json").stat().st_mode & 0o077 == 0
    with contextlib.closing(sqlite3.connect(out / "server.sqlite")) as db:
        rows = db.execute("SELECT task_id, status, gateway_id, attempts FROM sessions ORDER BY task_id").fetchall()
        gateways = db.execute("SELECT url FROM gateways").fetchall()
    assert [(t, s, a) for t, s, _, a in rows] == [("demo-calc-add", "COMPLETED", 1), ("demo-slugify", "COMPLETED", 1)]
    assert len(gateways) == 1 and all(g for _, _, g, _ in rows)
    assert "HTTP Request" not in proc.stdout + proc.stderr  # the client's request log stays quiet


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_cancels_the_run_on_the_server_and_leaves_no_sandbox(tmp_path, stop):
    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")
    marker = f"polarlaunch{uuid.uuid4().hex[:10]}"
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "polar_gym.launch", "num_samples=6", "launcher.run_slots=1",
                             "launcher.progress=false", f"++runtime.env.POLAR_TEST_MARKER={marker}",
                             f"out_dir={out}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=take_ctrl_c)

    def sandboxed() -> list[str]:  # the launch's own argv carries the marker too
        return [p for p in processes_with(marker) if not p.startswith(f"{proc.pid}:")]

    def submitted() -> int:  # the sessions the server has: every task is in before the signal, so all 24 count
        with contextlib.suppress(sqlite3.Error), contextlib.closing(
                sqlite3.connect(f"file:{out / 'server.sqlite'}?mode=ro", uri=True, timeout=5)) as db:
            return int(db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0])
        return 0

    try:
        deadline = time.monotonic() + 120
        # a harness is running in its sandbox (gateways take more than their run slots now, so one may start
        # before the last task is submitted: wait for both)
        while not (sandboxed() and submitted() == 24):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        proc.send_signal(stop)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130 and "interrupted; the unfinished tasks were cancelled" in stderr, stderr[-3000:]
    deadline = time.monotonic() + 30  # a sandbox killed at the launcher's exit (--die-with-parent) may take a moment
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_with(marker)
    with contextlib.closing(sqlite3.connect(out / "server.sqlite")) as db:
        statuses = [s for (s,) in db.execute("SELECT status FROM sessions")]
        cancelled = db.execute("SELECT cancelled FROM tasks").fetchall()
    assert len(statuses) == 24 and "CANCELLED" in statuses, statuses
    assert all(flag == 1 for (flag,) in cancelled) or "COMPLETED" in statuses
    assert not {"REGISTERED", "RUNNING"} & set(statuses), statuses  # nothing left pending on the server


@pytest.mark.slow
def test_a_harness_that_fails_is_named_with_its_stderr_in_summary_and_console(tmp_path):
    """A harness that exits non-zero leaves the session COMPLETED with reward 0: the run's summary.md and the
    console say which harness failed, with its exit code and the end of its stderr (not only an artifact file)."""
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is needed: run `bash scripts/setup.sh`")
    out = tmp_path / "run"
    # what the agent writes is hostile input: a terminal escape sequence must not reach the user's console
    command = "echo first-line >&2; printf '\\033[2Jharness broke | here\\n' >&2; exit 3"
    proc = subprocess.run([sys.executable, "-m", "polar_gym.launch", "+harness=shell",
                           f'+harness.config.command="{command}"', "tasks.ids=[demo-calc-add]", f"out_dir={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    (result,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert result["metadata"]["harness"]["exit_code"] == 3 and result["evaluation"]["reward"] == 0
    summary = (out / "summary.md").read_text()
    assert "## Harness failures" in summary
    assert (f"| demo-calc-add | 0 | shell | failed | 3 | `{result['session_id']}` | first-line / \ufffd[2Jharness "
            "broke / here |" in summary)  # a | in stderr cannot break the table
    console = " ".join(proc.stderr.split())
    assert "1 session(s) whose harness failed" in console
    assert "demo-calc-add#0 shell: failed exit 3; stderr: first-line / \ufffd[2Jharness broke | here" in console
    assert "\x1b[2J" not in proc.stderr + proc.stdout + summary
