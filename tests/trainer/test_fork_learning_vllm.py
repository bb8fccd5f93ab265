"""Learning, against a control, on the engine tier (issue 36): the fork on the tiny Qwen3 through the trainer.

SFT on a right and a wrong answer to one prompt that differ in one token (``return a + b`` / ``return a * b``)
leaves the model between them; GRPO (``run_grpo``: reference-answer evaluation, shuffle control, step verdicts,
weight pushes; SGD, whose steps follow the gradient) then samples on the real vLLM fp32 server, which is reloaded
with every step's weights. The reward must move the policy: the treatment's exact P(right) rises and its share
passes 0.9, while the shuffled-reward control's P(right) does not rise. Each "session" here is one completion the
engine samples for the fork's prompt (the full stack, harness and sandbox included, is
benchmarks/bench_learning.py's: ~30 minutes)."""

from __future__ import annotations

import json
import zlib
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar_gym.assets import TINY_MODEL_NAME
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.schema import (
    AgentSpec,
    EvalResult,
    SessionResult,
    SessionStatus,
    TaskRequest,
    Trace,
    Trajectory,
)
from polar_gym.tiny_model import EOS_TOKEN_ID
from polar_gym.trainer import TrainerSettings, load_reference_answers, run_grpo, run_sft
from tests._vllm import VLLMServer

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PROMPT = "calc.py's add(a, b) returns a - b. Reply with the one fixed line of add."
STEPS = 8
SAMPLES = 64  # the control's random steps shrink as 1/sqrt(SAMPLES) against the treatment's (token-mean loss)


def _records(path: Path) -> Path:
    """The fork as datagen records: the right answer (reward 1) and the wrong one (reward 0)."""
    lines = [{"messages": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": answer}],
              "reward": reward, "metadata": {"oracle_variant": name}}
             for name, answer, reward in (("reference", "return a + b", 1.0), ("wrong", "return a * b", 0.0))]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


class EngineSessions:
    """A RolloutSource whose sessions are single completions the real engine samples for the fork's prompt (the
    task's ``metadata.sampling`` applies, as the proxy applies it), scored by whether the answer adds."""

    def __init__(self, engine_url: str, prompt_ids: list[int], tokenizer: Any) -> None:
        self.url, self.prompt_ids, self.tokenizer = engine_url, prompt_ids, tokenizer
        self.tasks: dict[str, TaskRequest] = {}
        self.version: int | str = 0

    async def submit(self, task: TaskRequest) -> dict[str, Any]:
        self.tasks[task.task_id] = task
        return {"task_id": task.task_id}

    async def update_weights(self, checkpoint: str, version: int | str) -> None:
        engine = VLLMEngine(UpstreamPool([self.url]))
        try:
            await engine.update_weights(self.url, checkpoint, version)
        finally:
            await engine.aclose()
        self.version = version

    async def results(self, task_ids: Iterable[str], **_: Any) -> AsyncIterator[SessionResult]:
        async with httpx.AsyncClient(timeout=300) as http:
            for task_id in task_ids:
                task = self.tasks.pop(task_id)
                sampling = task.metadata.sampling
                # seeded: the same weights sample the same sessions, so the test's verdict does not vary by run
                body = {"model": TINY_MODEL_NAME, "prompt": self.prompt_ids, "n": task.num_samples, "max_tokens": 12,
                        "seed": zlib.crc32(task_id.encode()),
                        "temperature": 1.0 if sampling is None or sampling.temperature is None else
                        sampling.temperature, "logprobs": 0, "return_token_ids": True,
                        "stop_token_ids": [EOS_TOKEN_ID], "skip_special_tokens": False}
                answer = (await http.post(f"{self.url}/v1/completions", json=body)).raise_for_status().json()
                for i, choice in enumerate(answer["choices"]):
                    ids = list(choice["token_ids"])
                    reward = 1.0 if "a + b" in self.tokenizer.decode(ids) else 0.0
                    trace = Trace(prompt_ids=self.prompt_ids, response_ids=ids, loss_mask=[1] * len(ids),
                                  response_logprobs=[float(x) for x in choice["logprobs"]["token_logprobs"]],
                                  metadata={"engine": "vllm", "policy_versions": [str(self.version)]})
                    session = f"{task_id}-{i}"
                    yield SessionResult(session_id=session, task_id=task_id, status=SessionStatus.COMPLETED,
                                        trajectory=Trajectory(session_id=session, traces=[trace]),
                                        evaluation=EvalResult(reward=reward))


async def _arm(source: EngineSessions, sft: Path, references: Path, out: Path, *,
               shuffle: bool) -> list[dict[str, Any]]:
    await source.update_weights(str(sft), 0)
    task = TaskRequest(task_id="fork", instruction=PROMPT, num_samples=SAMPLES, agent=AgentSpec(harness="shell"))
    settings = TrainerSettings(algorithm="grpo", model=str(sft), steps=STEPS, optimizer="sgd", learning_rate=0.03,
                               seed=0, shuffle_rewards=shuffle, reference_answers=[str(references)],
                               greedy_samples=1, threads=2)
    await run_grpo(settings, [task], source, out, weights=source, echo=lambda _: None, timeout=600)
    return [json.loads(x) for x in (out / "train_metrics.jsonl").read_text().splitlines()]


async def test_the_reward_moves_the_policy_and_the_shuffled_control_does_not(vllm_train_server: VLLMServer,
                                                                           tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    references = _records(tmp_path / "fork.jsonl")
    sft = run_sft(TrainerSettings(algorithm="sft", data=[str(references)], steps=40, batch_size=2,
                                  learning_rate=5e-3, threads=2), tmp_path / "sft", echo=lambda _: None)
    tokenizer = AutoTokenizer.from_pretrained(str(sft))
    answers = load_reference_answers([references], tokenizer)
    assert [a.name for a in answers] == ["reference", "wrong"]
    source = EngineSessions(vllm_train_server.url, answers[0].sequence.prompt_ids, tokenizer)
    try:
        treatment = await _arm(source, sft, references, tmp_path / "treatment", shuffle=False)
        control = await _arm(source, sft, references, tmp_path / "control", shuffle=True)
    finally:  # the session's training server goes back to the stock weights for the tests after this one
        await source.update_weights(str(vllm_train_server.model_dir), "stock")

    for rows in (treatment, control):
        assert [r["step"] for r in rows] == list(range(STEPS + 1))  # step 0: the SFT checkpoint, evaluated
        assert 0.2 < rows[0]["eval/share_right"] < 0.8, rows[0]  # SFT alone leaves the fork open
        assert all(r["audit/logprob_abs_diff_max"] < 1e-3 for r in rows[1:])  # the engine ran the trained weights
        assert all(r["eval/greedy_n"] == 1 for r in rows[1:])
    assert all(r["shuffled_rewards"] for r in control[1:]) and not any(r["shuffled_rewards"] for r in treatment[1:])
    first, last = treatment[0], treatment[-1]
    assert last["eval/p_right"] > first["eval/p_right"] + 0.1, (first, last)
    assert last["eval/share_right"] > 0.9, last
    assert control[-1]["eval/p_right"] <= control[0]["eval/p_right"] + 0.05, (control[0], control[-1])
