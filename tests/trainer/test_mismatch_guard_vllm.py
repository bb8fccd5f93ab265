"""The mismatch guard on the engine tier (issue 37): completions sampled by the shared bf16 vLLM (token ids and raw
logprobs, as the proxy captures them) and trained by an fp32 trainer are refused with reason ``mismatch`` and a
message naming the metric, its value, the bound and what to do; the same capture from the fp32 training server is
not refused. Default settings: the default bound is what is being tested."""

from __future__ import annotations

import httpx
import pytest

from polar_gym.report.training import MISMATCH
from polar_gym.trainer import Trainer, TrainerSettings, TrainSequence
from polar_gym.trainer.verdict import StepVerdict, step_verdict
from tests._vllm import VLLMServer

pytestmark = [pytest.mark.engine]

#: chat-formatted prompts of the tiny Qwen3 (<|im_start|>user ... <|im_start|>assistant)
PROMPTS = [[151644, 872, 198, 7985, 264, 2805, 32794, 151645, 198, 151644, 77091, 198],
           [151644, 872, 198, 3838, 374, 220, 16, 22, 3039, 30, 151645, 198, 151644, 77091, 198]]


def _captured(server: VLLMServer, samples: int = 8, max_tokens: int = 48) -> list[TrainSequence]:
    out = []
    with httpx.Client(timeout=300) as client:
        for i in range(samples):
            body = {"model": server.model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                    "temperature": 1.0, "logprobs": 0, "return_tokens_as_token_ids": True, "seed": i}
            choice = client.post(server.url + "/v1/completions", json=body).raise_for_status().json()["choices"][0]
            tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            out.append(TrainSequence(PROMPTS[i % len(PROMPTS)], tokens, [1] * len(tokens), logprobs,
                                     advantage=1.0 if i % 2 else -1.0, reward=float(i % 2), group="g"))
    return out


def _verdict(server: VLLMServer, sequences: list[TrainSequence]) -> tuple[StepVerdict, dict[str, float]]:
    settings = TrainerSettings(algorithm="grpo")
    trainer = Trainer(settings, server.model_dir)
    verdicts: list[StepVerdict] = []
    seen: dict[str, float] = {}

    def judge(stats: dict[str, float]) -> bool:
        seen.update(stats)
        verdicts.append(step_verdict([s.reward for s in sequences], [s.group for s in sequences], [],
                                     mismatch=stats.get(settings.mismatch_metric),
                                     max_mismatch=settings.max_mismatch, mismatch_metric=settings.mismatch_metric))
        return verdicts[-1].trained

    trainer.grpo_step(sequences, judge)
    return verdicts[-1], seen


def test_a_bf16_engine_is_refused_and_an_fp32_one_is_not(vllm_server: VLLMServer,
                                                         vllm_train_server: VLLMServer) -> None:
    refused, stats = _verdict(vllm_server, _captured(vllm_server))
    assert not refused.trained and refused.reasons == (MISMATCH,), refused
    assert "audit/logprob_abs_diff_mean = " in refused.message and "> trainer.max_mismatch 0.0002" in refused.message
    assert "trainer.engine_dtype" in refused.message
    assert stats["audit/logprob_abs_diff_mean"] > 2e-4

    passed, stats = _verdict(vllm_train_server, _captured(vllm_train_server))
    assert passed.trained, passed.message
    assert stats["audit/logprob_abs_diff_mean"] < 2e-5
