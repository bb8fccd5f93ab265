"""The closed loop on the engine tier (issue 14): SFT on oracle-generated demo trajectories, then GRPO steps through
a real harness CLI (pi) on vLLM CPU in fp32, with every step's weights reloaded into the running engine through the
fleet's weight-update call (``RolloutClient.update_weights``). Asserts: the trainer's logprobs equal the engine's for
every step's traces, in the loop and by ``python -m polar_gym.audit`` on the run folder afterwards (so the engine
serves exactly the trainer's new weights after each update); every trace carries the policy version that sampled it
and the versions advance with the steps; no session is lost or errored."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polar_gym.assets import TINY_MODEL_NAME
from polar_gym.datagen.export import write_dataset
from polar_gym.fleet import InferenceSettings, local_fleet
from polar_gym.gateway.config import GatewayPools
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.server.client import RolloutClient
from polar_gym.tasks import DEMO_TASKS
from polar_gym.trainer import TrainerSettings, WeightSync, run_grpo, run_sft
from tests._vllm import VLLMServer

pytestmark = [pytest.mark.engine, pytest.mark.slow]

TASKS = ("demo-calc-add", "demo-slugify")
MAX_DIFF = 1e-4  # the audit bound: fp32 engine vs fp32 trainer measured 2.2e-5


async def test_sft_then_grpo_with_weight_reloads_on_vllm_fp32(vllm_train_server: VLLMServer, tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is needed: run `bash scripts/setup.sh`")
    requests = [DEMO_TASKS[name].to_request(harness="pi", model_name="policy", num_samples=2) for name in TASKS]

    # 1. demo trajectories from the oracle (the reference solutions, through pi), exported by datagen
    demo = tmp_path / "demo"
    async with (local_fleet(demo, InferenceSettings(), pools=GatewayPools(run_slots=4)) as (url, token),
                RolloutClient(url, token) as client):
        await client.submit_all(requests)
        results = [r async for r in client.results([r.task_id for r in requests], timeout=600)]
    summary = write_dataset(demo / "datagen", results, requests, {"test_fraction": 0.0})
    assert summary.sft_records["train"] == 4

    # 2. SFT on them
    sft = run_sft(TrainerSettings(algorithm="sft", data=[str(demo / "datagen" / "sft" / "train.jsonl")], steps=4,
                                  batch_size=4, learning_rate=3e-3), tmp_path / "sft", echo=lambda _: None)
    sft_rows = [json.loads(x) for x in (tmp_path / "sft" / "train_metrics.jsonl").read_text().splitlines()]
    assert sft_rows[-1]["loss"] < sft_rows[0]["loss"]

    # 3. GRPO on vLLM fp32: the engine starts on the stock weights; the SFT checkpoint goes in as version 0
    engine_url = vllm_train_server.url
    try:
        inference = InferenceSettings(engine="vllm", upstreams=[engine_url], upstream_model=TINY_MODEL_NAME,
                                      max_tokens_cap=256, prompt_mode="token_in")
        out = tmp_path / "grpo"
        async with (local_fleet(out, inference, pools=GatewayPools(run_slots=4)) as (url, token),
                    RolloutClient(url, token) as client):
            if not isinstance(client, WeightSync):
                pytest.fail("RolloutClient.update_weights (the fleet's weight-update call) is not there")
            await client.update_weights(str(sft), 0)
            settings = TrainerSettings(algorithm="grpo", model=str(sft), steps=3, learning_rate=1e-3,
                                       initial_version=0, save_every=1)
            await run_grpo(settings, [r.model_copy(update={"timeout_seconds": 300.0}) for r in requests], client,
                           out / "trainer", weights=client, echo=lambda _: None, timeout=1200)
    finally:  # the session's training server goes back to the stock weights for the tests after this one
        engine = VLLMEngine(UpstreamPool([engine_url]))
        try:
            await engine.update_weights(engine_url, str(vllm_train_server.model_dir), "stock")
        finally:
            await engine.aclose()
    rows = [json.loads(x) for x in (out / "trainer" / "train_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for step, row in enumerate(rows):
        assert row["sessions"] == 4 and row["errored"] == 0, row  # no session lost or errored across updates
        assert row["sampled_versions"] == [str(step)], row  # each step sampled by the version pushed before it
        # the engine's logprobs equal the trainer's for the weights it was just given
        assert row["tokens"] > 0 and row["audit/logprob_abs_diff_max"] < MAX_DIFF, row

    # the mismatch audit, as a user runs it on the run folder: every step's traces under the weights that sampled them
    trainer_dir = out / "trainer"
    models = [f"0={sft}", *(f"{n}={trainer_dir / 'checkpoints' / f'step-{n}'}" for n in (1, 2))]
    command = [sys.executable, "-m", "polar_gym.audit", str(trainer_dir), "--max-abs-diff", str(MAX_DIFF),
               *(arg for m in models for arg in ("--model", m))]
    audit = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=900, check=False)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    summary = json.loads((trainer_dir / "audit_summary.json").read_text())
    traces = [json.loads(x) for x in (trainer_dir / "trajectories.jsonl").read_text().splitlines()]
    assert {t["step"] for t in traces} == {1, 2, 3}
    assert summary["audited"] == len(traces) - sum(summary["skipped"].values())
    assert summary["audited"] > 0 and summary["metrics"]["audit/logprob_abs_diff_max"] < MAX_DIFF, summary
