"""The rollout correction the reference trainer applies (``trainer.rollout_correction``, ``correction_threshold``):
re-exported from :mod:`polar_gym.audit.correction`, where it lives below both the trainer and the bridges so any
trainer imports the same functions (``from polar_gym.bridges.correction import rollout_correction``)."""

from polar_gym.audit.correction import (
    CorrectionMode,
    RolloutCorrection,
    correction_stats,
    rollout_correction,
    sequence_log_ratios,
)

__all__ = ["CorrectionMode", "RolloutCorrection", "correction_stats", "rollout_correction", "sequence_log_ratios"]
