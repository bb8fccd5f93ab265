"""Rollout correction for any trainer: per-token and per-sequence truncated or masked importance weights of the
trainer's logprobs against the engine's captured ones (ms-swift's ``token_truncate`` / ``token_mask`` /
``sequence_truncate`` / ``sequence_mask``, verl's ``rollout_is`` / ``rollout_rs``), with their statistics, and the
mismatch metrics under verl's names. Pure torch over ``[N]`` tensors of trained tokens; a re-export of
:mod:`polar_gym.audit.correction` and :func:`polar_gym.audit.metrics.mismatch_metrics`, the functions the reference
trainer uses::

    from polar_gym.bridges.correction import rollout_correction
    corr = rollout_correction(new_logprobs.detach(), rollout_logprobs, rows, "token_truncate", 2.0)
    loss = -(corr.weights * surrogate)[~corr.masked].mean()
"""

from polar_gym.audit.correction import (
    CorrectionMode,
    RolloutCorrection,
    correction_stats,
    rollout_correction,
    sequence_log_ratios,
)
from polar_gym.audit.metrics import MismatchMetrics, mismatch_metrics

__all__ = ["CorrectionMode", "MismatchMetrics", "RolloutCorrection", "correction_stats", "mismatch_metrics",
           "rollout_correction", "sequence_log_ratios"]
