"""``python -m polar_gym.launch +trainer=sft|grpo``: composed by Hydra, validated with the other groups, run."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from pathlib import Path

import httpx
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape

from polar_gym.assets import TINY_MODEL_NAME, tiny_model_dir, vllm_python
from polar_gym.launch import CONF_DIR, ConfigError, UpstreamCheckFailed, build_job, run
from polar_gym.launch.training import PolicyServer, policy_server, served_inference, started_policy_server
from polar_gym.report import load_run
from polar_gym.serving import free_port
from polar_gym.trainer import TrainerSettings
from tests._vllm import VLLMServer, load_stock_weights
from tests._waiting import until_sync
from tests.trainer._tiny import small_qwen3_dir
from tests.trainer.test_sft import MESSAGES

#: a stand-in for vLLM's process (its /health and nothing else), to test starting and stopping one
HEALTH_SERVER = """
import http.server, os, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
print(os.getpid(), flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def composed(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_trainer_groups_validate_into_trainer_settings(tmp_path: Path) -> None:
    job = build_job(composed("+trainer=grpo", "trainer.rollout_correction=token_truncate", f"out_dir={tmp_path}"))
    assert job.trainer == TrainerSettings(algorithm="grpo", rollout_correction="token_truncate")
    assert build_job(composed("+trainer=sft", f"out_dir={tmp_path}")).trainer == TrainerSettings()
    assert build_job(composed(f"out_dir={tmp_path}")).trainer is None
    with pytest.raises(ConfigError) as err:
        build_job(composed("+trainer=sft", "trainer.steps=0", "trainer.algorithm=ppo", f"out_dir={tmp_path}"))
    assert sorted(err.value.keys) == ["trainer.algorithm", "trainer.steps"]


def test_a_grpo_run_may_be_resumed_and_an_sft_run_may_not(tmp_path: Path) -> None:
    assert build_job(composed("+trainer=grpo", "resume=true", f"out_dir={tmp_path}")).resume
    with pytest.raises(ConfigError, match="an SFT run") as err:
        build_job(composed("+trainer=sft", "resume=true", f"out_dir={tmp_path}"))
    assert err.value.keys == ["resume"]


def test_launch_trainer_sft_trains_on_a_datagen_export(tmp_path: Path) -> None:
    data = tmp_path / "sft" / "train.jsonl"
    data.parent.mkdir()
    data.write_text(json.dumps({"messages": MESSAGES, "reward": 1.0}) + "\n")
    out = tmp_path / "run"
    code = run(composed("+trainer=sft", f"trainer.model={small_qwen3_dir(tmp_path)}", f"trainer.data=[{data}]",
                        "trainer.steps=2", "trainer.batch_size=1", f"out_dir={out}"))
    assert code == 0
    rows = [json.loads(x) for x in (out / "trainer" / "train_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] < rows[0]["loss"]
    assert (out / "trainer" / "checkpoints" / "final" / "model.safetensors").exists()
    assert (out / "config.yaml").exists()
    assert run(composed("+trainer=sft", f"out_dir={tmp_path / 'nodata'}")) == 2  # no trainer.data: config error


def test_grpo_on_the_oracle_refuses_without_vllm_and_names_the_commands(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's first run, `+trainer=grpo trainer.steps=3` and nothing else, on a machine without vLLM's CPU
    build: exit 2 before anything starts, with the install command and the manual alternative."""
    monkeypatch.setenv("POLAR_CACHE", str(tmp_path / "cache"))
    assert not vllm_python().exists()
    out = tmp_path / "run"
    assert run(composed("+trainer=grpo", "trainer.steps=3", f"out_dir={out}")) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "inference: +trainer=grpo needs an engine that samples from the policy being trained" in err
    assert "run `bash scripts/setup.sh --engine`" in err
    assert (f"`python -m polar_gym.trainer serve {tiny_model_dir()} --port 8000`, then add `inference=vllm "
            f"inference.upstreams=[http://127.0.0.1:8000] inference.upstream_model={TINY_MODEL_NAME}`") in err
    assert not (out / "trainer" / "vllm-server.log").exists() and not (out / "results.jsonl").exists()


def test_grpo_on_the_oracle_serves_the_model_being_trained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With vLLM's CPU build installed the run serves trainer.model itself and runs on it as inference=vllm;
    a job that names an engine, and SFT, start nothing."""
    monkeypatch.setenv("POLAR_CACHE", str(tmp_path / "cache"))
    vllm_python().parent.mkdir(parents=True)
    vllm_python().touch()
    model, out = tmp_path / "model", tmp_path / "run"
    model.mkdir()
    (model / "config.json").write_text("{}")
    job = build_job(composed("+trainer=grpo", f"trainer.model={model}", "trainer.initial_version=3",
                             f"out_dir={out}"))
    server = policy_server(job, port=43123)
    assert server == PolicyServer([sys.executable, "-m", "polar_gym.trainer", "serve", str(model), "--port", "43123",
                                   "--dtype", "float32"], 43123, model, out / "trainer" / "vllm-server.log")
    bf16 = policy_server(build_job(composed("+trainer=grpo", f"trainer.model={model}", "trainer.engine_dtype=bfloat16",
                                            f"out_dir={out}")), port=43123)
    assert bf16 is not None and bf16.command[-2:] == ["--dtype", "bfloat16"]  # trainer.engine_dtype
    printed = io.StringIO()
    Console(file=printed, width=400).print(f"[yellow]{escape(server.notice)}[/]")  # as the run prints it
    assert "training on it (inference=vllm inference.upstreams=[http://127.0.0.1:43123];" in printed.getvalue()
    inference = served_inference(job.inference, server, job.trainer.initial_version if job.trainer else 0)
    assert (inference.engine, inference.upstreams, inference.upstream_model) == (
        "vllm", ["http://127.0.0.1:43123"], TINY_MODEL_NAME)
    assert inference.policy_version == 3 and inference.prompt_mode == "token_in"  # said, not left to a cache
    assert inference.tokenizer == job.inference.tokenizer and inference.max_tokens_cap == 4096
    assert policy_server(build_job(composed("+trainer=grpo", "inference=vllm", f"out_dir={out}"))) is None
    assert policy_server(build_job(composed("+trainer=sft", f"out_dir={out}"))) is None
    with pytest.raises(ConfigError) as err:  # a trainer.model that is not a model
        policy_server(build_job(composed("+trainer=grpo", f"trainer.model={tmp_path}", f"out_dir={out}")))
    assert err.value.keys == ["trainer.model"]


async def test_the_policy_server_is_waited_for_and_stopped_with_its_group(tmp_path: Path) -> None:
    port = free_port()
    server = PolicyServer([sys.executable, "-c", HEALTH_SERVER, str(port)], port, tmp_path, tmp_path / "s.log")
    async with started_policy_server(server, QUIET, wait_seconds=60) as url:
        assert url == f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient() as client:
            assert (await client.get(url + "/health")).status_code == 200
        pid = int(server.log.read_text().splitlines()[-1])
    until_sync(lambda: not _alive(pid), what="the server's process group to be gone")
    assert server.log.read_text().startswith(" ".join(server.command))


async def test_a_policy_server_that_dies_before_it_is_ready_fails_the_run_with_its_log(tmp_path: Path) -> None:
    server = PolicyServer([sys.executable, "-c", "print('no CPU for you'); raise SystemExit(7)"], free_port(),
                          tmp_path, tmp_path / "s.log")
    with pytest.raises(UpstreamCheckFailed) as err:
        async with started_policy_server(server, QUIET, wait_seconds=60, poll=0.05):
            pytest.fail("the block ran without a server")
    assert "exited with 7 before it was ready" in str(err.value) and "no CPU for you" in str(err.value)
    assert str(server.log) in str(err.value)


QUIET = Console(file=io.StringIO())


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.engine
@pytest.mark.slow
def test_an_asynchronous_run_survives_twenty_updates_with_every_token_accounted_for(
        vllm_train_server: VLLMServer, tmp_path: Path) -> None:
    """Issue 37's "nothing lost": pi sessions on the fp32 vLLM through the whole path (rollout server, gateway,
    token-in proxy), trainer.max_staleness 1, a weight push after each of 20 steps while the next round's sessions
    run (the push cuts their generations and they continue under the new weights). No session errs, every sample is
    at most one version old, and every sampled token is trained or masked with a reason. Issue 14's closed loop too:
    after every push the engine's logprobs are the trainer's (fp32 against fp32). The rest of that loop is elsewhere:
    SFT on a datagen export (docs/trainers.md), GRPO from an SFT checkpoint pushed as version 0
    (test_fork_learning_vllm.py), the audit command over a run folder, step by step (tests/bridges/test_trl_vllm.py)."""

    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is needed: run `bash scripts/setup.sh`")
    out, steps = tmp_path / "run", 20
    try:
        code = run(composed("+trainer=grpo", f"trainer.model={vllm_train_server.model_dir}", f"trainer.steps={steps}",
                            "trainer.max_staleness=1", "trainer.rollout_correction=token_truncate",
                            "num_samples=2", "tasks.ids=[demo-calc-add]", "inference=vllm",
                            f"inference.upstreams=[{vllm_train_server.url}]", "inference.policy_version=0",
                            f"inference.upstream_model={vllm_train_server.model}", "inference.max_tokens_cap=48",
                            "launcher.progress=false", f"out_dir={out}"))
    finally:  # the session's training server goes back to its own weights for the tests after this one
        load_stock_weights(vllm_train_server)
    assert code == 0
    rows = [json.loads(x) for x in (out / "trainer" / "train_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)) and all("push_seconds" in r for r in rows)
    assert all(r["errored"] == 0 and r["sessions"] == 2 for r in rows), [r["errored"] for r in rows]
    assert all(r["staleness/max"] <= 1 and r["staleness/unknown"] == 0 for r in rows)
    assert any(r["staleness/max"] == 1 for r in rows)  # sampled ahead: some samples one version behind
    # each token against the weights of the version that sampled it: the fp32 engine serves exactly each push
    # (measured max 2e-6 a step; the audit's fp32 bound is 1e-4)
    assert all(r["audit/logprob_abs_diff_max"] < 1e-4 for r in rows), [r["audit/logprob_abs_diff_max"] for r in rows]
    for row in rows:
        masked = sum(v for k, v in row.items() if k.startswith("masked_tokens/"))
        assert row["tokens/sampled"] == row["tokens/trained"] + masked > 0, row
    traces = [json.loads(x) for x in (out / "trainer" / "trajectories.jsonl").read_text().splitlines()]
    cut = [s for t in traces for s in t["metadata"].get("spans", []) if s.get("cut")]
    print(f"{len(traces)} traces, {len(cut)} spans of generations cut by an update; push seconds "
          f"{sorted(round(r['push_seconds'], 2) for r in rows)}")
    assert (out / "trainer" / "checkpoints" / f"step-{steps}" / "model.safetensors").exists()
    report = load_run(out)
    assert len(report.sessions) >= 2 * steps and all(s.status == "COMPLETED" for s in report.sessions)
    page = (out / "report.html").read_text()
    assert '<figure id="fig-training"><svg' in page and ">reward_mean<" in page
