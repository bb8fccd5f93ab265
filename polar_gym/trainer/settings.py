"""The ``trainer`` group's settings (``conf/trainer/{sft,grpo}.yaml``), validated like every other group."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from polar_gym.trainer.worker import CPU_LIST_PATTERN, parse_cpu_list

__all__ = ["RETIRED_KEYS", "Aggregation", "CorrectionMode", "Dtype", "MismatchMetric", "TrainerSettings"]

#: how the GRPO loss averages its per-token terms (verl's ``loss_agg_mode`` names with underscores); defined in
#: :mod:`polar_gym.trainer.losses`, here so settings validate without importing torch
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
#: the rollout correction's menu (:mod:`polar_gym.audit.correction`, the same Literal; here without torch)
CorrectionMode = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
#: a weights / compute dtype of the trainer or of the engine it serves
Dtype = Literal["float32", "bfloat16", "float16"]
#: the mismatch metrics the guard can bound (each larger when trainer and engine disagree more; verl's names, as
#: :meth:`polar_gym.audit.metrics.MismatchMetrics.as_dict` logs them)
MismatchMetric = Literal["audit/logprob_abs_diff_mean", "audit/logprob_abs_diff_max", "rollout_corr/k3_kl",
                         "rollout_corr/chi2_token", "rollout_corr/chi2_seq", "rollout_corr/log_ppl_abs_diff",
                         "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max"]

#: keys a config may still name from an older release, and what replaced them (the error says so)
RETIRED_KEYS = {
    "tis_cap": "trainer.tis_cap was replaced by trainer.rollout_correction and trainer.correction_threshold: "
               "tis_cap=C is rollout_correction=token_truncate correction_threshold=C (tis_cap=null: "
               "rollout_correction=none)",
}


#: trainer.max_mismatch's default on audit/logprob_abs_diff_mean (nats), see docs/trainer/correction.md
MAX_MISMATCH_DEFAULT = 2e-4


class TrainerSettings(BaseModel):
    """What ``+trainer=sft`` / ``+trainer=grpo`` configure. Checkpoints, ``train_metrics.jsonl`` and the plot go
    under the run's ``out_dir/trainer/``."""

    model_config = ConfigDict(extra="forbid")

    algorithm: Literal["sft", "grpo"] = Field(default="sft", description="sft: datagen exports; grpo: traces from "
                                              "the fleet")
    model: str | None = Field(default=None, description="the starting HF model directory (null: the tiny Qwen3 "
                              "from setup.sh --engine)")
    steps: int = Field(default=10, ge=1, description="optimizer steps")
    optimizer: Literal["adamw", "sgd"] = Field(default="adamw", description="adamw, or sgd (plain gradient descent: "
                                               "a step proportional to the gradient; AdamW's per-parameter "
                                               "normalisation moves every weight by about the learning rate "
                                               "whatever the gradient's size, a noise-only gradient included)")
    learning_rate: float = Field(default=1e-4, gt=0, description="the optimizer's learning rate (sgd needs a far "
                                 "larger one than adamw: ~1 where adamw takes ~1e-4)")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(default=1.0, gt=0, description="gradient clipping by global norm")
    seed: int = Field(default=0, description="seed of the data order and of torch")
    threads: int | None = Field(default=None, ge=1, description="torch CPU threads (null: torch's default)")
    cpus: str | None = Field(default=None, pattern=CPU_LIST_PATTERN, description="the CPUs the trainer's torch work "
                             "runs on, as taskset takes them (1, 0-3, 0,2-3): on a CPU-only machine, keeps the "
                             "sessions and the fleet of an asynchronous run off the trainer's cores (only the "
                             "trainer's thread is pinned; give threads <= the CPUs named); null: wherever the OS "
                             "runs it")
    save_every: int = Field(default=0, ge=0, description="also keep a checkpoint every N steps (0: only the last "
                            "and, for grpo, the one each update pushes)")
    # sft
    data: list[str] = Field(default_factory=list, description="sft: JSONL files (datagen's sft/train.jsonl, or "
                            "token-id lines such as a launch's trajectories.jsonl)")
    batch_size: int = Field(default=4, ge=1, description="sft: sequences per step")
    min_reward: float | None = Field(default=None, description="sft: keep only records with reward >= this")
    # grpo
    clip_low: float = Field(default=0.2, ge=0, description="grpo: the ratio's lower clip, 1 - clip_low")
    clip_high: float = Field(default=0.28, ge=0, description="grpo: the ratio's upper clip, 1 + clip_high (DAPO)")
    rollout_correction: CorrectionMode = Field(
        default="none", description="grpo: importance weights of the trainer's logprobs against the engine's "
        "(polar_gym.audit.correction): none (the ratio taken against the captured logprobs), token_truncate "
        "(min(rho, threshold): TIS), token_mask (a token with rho > threshold is not trained), sequence_truncate / "
        "sequence_mask (the same on each sequence's geometric-mean ratio)")
    correction_threshold: float = Field(default=2.0, gt=0, description="grpo: rollout_correction's threshold C on "
                                        "the importance ratio (2.0 as ms-swift and verl use)")
    push_weights: bool = Field(default=True, description="grpo: after each step, update every engine of the "
                               "fleet to the new checkpoint and policy version")
    initial_version: int = Field(default=0, ge=0, description="grpo: the policy version of the starting weights")
    completed_only: bool = Field(default=True, description="grpo: train only on traces of COMPLETED sessions")
    loss_aggregation: Aggregation = Field(default="token_mean", description="grpo: token_mean (over all trained "
                                          "tokens), seq_mean_token_mean (per sequence, then over sequences) or "
                                          "seq_mean_token_sum_norm (Dr.GRPO: token sums over loss_norm_tokens); "
                                          "each weighted by the trace's session weight")
    loss_norm_tokens: int = Field(default=4096, ge=1, description="grpo: seq_mean_token_sum_norm's constant "
                                  "divisor (Dr.GRPO: the generation budget in tokens)")
    shuffle_rewards: bool = Field(default=False, description="grpo: the control: rewards permuted within each step "
                                  "before advantages are computed, so the step trains on noise with the same reward "
                                  "distribution; a learning curve that also rises under it is not learning from the "
                                  "reward")
    mismatch_metric: MismatchMetric = Field(
        default="audit/logprob_abs_diff_mean", description="grpo: the guard's metric, taken for each token against "
        "the weights of the policy version that sampled it (so an asynchronous step's policy drift does not count)")
    max_mismatch: float | None = Field(default=MAX_MISMATCH_DEFAULT, gt=0, description="grpo: a step whose "
                                       "mismatch_metric is above this is not trained (the engine does not run the "
                                       "weights being trained: another model, another dtype, a reload that did not "
                                       "happen); the default (on audit/logprob_abs_diff_mean, nats) passes fp32 vLLM "
                                       "(~2e-5 and less) and an fp16 one (~1.3e-4), and refuses a bf16 engine "
                                       "against an fp32 trainer (~1e-3): docs/trainer/correction.md; null: no bound")
    dtype: Dtype = Field(default="float32", description="grpo/sft: the trainer's weights and compute dtype")
    lm_head_fp32: bool = Field(default=False, description="the output layer computes in fp32 whatever dtype (hidden "
                               "states and head weights upcast)")
    engine_dtype: Dtype = Field(default="float32", description="grpo: the dtype of the policy server a launch "
                                "serves itself (inference=oracle; python -m polar_gym.trainer serve --dtype)")
    reference_answers: list[str] = Field(default_factory=list, description="grpo: the noise-free evaluation: JSONL "
                                         "files of reference answers (datagen's sft/train.jsonl of a forked task: "
                                         "right and wrong variants with their rewards); before the first step and "
                                         "after every step the exact log-probability of each is computed under the "
                                         "current weights (eval/p_right, eval/p_wrong, eval/share_right)")
    greedy_samples: int = Field(default=0, ge=0, description="grpo: per task and step, this many extra sessions "
                                "sampled greedily (temperature 0 forced by the proxy) by the policy that samples "
                                "the step, not trained on: eval/greedy_success")
    kl_coef: float = Field(default=0.0, ge=0, description="grpo: beta of a KL penalty to the reference policy (the "
                           "starting weights), k3 per sampled token, aggregated like the loss (DeepSeekMath's GRPO; "
                           "0: off, as DAPO and Dr.GRPO run)")
    # asynchronous GRPO (polar_gym.trainer.pipeline)
    max_staleness: int = Field(default=0, ge=0, description="grpo: 0: synchronous (sample a step, train, push, "
                               "repeat); k >= 1: asynchronous: sessions of the next k steps are sampled while the "
                               "trainer trains, groups are trained as they complete, and a group whose oldest "
                               "trained token was sampled more than k versions before the trainer's is stale")
    stale_groups: Literal["drop", "correct"] = Field(default="drop", description="grpo: a stale group (older than "
                                                     "max_staleness): drop (not trained; its tokens are counted as "
                                                     "masked for staleness) or correct (trained, with the rollout "
                                                     "correction's importance weights)")
    mixed_version_tokens: Literal["correct", "mask"] = Field(
        default="correct", description="grpo: in a trace sampled by several policy versions (a generation cut by a "
        "weight update and continued under the new weights, a session that spanned updates), the tokens of its older "
        "versions: trained with the rollout correction like every token (correct), or not trained (mask)")

    @field_validator("cpus")
    @classmethod
    def _cpu_list(cls, cpus: str | None) -> str | None:
        """A range that runs backwards (``3-1``) passes the pattern; the parser names it."""
        if cpus is not None:
            parse_cpu_list(cpus)
        return cpus

    @model_validator(mode="before")
    @classmethod
    def _retired(cls, data: Any) -> Any:
        """A retired key is named with what replaced it, not refused as an unknown key."""
        if isinstance(data, dict):
            for key, why in RETIRED_KEYS.items():
                if key in data:
                    raise ValueError(why)
        return data
