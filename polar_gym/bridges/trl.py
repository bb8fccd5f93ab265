"""TRL bridge: polar_gym's sessions as the rollouts of TRL's ``GRPOTrainer`` (its ``rollout_func``), so a TRL user
trains any harness polar_gym runs, on prefix-merged traces, without TRL generating anything itself.

    from trl import GRPOConfig, GRPOTrainer
    from polar_gym.bridges.trl import PolarRollout, TRLBridgeSettings, polar_reward

    rollout = PolarRollout(tasks, TRLBridgeSettings.from_env())  # POLAR_SERVER_URL, POLAR_ADMIN_TOKEN
    trainer = GRPOTrainer(model=MODEL, reward_funcs=polar_reward, args=GRPOConfig(...),
                          train_dataset=rollout.dataset(), rollout_func=rollout)
    trainer.train()

TRL's sampler repeats each prompt ``num_generations`` times in a row; each run of equal prompts becomes one task
(``num_samples`` = the run's length) on the rollout server, and each session comes back as one row, in order:

- ``prompt_ids`` / ``completion_ids``: the session's prefix-merged trace, split where the first sampled turn
  starts (the captured token ids, never re-encoded);
- ``env_mask`` (TRL's tool mask): 1 on sampled tokens, 0 on tokens the harness or the environment wrote;
- ``logprobs``: the engine's logprob of each completion token (0.0 on environment tokens). TRL uses them for its
  importance correction (``vllm_importance_sampling_correction``) when it runs with ``use_vllm``; without it
  they are carried along (``sampling_per_token_logps``) and not used by the loss;
- ``polar_reward`` (for :func:`polar_reward`): the evaluator's reward, None for a session that did not complete
  (TRL gives a row with no reward no advantage) whose row has no trained token either.

A session with several chains (sub-agents, compaction) gives its main chain (the one with the most sampled tokens;
``extra_chains="fail"`` refuses such sessions). Before each batch after an optimizer step the trainer's weights go
to the fleet (``trainer.save_model`` to ``OUTPUT_DIR/polar_weights/step-N``, then the rollout server's weight-update
call with policy version N), so the engine samples with the weights TRL trains; ``weight_sync="none"`` leaves that
to the user (TRL's own vLLM sync, or a frozen policy). Every batch's traces are appended to
``OUTPUT_DIR/trajectories.jsonl`` (``python -m polar_gym.audit`` reads it; with several training processes each
writes ``trajectories.rankN.jsonl``), before anything can refuse the batch. TRL's temperature, top_p and top_k are
forced on every model call of the sessions (``sampling="trainer"``), unless the task sets its own
``metadata.sampling``.
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from polar_gym.bridges.common import BridgeSettings, run_sync, trainer_sampling
from polar_gym.merge.exports import main_chain, slime_samples, trajectory_records
from polar_gym.schema import SessionResult, SessionStatus, TaskRequest
from polar_gym.server.client import RolloutClient

__all__ = ["PolarRollout", "TRLBridgeSettings", "TRLRow", "polar_reward", "prompt_runs", "rollout_output",
           "session_row"]

log = logging.getLogger(__name__)


class TRLBridgeSettings(BridgeSettings):
    """Where the rollout server is, and how TRL's batches become tasks and its weights reach the engines."""

    bridge_name: ClassVar[str] = "the TRL bridge"

    #: "checkpoint": the trainer's weights go to the fleet before each batch that follows an optimizer step (and
    #: before the first); "none": the engines keep whatever weights they serve
    weight_sync: Literal["checkpoint", "none"] = "checkpoint"
    #: how many pushed checkpoints stay under OUTPUT_DIR/polar_weights (None: all, which the audit of every step needs)
    keep_checkpoints: int | None = Field(default=2, ge=1)
    #: "trainer": TRL's temperature / top_p / top_k replace the harness's on every model call; "harness": the
    #: harness's own values (a task's metadata.sampling always wins)
    sampling: Literal["trainer", "harness"] = "trainer"
    #: where trajectories.jsonl and polar_weights/ go (None: the trainer's args.output_dir)
    output_dir: str | None = None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> TRLBridgeSettings:
        return cls(**{**cls.server_env(environ), **overrides})


