"""The noise-free evaluation: the exact log-probability of each reference answer under the current weights.

Sampled rewards move by chance (16 sessions give a standard error of ~0.125); the probability the policy gives a
fixed answer does not. Reference answers are datagen SFT records (or token-id lines) of a forked task: the oracle
played a right solution (reward 1) and a wrong one (reward 0), and each record names its oracle variant in
``metadata.oracle_variant``. They are rendered exactly as SFT renders them (:mod:`.sft_data`: the model's chat
template, the tools as the engine hands them to it), so the teacher-forced tokens are the ones a rollout would
sample, and scored on the trained (mask-1) tokens through the trainer's own :func:`.logprobs.trained_logprobs`.

- :func:`load_reference_answers`: the records as :class:`ReferenceAnswer`, one per distinct token sequence.
- :func:`answer_logprobs`: log P(answer) under the model (sum over its trained tokens), without disturbing
  training (no grad, eval mode restored).
- :func:`reference_metrics`: ``eval/logp/<name>``, ``eval/p_right``, ``eval/p_wrong``, ``eval/share_right``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from polar_gym.trainer.batch import TrainSequence, collate
from polar_gym.trainer.logprobs import trained_logprobs
from polar_gym.trainer.sft_data import ChatTokenizer, SkippedRecord, sequence_of_record

__all__ = ["DEFAULT_VARIANT", "ReferenceAnswer", "answer_logprobs", "load_reference_answers", "reference_metrics"]

#: the name of an answer whose record does not say which oracle variant played it
DEFAULT_VARIANT = "reference"


@dataclass(frozen=True)
class ReferenceAnswer:
    """One distinct reference answer: the oracle variant that played it, its reward, its tokens, and the first
    ``path:line`` it was read from."""

    name: str
    reward: float
    sequence: TrainSequence
    source: str


def _variant(record: Mapping[str, Any]) -> str:
    metadata = record.get("metadata")
    name = metadata.get("oracle_variant") if isinstance(metadata, Mapping) else None
    return str(name) if name else DEFAULT_VARIANT


def _answer(record: Mapping[str, Any], tokenizer: ChatTokenizer | None, source: str) -> ReferenceAnswer:
    if record.get("reward") is None:
        raise ValueError(f"reference answer {source} has no reward: the evaluation must know whether it is right")
    try:
        seq = sequence_of_record(record, tokenizer)
    except SkippedRecord as exc:
        raise ValueError(f"reference answer {source} cannot be rendered faithfully: {exc}") from exc
    if not any(seq.loss_mask):
        raise ValueError(f"reference answer {source} has no trained token (an all-zero loss_mask)")
    # only the tokens matter here: captured logprobs and advantages of a token-id line are dropped
    seq = TrainSequence(prompt_ids=seq.prompt_ids, response_ids=seq.response_ids, loss_mask=seq.loss_mask,
                        reward=seq.reward)
    return ReferenceAnswer(name=_variant(record), reward=seq.reward, sequence=seq, source=source)


def _key(seq: TrainSequence) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    return tuple(seq.prompt_ids), tuple(seq.response_ids), tuple(seq.loss_mask)


def load_reference_answers(paths: Iterable[str | Path], tokenizer: ChatTokenizer | None) -> list[ReferenceAnswer]:
    """Every record of the JSONL ``paths`` (datagen's ``sft/*.jsonl`` shape or token-id lines, as
    :func:`.sft_data.load_sft_file` reads them), in file order, one per distinct token sequence: the oracle is
    deterministic, so several demos of one variant are the same tokens and count once (the first record's name and
    source are kept). Raises ValueError for a record that cannot be rendered faithfully or has no reward (a
    reference answer dropped silently would skew P(right)), for two records with the same tokens and different
    rewards, and when there is no answer at all."""
    out: list[ReferenceAnswer] = []
    seen: dict[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ReferenceAnswer] = {}
    read: list[str] = []
    for path in paths:
        read.append(str(path))
        with Path(path).open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                answer = _answer(json.loads(line), tokenizer, f"{path}:{n}")
                key = _key(answer.sequence)
                first = seen.get(key)
                if first is None:
                    seen[key] = answer
                    out.append(answer)
                elif first.reward != answer.reward:
                    raise ValueError(f"reference answers {first.source} and {answer.source} are the same tokens "
                                     f"with different rewards ({first.reward} and {answer.reward}): the evaluator "
                                     "is not deterministic for this task, so it cannot be a reference")
    if not out:
        raise ValueError(f"no reference answer in {read}")
    return out


def answer_logprobs(model: Any, answers: Sequence[ReferenceAnswer], pad_id: int, batch_size: int = 4) -> list[float]:
    """log P(answer) under ``model`` for each answer: the sum of its trained tokens' log-probabilities (float64
    sum of the trainer's fp32 values), computed without gradients in eval mode; the model's mode is restored, so a
    trainer's model stays in train mode and its ``.grad`` buffers are not touched."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 (got {batch_size})")
    out: list[float] = []
    was_training = bool(model.training)
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(answers), batch_size):
                chunk = [a.sequence for a in answers[start:start + batch_size]]
                batch = collate(chunk, pad_id)
                token_lp = trained_logprobs(model, batch).double()
                sums = torch.zeros(len(chunk), dtype=torch.float64).index_add_(0, batch.rows, token_lp)
                out.extend(float(x) for x in sums.tolist())
    finally:
        model.train(was_training)
    return out


