"""What a GRPO step measures besides its loss: the noise-free numbers a learning claim rests on.

- ``reward_mean`` / ``reward_se`` / ``reward_n``: the sampled success of the step's training sessions with its
  standard error (sampled at the engine's temperature, so noisy: 16 sessions at p = 0.5 give se 0.125).
- ``eval/*`` from :class:`ReferenceScorer`: the exact log-probability of each reference answer (a forked task's
  right and wrong demos) under the current weights, teacher-forced through the chat template and tools the rollouts
  saw; no sampling noise at all.
- ``eval/greedy_success``: extra sessions per task sampled greedily (the proxy forces temperature 0 through
  ``metadata.sampling``, whatever the harness asks) by the policy that samples the step, never trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polar_gym.schema import SamplingOverride, SessionResult, TaskRequest
from polar_gym.trainer.reference_eval import ReferenceAnswer, answer_logprobs, load_reference_answers, reference_metrics
from polar_gym.trainer.stats import mean_se

__all__ = ["GREEDY_SUFFIX", "ReferenceScorer", "greedy_request", "is_greedy", "reward_stats", "session_reward"]

#: the task id suffix of a step's greedy evaluation sessions
GREEDY_SUFFIX = "-greedy"


def session_reward(result: SessionResult) -> float:
    """The session's evaluated reward (0 when it has none: an errored or unevaluated session did not succeed)."""
    return float(result.evaluation.reward or 0.0) if result.evaluation is not None else 0.0


def reward_stats(results: Sequence[SessionResult], prefix: str = "reward") -> dict[str, float]:
    """Mean, population std (as before), standard error and count of the sessions' rewards."""
    rewards = [session_reward(r) for r in results]
    if not rewards:
        return {f"{prefix}_mean": 0.0, f"{prefix}_std": 0.0, f"{prefix}_se": 0.0, f"{prefix}_n": 0}
    mean, se = mean_se(rewards)
    std = (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5
    return {f"{prefix}_mean": mean, f"{prefix}_std": std, f"{prefix}_se": se, f"{prefix}_n": len(rewards)}


def greedy_request(request: TaskRequest, samples: int) -> TaskRequest:
    """A step's task request turned into its greedy evaluation: ``samples`` sessions at temperature 0, in a group of
    their own (never mixed with the training group's advantages)."""
    task_id = request.task_id + GREEDY_SUFFIX
    meta = request.metadata.model_copy(update={"group_id": task_id,
                                               "sampling": SamplingOverride(temperature=0.0)})
    return request.model_copy(update={"task_id": task_id, "num_samples": samples, "metadata": meta})


def is_greedy(result: SessionResult) -> bool:
    return result.task_id.endswith(GREEDY_SUFFIX)


class ReferenceScorer:
    """The reference answers of ``trainer.reference_answers``, loaded once, scored under a model on each call."""

    def __init__(self, paths: Sequence[str], model_dir: Path, pad_id: int) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.answers: list[ReferenceAnswer] = load_reference_answers(paths, tokenizer)
        self.pad_id = pad_id

    def __call__(self, model: Any) -> dict[str, float]:
        return reference_metrics(self.answers, answer_logprobs(model, self.answers, self.pad_id))