class TRLRow(BaseModel):
    """One session as one row of TRL's rollout output (token ids only: TRL never re-encodes them)."""

    model_config = ConfigDict(extra="forbid")

    prompt_ids: list[int]
    completion_ids: list[int] = Field(min_length=1)
    env_mask: list[int]
    logprobs: list[float]
    reward: float | None
    session_id: str
    status: str
    #: the policy version of each sampled turn, in order (the fleet's stamps; empty when none was set)
    policy_versions: list[str] = Field(default_factory=list)
    extra_chains: int = 0
    #: the images in the row's prompt (data URLs, in the order of their placeholders; the reward functions get
    #: them as ``polar_images``). Such a row is not trained: TRL's ``rollout_func`` has no way to hand a rollout's
    #: images to the loss's forward pass, which would see the placeholders without their pixels
    images: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _aligned(self) -> TRLRow:
        if not len(self.env_mask) == len(self.logprobs) == len(self.completion_ids):
            raise ValueError("env_mask and logprobs must have one entry per completion token")
        return self


def prompt_runs(prompts: Sequence[Any]) -> list[tuple[Any, int]]:
    """Runs of equal consecutive prompts (TRL's sampler repeats each prompt ``num_generations`` times in a row):
    ``(prompt, count)`` in order."""
    runs: list[tuple[Any, int]] = []
    for prompt in prompts:
        if runs and runs[-1][0] == prompt:
            runs[-1] = (prompt, runs[-1][1] + 1)
        else:
            runs.append((prompt, 1))
    return runs


def session_row(result: SessionResult, end_id: int, extra_chains: Literal["main", "fail"] = "main") -> TRLRow:
    """A session's main chain as a TRL row. A session that did not complete, or whose prompt holds images, keeps
    its tokens with an all-zero mask and no reward; one with no model call at all gives ``[end_id]`` for prompt and
    completion (TRL needs a row)."""
    chains = slime_samples(result)
    if len(chains) > 1 and extra_chains == "fail":
        raise ValueError(f"session {result.session_id} has {len(chains)} chains (extra_chains='fail')")
    completed = result.status is SessionStatus.COMPLETED
    status = SessionStatus(result.status).value
    if not chains:
        return TRLRow(prompt_ids=[end_id], completion_ids=[end_id], env_mask=[0], logprobs=[0.0], reward=None,
                      session_id=result.session_id, status=status)
    main = main_chain(chains)
    cut = main.metadata["prompt_length"]
    images = list((main.multimodal_inputs or {}).get("images") or [])
    reward = None if not completed or main.metadata["reward_missing"] or images else float(main.reward)
    mask = [0] * len(main.loss_mask) if images else list(main.loss_mask)
    return TRLRow(prompt_ids=main.tokens[:cut], completion_ids=main.tokens[cut:], env_mask=mask,
                  logprobs=list(main.rollout_log_probs), reward=reward, session_id=result.session_id, status=status,
                  policy_versions=list(main.weight_versions), extra_chains=len(chains) - 1, images=images)


def rollout_output(rows: Sequence[TRLRow]) -> dict[str, list[Any]]:
    """TRL's ``rollout_func`` answer: its three required keys, ``env_mask`` (its tool mask) and the fields the reward
    functions receive as keyword arguments (``polar_reward``, ``polar_session_id``, ``polar_status``,
    ``polar_images``)."""
    return {"prompt_ids": [r.prompt_ids for r in rows], "completion_ids": [r.completion_ids for r in rows],
            "logprobs": [r.logprobs for r in rows], "env_mask": [r.env_mask for r in rows],
            "polar_reward": [r.reward for r in rows], "polar_session_id": [r.session_id for r in rows],
            "polar_status": [r.status for r in rows], "polar_images": [r.images for r in rows]}


def polar_reward(completions: Sequence[Any], polar_reward: Sequence[float | None] | None = None,
                 **_: Any) -> list[float | None]:
    """TRL reward function: the evaluator's reward of each session (None: the session did not complete)."""
    if polar_reward is None:
        raise ValueError("polar_reward needs PolarRollout as the trainer's rollout_func (no polar_reward field came)")
    if len(polar_reward) != len(completions):
        raise ValueError(f"{len(polar_reward)} rewards for {len(completions)} completions")
    return list(polar_reward)


