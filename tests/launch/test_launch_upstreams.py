"""Issue 11, fault 10: a wrong inference URL must not look like a model that scores 0. The launch probes every
upstream before the first session (real loopback servers: one nothing listens on, one answering 500, one that is
not OpenAI-compatible, one that is) and, when a session's model calls fail anyway, ends it ERROR with the cause and
exits non-zero, with errors by cause in the console, summary.md and results.jsonl."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from polar_gym.assets import tokenizer_dir
from polar_gym.datagen.export import DatagenConfig
from polar_gym.datagen.template import TaskTemplate
from polar_gym.fleet.settings import InferenceSettings
from polar_gym.fleet.upstreams import (
    UpstreamCheckFailed,
    check_upstreams,
    describe,
    ensure_upstreams,
    failure_message,
)
from polar_gym.launch.config import LaunchJob
from polar_gym.launch.outputs import SessionOutcome, error_cause, finish
from polar_gym.launch.tasks import demo_requests
from polar_gym.schema import (
    AgentSpec,
    BuilderSpec,
    EvaluatorSpec,
    RuntimeSpec,
    SessionResult,
    SessionSpec,
    SessionStatus,
)
from tests._serving import free_port, json_server
from tests.telemetry._readers import tensorboard_scalars

ROOT = Path(__file__).resolve().parents[2]
MODELS = json.dumps({"object": "list", "data": [{"id": "policy", "object": "model"}]}).encode()


def upstream(status: int = 200, body: bytes = MODELS, port: int = 0) -> contextlib.AbstractContextManager[str]:
    """A real HTTP server on loopback that answers every request with ``status`` and ``body``; yields its URL."""
    return json_server(lambda method, path: (status, body), port=port)


def launch(*overrides: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "polar_gym.launch", "launcher.progress=false", *overrides,
                           f"out_dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "200"})


@pytest.mark.parametrize(("status", "body", "ok", "answer"), [
    (200, MODELS, True, "serves ['policy']"),
    (500, b"Internal Server Error", False, "HTTP 500: Internal Server Error"),
    (404, b'{"detail":"Not Found"}', False, "HTTP 404"),
    (200, b"<html>a web page</html>", False, "not an OpenAI-compatible /v1/models (not JSON"),
    (200, b'{"models": []}', False, 'not an OpenAI-compatible /v1/models (no "data" list'),
])
def test_describe_says_what_the_upstream_answered(status: int, body: bytes, ok: bool, answer: str) -> None:
    verdict, text = describe(status, body)
    assert verdict is ok and answer in text


def test_describe_checks_the_served_model_when_one_is_configured() -> None:
    assert describe(200, MODELS, model="policy")[0]
    assert describe(200, MODELS, model="qwen") == (False, "serves ['policy'], not inference.upstream_model='qwen'")


async def test_check_upstreams_against_real_loopback_servers() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with upstream() as good, upstream(500, b"boom") as broken:
        checks = await check_upstreams([good, dead, broken + "/"], timeout=30)
    assert [(c.url, c.ok) for c in checks] == [(good, True), (dead, False), (broken, False)]
    assert checks[1].answer == "connection refused" and checks[2].answer == "HTTP 500: boom"
    with upstream(404, b'{"detail":"Not Found"}') as server:  # a URL given with /v1 (the engine adds it itself)
        (check,) = await check_upstreams([server + "/v1"], timeout=30)
    assert "drop the trailing /v1" in failure_message("vllm", [check])


async def test_await_upstreams_waits_for_a_server_that_starts_later_and_gives_up_at_the_bound() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started: list[contextlib.ExitStack] = []

    def start_it(bad: list[object]) -> None:  # the policy server comes up once the launch is waiting for it
        if not started:
            stack = contextlib.ExitStack()
            stack.enter_context(upstream(port=port))
            started.append(stack)

    try:
        checks = await check_upstreams([url], timeout=30, wait_seconds=120, interval=0.05, on_wait=start_it)
    finally:
        for stack in started:
            stack.close()
    assert started and checks[0].ok
    settings = InferenceSettings(engine="vllm", upstreams=[url], await_upstreams=True, upstream_wait_seconds=0.2)
    with pytest.raises(UpstreamCheckFailed, match=rf"after waiting .*\n  {url}: connection refused"):
        await ensure_upstreams(settings, [url], Console(file=io.StringIO()))


async def test_await_upstreams_without_urls_waits_for_a_backend_on_the_rollout_server() -> None:
    settings = InferenceSettings(engine="vllm", await_upstreams=True, upstream_wait_seconds=120)
    console = Console(record=True, file=io.StringIO())
    with upstream() as good:
        lists = [[], [], [good]]

        async def backends() -> list[str]:
            return lists.pop(0) if len(lists) > 1 else lists[0]

        checks = await ensure_upstreams(settings, [], console, backends=backends)
    assert [c.url for c in checks] == [good] and checks[0].ok
    text = console.export_text()
    assert "waiting up to 120 s for an inference backend" in text and "inference upstreams ok" in text
    never = InferenceSettings(engine="vllm", await_upstreams=True, upstream_wait_seconds=0)

    async def nothing() -> list[str]:
        return []

    with pytest.raises(UpstreamCheckFailed, match="no inference backend was added"):
        await ensure_upstreams(never, [], console, backends=nothing)


async def test_the_oracle_and_preflight_false_probe_nothing() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    console = Console(file=io.StringIO())
    assert await ensure_upstreams(InferenceSettings(engine="oracle", upstreams=[dead]), [dead], console) == []
    off = InferenceSettings(engine="vllm", upstreams=[dead], preflight=False)
    assert await ensure_upstreams(off, [dead], console) == []


def test_launch_with_a_dead_upstream_exits_3_naming_the_url_and_starts_no_session(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with upstream(500, b"Internal Server Error") as broken:
        proc = launch("inference=vllm", f"inference.upstreams=[{dead},{broken}]", out=tmp_path / "run")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "inference upstream check failed (engine vllm); no session was started" in proc.stderr
    assert f"  {dead}: connection refused (GET {dead}/v1/models)" in proc.stderr
    assert f"  {broken}: HTTP 500: Internal Server Error (GET {broken}/v1/models)" in proc.stderr
    assert not (tmp_path / "run" / "results.jsonl").exists() and not (tmp_path / "run" / "server.sqlite").exists()


@pytest.mark.slow
def test_sessions_whose_model_calls_never_reach_an_upstream_end_in_error_with_the_cause(tmp_path: Path) -> None:
    """The check switched off, pi runs against a dead URL: no session COMPLETED with reward 0 silently; the cause is
    in results.jsonl, summary.md, the console, report.html and the TensorBoard series (with no mean reward: nothing
    was scored)."""
    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")
    dead = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "run"
    proc = launch("inference=vllm", f"inference.upstreams=[{dead}]", "inference.preflight=false",
                  "tasks.ids=[demo-calc-add]", "num_samples=2", "logging.tensorboard=true", out=out)
    assert proc.returncode == 3, proc.stderr[-3000:]
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(results) == 2 and all(r["status"] == "ERROR" and r["evaluation"] is None for r in results)
    assert all(r["error_cause"] == "upstream_unreachable" and r["reason"].startswith(
        f"upstream_unreachable: upstream {dead} unreachable") for r in results)
    assert all(r["metadata"]["artifacts"]["model_call_failures"]["failed"] >= 1 for r in results)
    summary = (out / "summary.md").read_text()
    assert "## Errors by cause" in summary and "| upstream_unreachable | 2 | upstream_unreachable: upstream " \
        f"{dead} unreachable" in summary
    assert "errors by cause:\n  upstream_unreachable: 2 session(s), e.g. upstream " + dead in proc.stderr
    assert "sessions failed for infrastructure reasons (upstream_unreachable)" in proc.stderr
    report = (out / "report.html").read_text()  # the run report shows the cause apart from rewards of 0
    assert 'data-key="errors by cause"><div class="value">2 upstream_unreachable</div>' in report
    assert '<span class="infra">upstream_unreachable</span></td><td class=num>2</td><td>infrastructure' in report
    assert "Reward distribution (0 scored of 2 sessions)" in report and f"report: {out / 'report.html'}" in proc.stderr
    scalars = tensorboard_scalars(out / "tensorboard")
    assert scalars["run/errors_by_cause/upstream_unreachable"] == [(0, 2.0)] and scalars["run/errored"] == [(0, 2.0)]
    assert scalars["session/errored"] == [(0, 1.0), (1, 1.0)]
    assert "run/mean_reward" not in scalars  # no session was scored: no mean to log


def test_error_causes_of_other_failures() -> None:
    def result(status: SessionStatus, reason: str | None, **artifacts: object) -> SessionResult:
        return SessionResult(session_id="s", task_id="t", status=status, reason=reason,
                             metadata={"artifacts": artifacts})

    assert error_cause(result(SessionStatus.COMPLETED, None)) is None
    assert error_cause(result(SessionStatus.COMPLETED, None, error_cause="upstream_error")) == "upstream_error"
    assert error_cause(result(SessionStatus.TIMEOUT, "killed at the deadline",
                              error_cause="upstream_timeout")) == "upstream_timeout"
    assert error_cause(result(SessionStatus.TIMEOUT, "killed at the deadline")) == "timeout"
    assert error_cause(result(SessionStatus.CANCELLED, "cancelled (in run)")) == "cancelled"
    assert error_cause(result(SessionStatus.ERROR, "init: prepare action 0 failed")) == "init_failed"
    assert error_cause(result(SessionStatus.ERROR, "the harness's sandbox crashed: oom")) == "error"


def test_the_slurm_launcher_checks_before_it_submits_any_job(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "run"
    proc = launch("launcher=slurm", "launcher.cluster=local", "inference=vllm", f"inference.upstreams=[{dead}]",
                  out=out)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert f"  {dead}: connection refused" in proc.stderr
    assert not (out / "jobs.json").exists() and not (out / "slurm").exists()


def test_env_serve_with_a_dead_upstream_exits_3_naming_it(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    info = tmp_path / "info.json"
    proc = subprocess.run([sys.executable, "-m", "polar_gym.env", "serve", "--engine", "vllm", "--upstream", dead,
                           "--out-dir", str(tmp_path / "serve"), "--info-file", str(info)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert f"  {dead}: connection refused" in proc.stderr and not info.exists()


def _outcome(status: SessionStatus, reason: str | None = None, **artifacts: object) -> SessionOutcome:
    request = demo_requests(TaskTemplate(agent=AgentSpec(harness="pi"), runtime=RuntimeSpec(), builder=BuilderSpec(),
                                         evaluator=EvaluatorSpec(strategy="session_completed")),
                            ids=["demo-calc-add"])[0]
    spec = SessionSpec.from_task(request, 0)
    result = SessionResult(session_id=spec.session_id, task_id=spec.task_id, status=status, reason=reason,
                           metadata={"artifacts": artifacts})
    return SessionOutcome(spec, result, 0, 1.0)


@pytest.mark.parametrize(("datagen", "codes"), [(False, (0, 1, 3)), (True, (1, 1, 3))])
def test_exit_codes_say_whether_the_infrastructure_failed(tmp_path: Path, datagen: bool,
                                                          codes: tuple[int, int, int]) -> None:
    """0 all completed, 1 a session errored on its own, 3 a session's model calls never reached an upstream (a
    datagen run counts what it kept: nothing passed here, so 1, and still 3 for the infrastructure)."""
    infra = _outcome(SessionStatus.ERROR, "upstream_unreachable: upstream http://h:1 unreachable (1 model call(s))",
                     error_cause="upstream_unreachable", model_call_failures={"failed": 1})
    runs = [[_outcome(SessionStatus.COMPLETED)], [_outcome(SessionStatus.ERROR, "init: prepare failed")],
            [_outcome(SessionStatus.COMPLETED), infra]]
    for i, (outcomes, code) in enumerate(zip(runs, codes, strict=True)):
        out = tmp_path / str(i)
        job = LaunchJob(requests=[], inference=InferenceSettings(), out_dir=out, resolved_config="",
                        datagen=DatagenConfig() if datagen else None)
        console = Console(record=True, file=io.StringIO(), width=200)
        assert finish(console, job, outcomes, 1.0) == code
        lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        assert [r["error_cause"] for r in lines] == [error_cause(o.result) for o in outcomes]
    text = console.export_text()
    assert "errors by cause:\n  upstream_unreachable: 1 session(s), e.g. upstream http://h:1 unreachable" in text
    assert "| upstream_unreachable | 1 | upstream_unreachable: upstream http://h:1" in (out / "summary.md").read_text()
