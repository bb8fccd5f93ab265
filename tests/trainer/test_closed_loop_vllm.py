"""The closed loop on the engine tier (issue 14): SFT on oracle-generated demo trajectories, then GRPO steps through
a real harness CLI (pi) on vLLM CPU in fp32, with every step's weights reloaded into the running engine through the
fleet's weight-update call (``RolloutClient.update_weights``). Asserts: the trainer's logprobs equal the engine's for
every step's traces (so the engine serves exactly the trainer's new weights after each update), every trace carries
the policy version that sampled it and the versions advance with the steps, no session is lost or errored."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from polar_gym.assets import TINY_MODEL_NAME, tiny_model_dir, vllm_python, vllm_server_command, vllm_server_env
from polar_gym.datagen.export import write_dataset
from polar_gym.fleet import InferenceSettings, local_fleet
from polar_gym.gateway.config import GatewayPools
from polar_gym.server.client import RolloutClient
from polar_gym.tasks import DEMO_TASKS
from polar_gym.trainer import TrainerSettings, WeightSync, run_grpo, run_sft
from tests._vllm import SETUP_HINT, _free_port, _kill_group, _tail

pytestmark = [pytest.mark.engine, pytest.mark.slow]

TASKS = ("demo-calc-add", "demo-slugify")
MAX_DIFF = 1e-4  # the audit bound: fp32 engine vs fp32 trainer measured 2.2e-5


@contextlib.contextmanager
def fp32_vllm(log_path: Path) -> Iterator[str]:
    """vLLM CPU serving the stock tiny model in float32 with weight updates on (dev routes + worker extension)."""
    if not vllm_python().exists() or not (tiny_model_dir() / ".complete").exists():
        pytest.fail(SETUP_HINT, pytrace=False)
    port = _free_port()
    cmd = vllm_server_command(port, dtype="float32", weight_updates=True, max_model_len=32768)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=vllm_server_env(weight_updates=True), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + float(os.environ.get("POLAR_ENGINE_READY_TIMEOUT", "240"))
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vLLM fp32 did not start; log {log_path}:\n{_tail(log_path)}", pytrace=False)
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        yield url
    finally:
        _kill_group(proc)


async def test_sft_then_grpo_with_weight_reloads_on_vllm_fp32(tmp_path: Path) -> None:
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
    with fp32_vllm(tmp_path / "vllm.log") as engine_url:
        inference = InferenceSettings(engine="vllm", upstreams=[engine_url], upstream_model=TINY_MODEL_NAME,
                                      max_tokens_cap=256)
        out = tmp_path / "grpo"
        async with (local_fleet(out, inference, pools=GatewayPools(run_slots=4)) as (url, token),
                    RolloutClient(url, token) as client):
            if not isinstance(client, WeightSync):
                pytest.fail("RolloutClient.update_weights (the fleet's weight-update call) is not there")
            await client.update_weights(str(sft), 0)
            settings = TrainerSettings(algorithm="grpo", model=str(sft), steps=3, learning_rate=1e-3,
                                       initial_version=0)
            await run_grpo(settings, [r.model_copy(update={"timeout_seconds": 300.0}) for r in requests], client,
                           out / "trainer", weights=client, echo=lambda _: None, timeout=1200)
    rows = [json.loads(x) for x in (out / "trainer" / "train_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for step, row in enumerate(rows):
        assert row["sessions"] == 4 and row["errored"] == 0, row  # no session lost or errored across updates
        assert row["sampled_versions"] == [str(step)], row  # each step sampled by the version pushed before it
        # the engine's logprobs equal the trainer's for the weights it was just given
        assert row["tokens"] > 0 and row["rollout_corr/max_abs_diff"] < MAX_DIFF, row
