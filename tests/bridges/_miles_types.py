"""A stand-in for Miles's ``Sample`` and data source (Miles is not on PyPI and needs GPUs; no git install here).

Field list, ``Status`` values and the checks of ``validate`` / ``oldest_weight_version`` / ``get_reward_value`` were
read from radixark/miles ``miles/utils/types.py`` at commit 002ce70c0f33c97255bec842e8b95d1dfb31d3f3 (written here
in our own words; the tensors, multimodal and speculative-decoding fields are left out: the bridge never touches
them). ``reset_for_retry`` exists in later Miles (it keeps the prompt, index, group_index, label and metadata).
The data source follows ``miles/rollout/data_source.py``'s ``get_samples(n) -> list[list[Sample]]`` and
``add_samples(groups)`` as ``miles/rollout/fully_async_rollout.py`` (commit 01e5e579596f) recycles a group with.
``default_rewards`` is Miles's own GRPO normalization (``miles/ray/rollout/train_data_conversion.py``,
``_post_process_rewards``): centred per ``n_samples_per_prompt`` consecutive samples when the batch is whole.
"""

from __future__ import annotations

import enum
import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    def get_reward_value(self, args: Any) -> float:
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key else self.reward  # type: ignore[index,return-value]

    @property
    def oldest_weight_version(self) -> int | None:
        numeric = [int(v) for v in self.weight_versions if str(v).isdigit()]
        return min(numeric) if numeric else None

    def validate(self) -> None:
        assert self.response_length >= 0
        assert len(self.tokens) >= self.response_length
        if self.loss_mask is not None:
            assert len(self.loss_mask) == self.response_length
        if self.rollout_log_probs is not None:
            assert len(self.rollout_log_probs) == self.response_length

    def reset_for_retry(self) -> None:
        keep = {k: getattr(self, k) for k in ("group_index", "index", "prompt", "label", "metadata",
                                              "generate_function_path")}
        self.__init__(**keep)  # type: ignore[misc]


class DataSource:
    """Prompt groups first from the recycled buffer, then from the dataset, as Miles's buffered data source."""

    def __init__(self, groups: list[list[Sample]]) -> None:
        self.groups: list[list[Sample]] = list(groups)
        self.buffer: list[list[Sample]] = []

    def get_samples(self, count: int) -> list[list[Sample]]:
        taken, self.buffer = self.buffer[:count], self.buffer[count:]
        more, self.groups = self.groups[:count - len(taken)], self.groups[count - len(taken):]
        return taken + more

    def add_samples(self, groups: list[list[Sample]]) -> None:
        self.buffer.extend(groups)


def default_rewards(args: Any, samples: list[Sample]) -> list[float]:
    """Miles's GRPO normalization without a custom post-process hook."""
    raw = [s.get_reward_value(args) for s in samples]
    n = args.n_samples_per_prompt
    assert len(raw) == n * args.rollout_batch_size, "Miles then centres the whole batch as one group"
    out: list[float] = []
    for i in range(0, len(raw), n):
        group = raw[i:i + n]
        centred = [r - statistics.fmean(group) for r in group]
        if getattr(args, "grpo_std_normalization", False):
            centred = [c / (statistics.stdev(group) + 1e-6) for c in centred]
        out += centred
    return out
