"""Log-probabilities of the trained tokens, computing the output layer only where a token is trained.

The tiny Qwen3's vocabulary has 151,936 entries, so a full ``[B, T, V]`` logits tensor dominates a step (issue 14
measured ~35 s for one fp32 forward+backward of 8 x 512 tokens on 2 cores). The decoder stack runs over every
token (attention needs them), but ``lm_head`` and the log-softmax run only on the hidden states that predict a
trained token: hidden states -> gather ``positions - 1`` -> ``lm_head`` -> log-softmax -> gather targets. This is
what verl / slime get from their fused "logprobs of response tokens only" kernels, done with plain indexing.
"""

from __future__ import annotations

from typing import Any

import torch

from polar_gym.audit.recompute import head_logprobs
from polar_gym.trainer.batch import TrainBatch

__all__ = ["full_logprobs", "trained_logprobs"]


#: hidden states per output-layer call: bounds the [rows, vocabulary] logits a step holds at once
HEAD_ROWS = 1024


def trained_logprobs(model: Any, batch: TrainBatch, *, fp32_head: bool = False) -> torch.Tensor:
    """``[N]`` log p(target | prefix) for the batch's trained tokens, with gradients; the output layer runs on
    ``N`` hidden states instead of ``B x T``, through the audit's :func:`~polar_gym.audit.recompute.head_logprobs`
    (one definition of a token's logprob for the trainer and the audit); ``fp32_head``: that layer in fp32
    (``trainer.lm_head_fp32``)."""
    if not (hasattr(model, "get_decoder") and hasattr(model, "get_output_embeddings")):
        raise TypeError(f"{type(model).__name__} is not a transformers causal LM (no decoder and output layer)")
    hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    picked = hidden[batch.rows, batch.positions - 1]  # [N, H]: the state that predicts each trained token
    logprobs: torch.Tensor = head_logprobs(model, picked, batch.targets, HEAD_ROWS, fp32_head=fp32_head)
    return logprobs


def full_logprobs(model: Any, batch: TrainBatch) -> torch.Tensor:
    """The same values from a full forward (every position's logits): the reference :func:`trained_logprobs` is
    tested against, and a check when porting to another model class."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    logp = torch.log_softmax(logits[batch.rows, batch.positions - 1], dim=-1)
    return logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
