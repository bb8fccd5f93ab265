"""The reference trainer (SFT and GRPO, torch) for validation and small experiments; see README's "Reference
trainer" and :mod:`polar_gym.trainer.loops`. Pure core: :mod:`.batch`, :mod:`.logprobs`, :mod:`.losses`."""

from polar_gym.trainer.batch import TrainBatch, TrainSequence, collate, sequence_of_trace
from polar_gym.trainer.checkpoint import load_policy, save_checkpoint
from polar_gym.trainer.logprobs import full_logprobs, trained_logprobs
from polar_gym.trainer.loops import RolloutSource, Trainer, WeightSync, grpo_sequences, run_grpo, run_sft
from polar_gym.trainer.losses import group_advantages, logprob_diff_stats, policy_loss, sft_loss
from polar_gym.trainer.metrics import MetricsLog, svg_plot
from polar_gym.trainer.settings import TrainerSettings
from polar_gym.trainer.sft_data import SkippedRecord, load_sft_file, sequence_of_record

__all__ = ["MetricsLog", "RolloutSource", "SkippedRecord", "TrainBatch", "TrainSequence", "Trainer",
           "TrainerSettings", "WeightSync", "collate", "full_logprobs", "group_advantages", "grpo_sequences",
           "load_policy", "load_sft_file", "logprob_diff_stats", "policy_loss", "run_grpo", "run_sft",
           "save_checkpoint", "sequence_of_record", "sequence_of_trace", "sft_loss", "svg_plot", "trained_logprobs"]
