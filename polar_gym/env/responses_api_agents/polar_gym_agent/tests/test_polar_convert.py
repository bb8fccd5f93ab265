"""Gym-layout tests of the agent, run in NeMo Gym's own interpreter (``python -m unittest discover -s tests`` from
the agent folder; polar_gym's suite runs them in tests/env/test_env_gym_real.py): a Polar /nemo payload becomes
output items that validate as NeMo Gym's training types, keep NeMo RL's prefix contiguity and carry the reward."""

from __future__ import annotations

import unittest
from typing import Any

from nemo_gym.openai_utils import (
    NeMoGymResponseFunctionCallOutput,
    NeMoGymResponseFunctionToolCall,
    NeMoGymResponseOutputMessageForTraining,
)
from polar_convert import backend_urls, rollout_parts, split_rollout

TYPES = {"message": NeMoGymResponseOutputMessageForTraining, "function_call": NeMoGymResponseFunctionToolCall,
         "function_call_output": NeMoGymResponseFunctionCallOutput}


def _item(prompt: list[int], generated: list[int], turn: dict[str, Any] | None, version: int = 1) -> dict[str, Any]:
    return {"prompt_token_ids": prompt, "generation_token_ids": generated,
            "generation_log_probs": [-0.25] * len(generated), "turn": turn, "policy_version": version,
            "logprobs_missing": False}


PAYLOAD = {
    "session_id": "s-1", "task_id": "t-1", "status": "COMPLETED", "reason": None, "reward": 1.0, "passed": True,
    "builder": "prefix_merging",
    "chains": [
        {"trace_index": 0, "chain_cause": None, "contiguity_error": None, "items": [
            _item([1, 2, 3], [4, 5], {"role": "assistant", "content": "run ls",
                                     "tool_calls": [{"id": "c1", "function": {"name": "bash",
                                                                              "arguments": "{\"cmd\": \"ls\"}"}}],
                                     "tool_results": [{"role": "tool", "tool_call_id": "c1", "content": "a.py"}]}),
            _item([1, 2, 3, 4, 5, 6, 7], [8], {"role": "assistant", "content": "done", "tool_results": []}, 2)]},
        {"trace_index": 1, "chain_cause": "sub_agent", "contiguity_error": None, "items": [
            _item([9], [10], None)]},
    ],
}


class PolarConvertTest(unittest.TestCase):
    def test_items_validate_as_nemo_gym_training_types(self) -> None:
        parts = rollout_parts(PAYLOAD)
        output = [TYPES[item["type"]].model_validate(item) for item in parts["output"]]
        self.assertEqual([o.type for o in output], ["message", "function_call", "function_call_output", "message"])
        self.assertEqual(output[0].generation_token_ids, [4, 5])
        self.assertEqual(parts["metadata"]["polar_reward"], "1.0")
        self.assertEqual(parts["extras"]["polar"]["extra_chains"], 1)

    def test_the_policy_version_of_every_sampled_turn_is_carried(self) -> None:
        parts = rollout_parts(PAYLOAD)
        self.assertEqual(parts["extras"]["polar"]["policy_versions"], [1, 2])
        self.assertFalse(parts["extras"]["polar"]["logprobs_missing"])

    def test_prompts_are_cumulative(self) -> None:
        seen: list[int] = []
        for item in rollout_parts(PAYLOAD)["output"]:
            if "generation_token_ids" not in item:
                continue
            self.assertEqual(item["prompt_token_ids"][:len(seen)], seen)
            seen = item["prompt_token_ids"] + item["generation_token_ids"]

    def test_separate_rows_keep_the_sub_agent_chain(self) -> None:
        parts = rollout_parts(PAYLOAD, "separate_rows")
        line = {"reward": 1.0, "response": {"output": parts["output"]}, **parts["extras"]}
        rows = split_rollout(line)
        self.assertEqual([r["polar_chain"] for r in rows], ["main", 1])
        self.assertEqual(rows[1]["response"]["output"][0]["generation_token_ids"], [10])

    def test_policy_urls_lose_the_openai_suffix(self) -> None:
        self.assertEqual(backend_urls("http://a:8000/v1, http://b:8000/"), ["http://a:8000", "http://b:8000"])


if __name__ == "__main__":
    unittest.main()
