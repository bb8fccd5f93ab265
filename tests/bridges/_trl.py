"""What TRL's GRPO step received, recorded and compared with the run's trajectories.jsonl (tests of
polar_gym.bridges.trl on the oracle fleet and on vLLM)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from polar_gym.bridges.trl import polar_reward

__all__ = ["TRL_WARNINGS", "Received", "trl_config"]

#: TRL 1.16's own defaults touch arguments transformers 5.23 deprecates (TRL's to fix, not ours), and it warns that
#: rollout_func is experimental
TRL_WARNINGS = [pytest.mark.filterwarnings("ignore:.*is deprecated and will be removed in v6:FutureWarning"),
                pytest.mark.filterwarnings("ignore:You are using 'rollout_func':UserWarning")]


def trl_config(out: Path, **overrides: Any) -> Any:
    """GRPOConfig for a few CPU steps: 4 rows per step (2 generations per prompt), fp32, nothing saved or reported."""
    import torch
    from trl import GRPOConfig

    return GRPOConfig(**{"output_dir": str(out), "per_device_train_batch_size": 4, "num_generations": 2,
                         "max_steps": 2, "learning_rate": 3e-3, "use_cpu": True, "bf16": False, "report_to": [],
                         "logging_steps": 1, "save_strategy": "no", "seed": 0,
                         "model_init_kwargs": {"dtype": torch.float32}, **overrides})


def _unpad(ids: Any, mask: Any) -> list[list[Any]]:
    return [[t.item() for t, m in zip(row, keep, strict=True) if m] for row, keep in zip(ids, mask, strict=True)]


class Received:
    """Records each batch TRL's GRPO step gets (``_generate_and_score_completions``' output, before TRL shuffles
    and splits it) and the fields its reward function gets."""

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []
        self.rewards: list[dict[str, list[Any]]] = []

    def reward(self, completions: list[Any], **kwargs: Any) -> list[float | None]:
        self.rewards.append({"reward": list(kwargs["polar_reward"]), "session": list(kwargs["polar_session_id"])})
        return polar_reward(completions, **kwargs)

    def attach(self, trainer: Any) -> None:
        score = trainer._generate_and_score_completions

        def recorded(inputs: Any) -> Any:
            output = score(inputs)
            self.batches.append({k: v.detach().clone() if hasattr(v, "detach") else v for k, v in output.items()})
            return output

        trainer._generate_and_score_completions = recorded

    def check_against(self, trajectories: Path, steps: int) -> list[dict[str, Any]]:
        """Every step's batch is exactly that step's traces of trajectories.jsonl, in order: prompt and completion
        ids, the mask (TRL's tool mask), the sampling logprobs and the rewards. The trajectory lines."""
        lines = [json.loads(x) for x in trajectories.read_text().splitlines()]
        assert len(self.batches) == steps and len(self.rewards) == steps and all(self.rewards)
        for step, got in enumerate(self.batches, start=1):
            traces = [t for t in lines if t["step"] == step]
            # one trace per session here (pi, prefix merging), in the order of TRL's batch
            assert [t["session_id"] for t in traces] == self.rewards[step - 1]["session"], (step, traces)
            keep = got["completion_mask"]
            assert _unpad(got["prompt_ids"], got["prompt_mask"]) == [t["prompt_ids"] for t in traces]
            assert _unpad(got["completion_ids"], keep) == [t["response_ids"] for t in traces]
            assert _unpad(got["tool_mask"], keep) == [t["loss_mask"] for t in traces]
            sampled = [[x["logprob"] for x in t["response_logprobs"]] for t in traces]
            assert _unpad(got["sampling_per_token_logps"], keep) == [pytest.approx(s, abs=1e-6) for s in sampled]
            assert self.rewards[step - 1]["reward"] == [t["session_reward"] for t in traces]
        return lines
