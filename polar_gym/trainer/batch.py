"""Sequences to padded tensors, keeping only what the loss needs: the (row, position) of every trained token.

A :class:`TrainSequence` is one trace seen by a trainer: ``prompt_ids + response_ids`` is what the model reads,
``loss_mask`` (over the response) says which response tokens the model sampled and is trained on, ``old_logprobs``
are the engine's captured logprobs of those tokens (the behaviour policy), ``advantage`` is the sequence's scalar
advantage (GRPO) or 0 (SFT), ``weight`` its say in the loss (the builder's session weight, so a session split into
k traces counts once: :mod:`polar_gym.merge.rewards`). :func:`collate` right-pads the token rows and lists the
trained positions with their row (the sequence index) and weight, so the output layer can be computed at those
positions only (:mod:`polar_gym.trainer.logprobs`) and a loss can aggregate per sequence
(:mod:`polar_gym.trainer.losses`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["TrainBatch", "TrainSequence", "collate", "sequence_of_trace", "trace_weight"]


@dataclass(frozen=True)
class TrainSequence:
    """One training sequence (token ids only: trainers never re-encode text)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float] = field(default_factory=list)
    advantage: float = 0.0
    reward: float = 0.0
    group: str = ""
    #: the sequence's weight in the loss (>= 0; 0 removes it): the builder's ``metadata["weight"]``
    weight: float = 1.0
    #: the reward before ``shuffle_rewards`` permuted it (``reward`` is what the advantage was computed from);
    #: None when nothing set it (``reward`` is then the real one)
    true_reward: float | None = None
    #: the policy version that sampled each response token (None: unknown); empty: every token unknown. The
    #: trainer's mismatch guard scores each token with that version's weights (:meth:`Trainer.keep_version`)
    versions: list[int | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise ValueError(f"a sequence's weight must be finite and >= 0, not {self.weight!r}")
        if len(self.loss_mask) != len(self.response_ids):
            raise ValueError("loss_mask must align with response_ids")
        if self.old_logprobs and len(self.old_logprobs) != len(self.response_ids):
            raise ValueError("old_logprobs must align with response_ids")
        if self.versions and len(self.versions) != len(self.response_ids):
            raise ValueError("versions must align with response_ids (one policy version, or None, per token)")
        if not self.prompt_ids and any(self.loss_mask[:1]):
            raise ValueError("the first response token needs a prompt token before it to be predicted")


@dataclass(frozen=True)
class TrainBatch:
    """Padded rows and the flat list of trained tokens.

    ``input_ids``/``attention_mask`` are ``[B, T]``; trained token ``k`` is ``input_ids[rows[k], positions[k]]``,
    predicted from the hidden state at ``positions[k] - 1``; ``targets``, ``old_logprobs``, ``advantages`` and
    ``weights`` (each token's sequence weight) are ``[N]`` over the ``N`` trained tokens, in row then position
    order; ``rows`` doubles as the sequence index (one row per sequence, in the order given to :func:`collate`);
    ``versions`` ``[N]``: the policy version that sampled each trained token, -1 where unknown.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    rows: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    has_old_logprobs: bool
    weights: torch.Tensor
    versions: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))

    @property
    def trained_tokens(self) -> int:
        return int(self.targets.numel())


def collate(sequences: Sequence[TrainSequence], pad_id: int = 0) -> TrainBatch:
    """Right-pad ``sequences`` into one batch; ``old_logprobs`` are zeros (and ``has_old_logprobs`` False) unless
    every sequence carries them."""
    if not sequences:
        raise ValueError("an empty batch")
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    rows: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    old: list[float] = []
    advantages: list[float] = []
    weights: list[float] = []
    versions: list[int] = []
    has_old = all(s.old_logprobs or not any(s.loss_mask) for s in sequences)
    for r, seq in enumerate(sequences):
        tokens = [*seq.prompt_ids, *seq.response_ids]
        ids[r, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        attention[r, :len(tokens)] = 1
        start = len(seq.prompt_ids)
        for j, m in enumerate(seq.loss_mask):
            if m:
                rows.append(r)
                positions.append(start + j)
                targets.append(seq.response_ids[j])
                old.append(seq.old_logprobs[j] if has_old else 0.0)
                advantages.append(seq.advantage)
                weights.append(seq.weight)
                version = seq.versions[j] if seq.versions else None
                versions.append(-1 if version is None else int(version))
    return TrainBatch(input_ids=ids, attention_mask=attention, rows=torch.tensor(rows, dtype=torch.long),
                      positions=torch.tensor(positions, dtype=torch.long),
                      targets=torch.tensor(targets, dtype=torch.long),
                      old_logprobs=torch.tensor(old, dtype=torch.float32),
                      advantages=torch.tensor(advantages, dtype=torch.float32), has_old_logprobs=has_old,
                      weights=torch.tensor(weights, dtype=torch.float32),
                      versions=torch.tensor(versions, dtype=torch.long))


def sequence_of_trace(prompt_ids: Sequence[int], response_ids: Sequence[int], loss_mask: Sequence[int],
                      logprobs: Sequence[float] = (), *, reward: float = 0.0, group: str = "",
                      advantage: float = 0.0, weight: float = 1.0, true_reward: float | None = None,
                      versions: Sequence[int | None] = ()) -> TrainSequence:
    """A TrainSequence from a trace's fields (a :class:`polar_gym.schema.Trace` or a token-id JSONL line);
    ``versions``: the policy version of each response token (None: unknown; empty: all unknown)."""
    return TrainSequence(list(prompt_ids), list(response_ids), [int(bool(m)) for m in loss_mask],
                         [float(x) for x in logprobs], advantage=advantage, reward=reward, group=group,
                         weight=weight, true_reward=true_reward,
                         versions=[None if v is None else int(v) for v in versions])


def trace_weight(metadata: Mapping[str, Any], where: str) -> float:
    """A trace's loss weight from its ``metadata["weight"]`` (the builder's session weight; absent or null: 1.0);
    a negative, non-finite or non-numeric one is refused, naming ``where`` (the session and trace)."""
    raw = metadata.get("weight")
    if raw is None:
        return 1.0
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw) or raw < 0:
        raise ValueError(f"{where}: metadata['weight'] must be a finite number >= 0 (the builder's session weight, "
                         f"polar_gym.merge.rewards), not {raw!r}")
    return float(raw)