def _names(answers: Sequence[ReferenceAnswer]) -> list[str]:
    """Each answer's metric name: its variant, suffixed -1, -2, ... in list order when a variant has several
    distinct answers (e.g. one per trace of a multi-trace session)."""
    counts: dict[str, int] = {}
    for a in answers:
        counts[a.name] = counts.get(a.name, 0) + 1
    seen: dict[str, int] = {}
    names = []
    for a in answers:
        if counts[a.name] == 1:
            names.append(a.name)
            continue
        seen[a.name] = seen.get(a.name, 0) + 1
        names.append(f"{a.name}-{seen[a.name]}")
    return names


def _logsumexp(xs: Sequence[float]) -> float:
    top = max(xs)
    return top + math.log(math.fsum(math.exp(x - top) for x in xs))


def reference_metrics(answers: Sequence[ReferenceAnswer], logprobs: Sequence[float],
                      right_reward: float = 1.0) -> dict[str, float]:
    """The step's noise-free metrics: ``eval/logp/<name>`` for each answer (see :func:`_names`), ``eval/p_right``
    and ``eval/p_wrong`` (the summed probability of the answers with reward >= ``right_reward`` and below it),
    ``eval/logp_right`` (log of p_right, readable when p_right underflows), ``eval/logp_wrong`` when there is a
    wrong answer, and ``eval/share_right`` = p_right / (p_right + p_wrong), computed in log space so two tiny
    probabilities still give a share (1.0 when there is no wrong answer). Every value is finite (JSON-safe).
    Raises ValueError when no answer is right (the share has no meaning) or the lengths or values are bad."""
    if len(answers) != len(logprobs):
        raise ValueError(f"{len(answers)} answers but {len(logprobs)} logprobs")
    values = [float(x) for x in logprobs]
    if not all(math.isfinite(x) for x in values):
        raise ValueError(f"non-finite reference logprob in {values}")
    right = [lp for a, lp in zip(answers, values, strict=True) if a.reward >= right_reward]
    wrong = [lp for a, lp in zip(answers, values, strict=True) if a.reward < right_reward]
    if not right:
        raise ValueError(f"no reference answer has reward >= {right_reward}: P(right) and the share need one "
                         f"(rewards: {sorted({a.reward for a in answers})})")
    metrics = {f"eval/logp/{name}": lp for name, lp in zip(_names(answers), values, strict=True)}
    log_right = _logsumexp(right)
    metrics["eval/logp_right"] = log_right
    metrics["eval/p_right"] = math.exp(log_right)
    if wrong:
        log_wrong = _logsumexp(wrong)
        metrics["eval/logp_wrong"] = log_wrong
        metrics["eval/p_wrong"] = math.exp(log_wrong)
        metrics["eval/share_right"] = math.exp(log_right - _logsumexp([log_right, log_wrong]))
    else:
        metrics["eval/p_wrong"] = 0.0
        metrics["eval/share_right"] = 1.0
    return metrics
