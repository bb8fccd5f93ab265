"""The reference trainer (SFT and GRPO, torch) for validation and small experiments: see :mod:`.loops`.

Pure core: :mod:`.batch`, :mod:`.logprobs`, :mod:`.losses`, :mod:`.stats`; the policy and its update:
:mod:`.policy`; data: :mod:`.sft_data`; noise-free
evaluation: :mod:`.reference_eval`; files: :mod:`.checkpoint`, :mod:`.metrics`. Names load on first use, so
``launch`` can validate the ``trainer`` settings without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from polar_gym.trainer.settings import TrainerSettings

if TYPE_CHECKING:
    from polar_gym.trainer.batch import TrainBatch, TrainSequence, collate, sequence_of_trace
    from polar_gym.trainer.checkpoint import load_policy, save_checkpoint
    from polar_gym.trainer.logprobs import full_logprobs, trained_logprobs
    from polar_gym.trainer.loops import RolloutSource, WeightSync, grpo_sequences, run_grpo, run_sft
    from polar_gym.trainer.losses import group_advantages, logprob_diff_stats, policy_loss, sft_loss
    from polar_gym.trainer.metrics import MetricsLog, svg_plot
    from polar_gym.trainer.policy import StepReport, Trainer
    from polar_gym.trainer.reference_eval import (
        ReferenceAnswer,
        answer_logprobs,
        load_reference_answers,
        reference_metrics,
    )
    from polar_gym.trainer.sft_data import SkippedRecord, load_sft_file, sequence_of_record
    from polar_gym.trainer.stats import binomial_band, bootstrap_diff, mean_band, mean_se

__all__ = ["MetricsLog", "ReferenceAnswer", "RolloutSource", "SkippedRecord", "StepReport", "TrainBatch",
           "TrainSequence", "Trainer", "TrainerSettings", "WeightSync", "answer_logprobs", "binomial_band",
           "bootstrap_diff", "collate", "full_logprobs", "group_advantages", "grpo_sequences", "load_policy",
           "load_reference_answers", "load_sft_file", "logprob_diff_stats", "mean_band", "mean_se", "policy_loss",
           "reference_metrics", "run_grpo", "run_sft", "save_checkpoint", "sequence_of_record", "sequence_of_trace",
           "sft_loss", "svg_plot", "trained_logprobs"]

_HOME = {"batch": ("TrainBatch", "TrainSequence", "collate", "sequence_of_trace"),
         "checkpoint": ("load_policy", "save_checkpoint"),
         "logprobs": ("full_logprobs", "trained_logprobs"),
         "loops": ("RolloutSource", "WeightSync", "grpo_sequences", "run_grpo", "run_sft"),
         "policy": ("StepReport", "Trainer"),
         "losses": ("group_advantages", "logprob_diff_stats", "policy_loss", "sft_loss"),
         "metrics": ("MetricsLog", "svg_plot"),
         "reference_eval": ("ReferenceAnswer", "answer_logprobs", "load_reference_answers", "reference_metrics"),
         "sft_data": ("SkippedRecord", "load_sft_file", "sequence_of_record"),
         "stats": ("binomial_band", "bootstrap_diff", "mean_band", "mean_se")}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'polar_gym.trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"polar_gym.trainer.{module}"), name)
