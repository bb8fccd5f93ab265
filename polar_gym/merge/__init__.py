"""Trajectory builders: pure functions CompletionSession -> Trajectory, chosen by name from one registry."""

from __future__ import annotations

from polar_gym.merge.atif import atif_json, atif_trajectory
from polar_gym.merge.base import QWEN_END_OF_TURN_IDS, Builder, MergeConfig
from polar_gym.merge.exports import (
    ContiguityError,
    NemoOutputItem,
    SFTRecord,
    SlimeSample,
    TraceLine,
    check_contiguity,
    nemo_item_chains,
    nemo_items,
    sft_records,
    slime_samples,
    trace_lines,
)
from polar_gym.merge.rewards import RewardError, apply_rewards, session_weights, token_rewards, with_session_weights
from polar_gym.merge.tool_calls import MALFORMED_POLICIES, MalformedToolCallPolicy, apply_tool_call_policy
from polar_gym.registry import BUILDERS
from polar_gym.schema import BuilderSpec, CompletionSession, Trajectory

__all__ = [
    "MALFORMED_POLICIES",
    "QWEN_END_OF_TURN_IDS",
    "ContiguityError",
    "MalformedToolCallPolicy",
    "MergeConfig",
    "NemoOutputItem",
    "RewardError",
    "SFTRecord",
    "SlimeSample",
    "TraceLine",
    "apply_rewards",
    "apply_tool_call_policy",
    "atif_json",
    "atif_trajectory",
    "build_trajectory",
    "check_contiguity",
    "nemo_item_chains",
    "nemo_items",
    "session_weights",
    "sft_records",
    "slime_samples",
    "token_rewards",
    "trace_lines",
    "with_session_weights",
]


def build_trajectory(session: CompletionSession, spec: BuilderSpec | str = "prefix_merging") -> Trajectory:
    """Build ``session`` with the builder ``spec`` names (``spec.config`` holds MergeConfig fields)."""
    spec = BuilderSpec(strategy=spec) if isinstance(spec, str) else spec
    builder: Builder = BUILDERS.get(spec.strategy)
    config = MergeConfig.from_dict(spec.config)
    return apply_tool_call_policy(builder(session, config), config.malformed_tool_calls)
