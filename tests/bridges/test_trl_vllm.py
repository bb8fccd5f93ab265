"""TRL's own GRPOTrainer trained through polar_gym (issue 38), on the engine tier: a real harness CLI (pi, in
bubblewrap) on vLLM CPU in fp32, the capture journal, the prefix-merging builder and the demo evaluators feed TRL's
``rollout_func`` through :class:`polar_gym.bridges.trl.PolarRollout`. Asserts: what TRL's GRPO step received
(prompt and completion ids, its tool mask, the sampling logprobs, the rewards) is exactly the traces of
trajectories.jsonl, step by step; every batch was sampled by the weights TRL had at that step (the policy versions,
and ``python -m polar_gym.audit`` on the run folder); and after training the engine serves TRL's final weights (its
logprobs equal the trained model's, and differ from the starting model's)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from polar_gym.assets import TINY_MODEL_NAME
from polar_gym.bridges.trl import PolarRollout, TRLBridgeSettings
from polar_gym.fleet import InferenceSettings, local_fleet
from polar_gym.gateway.config import GatewayPools
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.tasks import DEMO_TASKS
from tests._vllm import VLLMServer
from tests.bridges._trl import TRL_WARNINGS, Received, trl_config

pytestmark = [pytest.mark.engine, pytest.mark.slow, *TRL_WARNINGS]

TASKS = ("demo-calc-add",)
STEPS = 2
MAX_DIFF = 1e-4  # fp32 engine against the fp32 trainer (the audit's bound in the closed loop)


def _completion_logprobs(model: Any, prompt: list[int], completion: list[int]) -> list[float]:
    """The model's logprob of each completion token after the prompt and the tokens before it."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt + completion])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        picked = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion).unsqueeze(1))
    return picked.squeeze(1).tolist()


def _spread(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """A second reward with some spread: the random model never passes a demo task, so the evaluator's rewards are
    all 0, and without it every advantage would be 0 and no weight would move."""
    return [sum(t % 2 for t in ids) / len(ids) for ids in completion_ids]


async def test_trl_grpo_trains_on_polar_sessions(vllm_train_server: VLLMServer, tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is needed: run `bash scripts/setup.sh`")
    try:
        import torch
        from transformers import AutoModelForCausalLM
        from trl import GRPOTrainer
    except ImportError as exc:  # a pinned extra: set-up installs it
        pytest.fail(f"TRL is needed ({exc}): run `bash scripts/setup.sh`")
    tasks = [DEMO_TASKS[name].to_request(harness="pi", model_name="policy").model_copy(
        update={"timeout_seconds": 300.0}) for name in TASKS]
    model_dir = str(vllm_train_server.model_dir)
    out = tmp_path / "trl"
    received = Received()
    engine_url = vllm_train_server.url
    inference = InferenceSettings(engine="vllm", upstreams=[engine_url], upstream_model=TINY_MODEL_NAME,
                                  max_tokens_cap=64, prompt_mode="token_in")
    try:
        async with local_fleet(tmp_path / "fleet", inference, pools=GatewayPools(run_slots=4)) as (url, token):
            rollout = PolarRollout(tasks, TRLBridgeSettings(server_url=url, admin_token=token, keep_checkpoints=None))
            trainer = GRPOTrainer(model=model_dir, reward_funcs=[received.reward, _spread],
                                  args=trl_config(out, max_steps=STEPS, per_device_train_batch_size=2),
                                  train_dataset=rollout.dataset(),
                                  rollout_func=rollout)
            received.attach(trainer)
            await asyncio.to_thread(trainer.train)
            # the final weights to the engine, then one more batch: sampled by them
            final = await asyncio.to_thread(rollout.sync_weights, trainer)
            after = await asyncio.to_thread(rollout, [tasks[0].instruction] * 2, trainer)
    finally:  # the session's training server goes back to the stock weights for the tests after this one
        engine = VLLMEngine(UpstreamPool([engine_url]))
        try:
            await engine.update_weights(engine_url, model_dir, "stock")
        finally:
            await engine.aclose()

    lines = received.check_against(out / "trajectories.jsonl", STEPS)
    for step in range(1, STEPS + 1):  # each batch sampled by the weights TRL had then (version = global step)
        assert {str(v) for t in lines if t["step"] == step for v in t["metadata"]["policy_versions"]} == {str(step - 1)}

    # the engine serves TRL's final weights: its logprobs are the trained model's, not the starting model's
    assert final == out / "polar_weights" / f"step-{STEPS}"
    start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    trained = trainer.accelerator.unwrap_model(trainer.model).eval()
    moved = 0.0
    for prompt, completion, mask, sampled in zip(after["prompt_ids"], after["completion_ids"], after["env_mask"],
                                                 after["logprobs"], strict=True):
        ours = _completion_logprobs(trained, prompt, completion)
        theirs = _completion_logprobs(start, prompt, completion)
        pairs = [(s, o, t) for s, o, t, m in zip(sampled, ours, theirs, mask, strict=True) if m]
        assert pairs and max(abs(s - o) for s, o, _ in pairs) < MAX_DIFF
        moved = max(moved, *(abs(s - t) for s, _, t in pairs))
    assert moved > 10 * MAX_DIFF, f"the trained weights moved the engine's logprobs by only {moved:.2e}"

    # the mismatch audit, as a user runs it on TRL's output folder: every batch under the weights that sampled it
    models = [f"{n}={out / 'polar_weights' / f'step-{n}'}" for n in range(STEPS + 1)]
    command = [sys.executable, "-m", "polar_gym.audit", str(out), "--max-abs-diff", str(MAX_DIFF),
               *(arg for m in models for arg in ("--model", m))]
    audit = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=900, check=False)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    summary = json.loads((out / "audit_summary.json").read_text())
    assert summary["audited"] == len(lines) - sum(summary["skipped"].values()) > 0, summary
