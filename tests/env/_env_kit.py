"""Helpers of the NeMo Gym plugin tests: the Gym-side modules loaded by path (they live in NeMo Gym's folder
convention, not in an importable package), a session with two chains, NeMo RL's contiguity rule re-implemented,
and where the prebuilt NeMo Gym venv is."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from polar_gym.schema import EvalResult, SessionResult, SessionStatus, Trace, Trajectory

__all__ = ["AGENT_DIR", "ENV_DIR", "RESOURCES_DIR", "gym_venv_or_skip", "load_agent_module",
           "nemo_rl_contiguity", "two_chain_result"]

ENV_DIR = Path(__file__).resolve().parents[2] / "polar_gym" / "env"
AGENT_DIR = ENV_DIR / "responses_api_agents" / "polar_gym_agent"
RESOURCES_DIR = ENV_DIR / "resources_servers" / "polar_gym_resources"


def load_agent_module(name: str) -> ModuleType:
    """``polar_convert`` / ``polar_client`` from the agent folder, under a unique module name."""
    key = f"_polar_gym_agent_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, AGENT_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


def _trace(prompt: list[int], pieces: list[tuple[list[int], int]], messages: list[dict[str, Any]]) -> Trace:
    """A prefix-merged-looking trace: ``pieces`` are (tokens, mask) runs of the response; sampled runs get
    builder spans and logprobs -0.1 * position."""
    response, mask, spans = [], [], []
    for k, (tokens, m) in enumerate(pieces):
        if m:
            spans.append({"start": len(response), "end": len(response) + len(tokens), "completion_id": f"c{k}"})
        response += tokens
        mask += [m] * len(tokens)
    return Trace(prompt_ids=prompt, response_ids=response, loss_mask=mask,
                 response_logprobs=[-0.1 * i for i in range(len(response))], response_messages=messages,
                 finish_reason="stop", metadata={"spans": spans})


def two_chain_result() -> SessionResult:
    """A completed session with a main chain (two turns around a tool call) and a smaller sub-agent chain."""
    main = _trace([1, 2, 3, 4], [([10, 11, 12], 1), ([20, 21], 0), ([13, 14], 1)], [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "calc.py"},
        {"role": "assistant", "content": "done"}])
    sub = _trace([1, 2, 99], [([50], 1)], [{"role": "assistant", "content": "sub"}])
    sub.metadata["chain_cause"] = "subagent"
    return SessionResult(session_id="s-1", task_id="t-1", status=SessionStatus.COMPLETED,
                         trajectory=Trajectory(session_id="s-1", traces=[main, sub], builder="prefix_merging"),
                         evaluation=EvalResult(reward=1.0, passed=True))


def nemo_rl_contiguity(output: list[dict[str, Any]]) -> None:
    """NeMo RL's check, re-implemented from its documented rule (nemo_rl/environments/nemo_gym.py,
    ``_postprocess_nemo_gym_to_nemo_rl_result``): it walks ``response.output``, skips items without (or with empty)
    ``generation_token_ids``, keeps ``seen_token_ids`` = the running concatenation of (new prompt part +
    generation), and for each trained item asserts

        seen_token_ids == output_item_dict["prompt_token_ids"][: len(seen_token_ids)]

    ("Non-contiguous messages found!"); the user turn is ``prompt_token_ids[len(seen):]``, the assistant turn is
    ``generation_token_ids`` with ``generation_log_probs``. With no trained item it raises "NeMo Gym returned a
    result with no generation data"."""
    seen: list[int] = []
    trained = 0
    for item in output:
        if not item.get("generation_token_ids"):
            continue
        trained += 1
        prompt = item["prompt_token_ids"]
        assert seen == prompt[:len(seen)], f"Non-contiguous messages found! seen {len(seen)} tokens"
        assert len(item["generation_log_probs"]) == len(item["generation_token_ids"])
        seen = seen + prompt[len(seen):] + item["generation_token_ids"]
    assert trained, "NeMo Gym returned a result with no generation data"


def gym_venv_or_skip() -> Path:
    """The prebuilt NeMo Gym 0.7.0 venv; missing: fail under CI=true (with the hint), else skip."""
    from polar_gym.assets import nemo_gym_venv

    venv = Path(nemo_gym_venv())
    if not (venv / "bin" / "gym").exists():
        hint = f"no NeMo Gym venv at {venv}: build it with `.venv/bin/python -m polar_gym.assets nemo_gym`"
        if os.environ.get("CI") == "true":
            pytest.fail(hint)
        pytest.skip(hint)
    return venv