class PolarRollout:
    """TRL's ``rollout_func``: each batch of prompts runs as tasks on the Polar rollout server (module docstring).
    ``tasks``: the tasks the dataset's prompts name, each by its instruction (:meth:`dataset`)."""

    def __init__(self, tasks: Sequence[TaskRequest], settings: TRLBridgeSettings) -> None:
        self.settings = settings
        self.tasks: dict[str, TaskRequest] = {}
        for task in tasks:
            other = self.tasks.setdefault(task.instruction, task)
            if other is not task:
                raise ValueError(f"tasks {other.task_id!r} and {task.task_id!r} have the same instruction: TRL's "
                                 "prompt names a task by its instruction, so each needs its own")
        self._synced_step: int | None = None
        self._pushed: list[Path] = []

    def dataset(self) -> Any:
        """The training set TRL samples from: one row per task, ``prompt`` = its instruction."""
        from datasets import Dataset

        return Dataset.from_list([{"prompt": instruction} for instruction in self.tasks])

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        out = self._out(trainer)
        if self.settings.weight_sync == "checkpoint":
            self.sync_weights(trainer)
        step = int(trainer.state.global_step)
        requests = [self._request(prompt, count, step, trainer.args) for prompt, count in prompt_runs(prompts)]
        results = run_sync(lambda: self._run(requests))
        flat = [result for request in requests for result in results[request.task_id]]
        # kept before anything can refuse the batch: what was captured is never lost
        accelerator = trainer.accelerator
        name = "trajectories.jsonl" if accelerator.num_processes == 1 else \
            f"trajectories.rank{accelerator.process_index}.jsonl"
        out.mkdir(parents=True, exist_ok=True)
        with (out / name).open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in trajectory_records(flat, step + 1))
        for request in requests:
            if len(results[request.task_id]) != request.num_samples:
                raise RuntimeError(f"task {request.task_id}: {len(results[request.task_id])} session results for "
                                   f"{request.num_samples} samples")
        end_id = _end_id(trainer)
        rows = [session_row(result, end_id, self.settings.extra_chains) for result in flat]
        failed = [r for r in rows if r.reward is None]
        if failed:
            log.warning("%d of %d sessions gave no reward (not trained): %s", len(failed), len(rows),
                        ", ".join(sorted({"images (TRL cannot take a rollout's pixels)" if r.images else r.status
                                          for r in failed})))
        return rollout_output(rows)

    def _request(self, prompt: Any, count: int, step: int, args: Any) -> TaskRequest:
        task = self.tasks.get(prompt) if isinstance(prompt, str) else None
        if task is None:
            raise ValueError(f"no task has the instruction {str(prompt)[:80]!r}: build the training set with "
                             "PolarRollout.dataset() (prompt = a task's instruction)")
        task_id = f"trl-s{step}-{uuid.uuid4().hex[:10]}"
        metadata = task.metadata.model_copy(update={"group_id": task_id, "rollout_step": step})
        if self.settings.sampling == "trainer" and metadata.sampling is None:
            sampling = trainer_sampling(args.temperature, args.top_p, getattr(args, "top_k", 0))
            metadata = metadata.model_copy(update={"sampling": sampling})
        return task.model_copy(update={"task_id": task_id, "num_samples": count, "metadata": metadata})

    async def _run(self, requests: Sequence[TaskRequest]) -> dict[str, list[SessionResult]]:
        results: dict[str, list[SessionResult]] = {r.task_id: [] for r in requests}
        async with RolloutClient(self.settings.server_url, self.settings.admin_token) as client:
            await client.submit_all(requests)
            async for result in client.results(list(results), timeout=self.settings.timeout_seconds):
                results[result.task_id].append(result)
        for got in results.values():
            got.sort(key=lambda r: int(r.metadata.get("sample_index", 0)))
        return results

    def _out(self, trainer: Any) -> Path:
        return Path(self.settings.output_dir or trainer.args.output_dir)

    def sync_weights(self, trainer: Any) -> Path:
        """Push the trainer's weights to the fleet, as policy version = TRL's global step, unless that step's are
        there already; the checkpoint's folder. Called before each batch; call it once after ``trainer.train()`` to
        leave the engines serving the final weights."""
        step = int(trainer.state.global_step)
        folder = self._out(trainer) / "polar_weights" / f"step-{step}"
        if step == self._synced_step:
            return folder
        staging = folder.with_name(folder.name + ".partial")
        trainer.save_model(str(staging))  # every process takes part (sharded models); the main one writes
        if trainer.accelerator.is_main_process:
            (staging / ".complete").touch()
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
            run_sync(lambda: self._push(str(folder.resolve()), step))
            self._pushed.append(folder)
            keep = self.settings.keep_checkpoints
            while keep is not None and len(self._pushed) > keep:
                shutil.rmtree(self._pushed.pop(0), ignore_errors=True)
        trainer.accelerator.wait_for_everyone()
        self._synced_step = step
        return folder

    async def _push(self, folder: str, step: int) -> None:
        async with RolloutClient(self.settings.server_url, self.settings.admin_token) as client:
            await client.update_weights(folder, step)


def _end_id(trainer: Any) -> int:
    ids = getattr(trainer, "eos_token_ids", None)
    if ids:
        return int(ids[0])
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    return int(tokenizer.eos_token_id)
