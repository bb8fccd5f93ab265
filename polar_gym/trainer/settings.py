"""The ``trainer`` group's settings (``conf/trainer/{sft,grpo}.yaml``), validated like every other group."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Aggregation", "TrainerSettings"]

#: how the GRPO loss averages its per-token terms (verl's ``loss_agg_mode`` names with underscores); defined in
#: :mod:`polar_gym.trainer.losses`, here so settings validate without importing torch
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


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
    tis_cap: float | None = Field(default=None, gt=0, description="grpo: truncated importance correction with "
                                  "this cap C (null: off; ratio then taken against the captured logprobs)")
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
    max_mismatch: float | None = Field(default=0.5, gt=0, description="grpo: a step whose mean |trainer - engine| "
                                       "logprob (audit/logprob_abs_diff_mean, nats) is above this is not trained "
                                       "(the engine does not run the trained weights; fp32 vLLM measures ~2e-5); "
                                       "null: no bound")
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

