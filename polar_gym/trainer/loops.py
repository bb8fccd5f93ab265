"""The training loops: the thin shell around the pure core (model, data and fleet in; files and metrics out).

``run_sft`` trains on datagen's exports; ``run_grpo`` asks the fleet for rollouts of a set of tasks each step
(``num_samples`` sessions per task form one GRPO group), trains on their traces, writes an HF checkpoint and pushes
it to every engine through a :class:`WeightSync` (the rollout server's weight-update call, ``RolloutClient``), so
the next step's sessions are sampled by the new policy version. Torch work runs on one worker thread
(:mod:`polar_gym.trainer.worker`, on ``trainer.cpus`` when given): a fleet served by the same event loop keeps
answering while a step computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from polar_gym.merge.exports import trajectory_records
from polar_gym.report.training import trained_summary
from polar_gym.schema import SessionResult, SessionStatus, TaskRequest, Trace
from polar_gym.telemetry import MetricSinks
from polar_gym.trainer.batch import TrainSequence, sequence_of_trace, trace_weight
from polar_gym.trainer.losses import (
    group_advantages,
    shuffled_rewards,
)
from polar_gym.trainer.metrics import MetricsLog
from polar_gym.trainer.pipeline import Batch, GroupFeed
from polar_gym.trainer.policy import PAD_ID, Trainer
from polar_gym.trainer.resume import (
    kept_rows,
    random_state,
    resume_point,
    save_state,
    set_random_state,
    update_loop_state,
)
from polar_gym.trainer.settings import TrainerSettings
from polar_gym.trainer.sft_data import load_sft_file
from polar_gym.trainer.staleness import (
    mixed_version_mask,
    numeric_version,
    sample_age,
    staleness_stats,
    trace_versions,
)
from polar_gym.trainer.step_eval import ReferenceScorer, reward_stats
from polar_gym.trainer.verdict import step_verdict
from polar_gym.trainer.worker import TrainerWorker, pinned

__all__ = ["RolloutSource", "RunControl", "WeightSync", "grpo_sequences", "run_grpo", "run_sft"]

T = TypeVar("T")

#: the GRPO plot's panels (those a run has)
GRPO_PLOT_KEYS = ("reward_mean", "eval/share_right", "eval/p_right", "eval/greedy_success", "loss",
                  "audit/logprob_abs_diff_max", "seconds")
#: an asynchronous run's panels besides: how many versions behind the trainer its samples were
STALENESS_PLOT_KEYS = ("staleness/max", "staleness/mean", "rollout_seconds")


@runtime_checkable
class WeightSync(Protocol):
    """Update every engine of the fleet to ``checkpoint`` as ``policy_version`` (``RolloutClient.update_weights``:
    the rollout server's ``POST /backends/weights``); raises when the fleet did not take it."""

    async def update_weights(self, checkpoint: str, policy_version: int | str, /) -> Any: ...


@dataclass
class RunControl:
    """Between a GRPO run and the launch around it (a hand-over to the next Slurm job): ``stop`` asks the run to
    start no further step (the step under way finishes, its groups may still come in); ``abandon`` also leaves a
    step still waiting for its groups to the next job (a step training finishes). ``last_step`` is the last step
    done, ``handed_over`` says the run stopped early. ``collected_step`` is the last step whose groups all came in:
    it trains, saves and pushes without the fleet."""

    stop: asyncio.Event = field(default_factory=asyncio.Event)
    abandon: asyncio.Event = field(default_factory=asyncio.Event)
    last_step: int = 0
    collected_step: int = 0
    handed_over: bool = False
    _collecting: asyncio.Condition = field(default_factory=asyncio.Condition)

    def stop_now(self) -> None:
        self.stop.set()
        self.abandon.set()

    async def groups_in(self, step: int) -> None:
        """``step``'s groups all came in."""
        async with self._collecting:
            self.collected_step = step
            self._collecting.notify_all()

    async def collected(self, step: int, timeout: float) -> bool:
        """Whether ``step``'s groups all come in within ``timeout`` seconds (results on their way from the fleet)."""
        with contextlib.suppress(TimeoutError):
            async with self._collecting:
                await asyncio.wait_for(self._collecting.wait_for(lambda: self.collected_step >= step), timeout)
        return self.collected_step >= step


class _Stopped(Exception):
    """``RunControl.abandon`` was set while a step waited for its groups."""


async def _unless_stopped(stop: asyncio.Event, work: Awaitable[T]) -> T:
    """``work``'s value, or _Stopped (``work`` cancelled) when ``stop`` is set first."""
    job, halt = asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({job, halt}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        halt.cancel()
        if not job.done():
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)
    if job.cancelled():
        raise _Stopped
    return job.result()


class RolloutSource(Protocol):
    """The two RolloutClient calls the GRPO loop needs."""

    async def submit(self, task: TaskRequest) -> dict[str, Any]: ...

    def results(self, task_ids: Iterable[str], *, timeout: float = ..., poll: float = ...) -> Any: ...


def _model_dir(settings: TrainerSettings) -> Path:
    if settings.model:
        return Path(settings.model)
    from polar_gym.assets import tiny_model_dir

    return tiny_model_dir()


def _write(log: MetricsLog, row: Mapping[str, Any], sinks: MetricSinks | None) -> None:
    """One train_metrics.jsonl row, also to the W&B / TensorBoard sinks (``train/KEY`` at the row's step)."""
    log.write(row)
    if sinks is not None:
        sinks.log(int(row["step"]), {"train": row})


def _finish(log: MetricsLog, out: Path, keys: Sequence[str], title: str) -> None:
    log.plot(out / "train_metrics.svg", keys, title)


def run_sft(settings: TrainerSettings, out_dir: Path, *, echo: Any = print, sinks: MetricSinks | None = None) -> Path:
    """SFT for ``settings.steps`` steps on ``settings.data``; returns the final checkpoint directory
    (``out_dir/checkpoints/final``). Every metrics row also goes to ``sinks``. Runs on the calling thread, pinned to
    ``trainer.cpus`` for the while when given."""
    with pinned(settings.cpus):
        return _run_sft(settings, out_dir, echo, sinks)


def _run_sft(settings: TrainerSettings, out_dir: Path, echo: Any, sinks: MetricSinks | None) -> Path:
    from transformers import AutoTokenizer

    model_dir = _model_dir(settings)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    sequences, skipped = load_sft_file(settings.data, tokenizer, settings.min_reward)
    for reason in skipped:
        echo(f"sft: skipped {reason}")
    if not sequences:
        raise ValueError(f"no trainable SFT record in {settings.data}")
    trainer = Trainer(settings, model_dir)
    log = MetricsLog(out_dir / "train_metrics.jsonl")
    order = random.Random(settings.seed)
    pool: list[TrainSequence] = []
    for step in range(1, settings.steps + 1):
        if len(pool) < settings.batch_size:  # epochs, reshuffled
            fresh = list(sequences)
            order.shuffle(fresh)
            pool += fresh
        batch, pool = pool[:settings.batch_size], pool[settings.batch_size:]
        started = time.monotonic()
        report = trainer.sft_step(batch)
        row = {"step": step, "loss": report.loss, "tokens": report.tokens, "grad_norm": report.grad_norm,
               "seconds": time.monotonic() - started, "sequences": len(batch)}
        _write(log, row, sinks)
        echo(f"sft step {step}: loss {report.loss:.4f} tokens {report.tokens} {row['seconds']:.2f} s")
        if settings.save_every and step % settings.save_every == 0 and step < settings.steps:
            trainer.save(out_dir / "checkpoints" / f"step-{step}")
    final = trainer.save(out_dir / "checkpoints" / "final")
    _finish(log, out_dir, ["loss", "seconds"], "SFT")
    return final


def grpo_sequences(results: Sequence[SessionResult], *, completed_only: bool = True,
                   shuffle: random.Random | None = None,
                   mixed_versions: Literal["correct", "mask"] = "correct") -> list[TrainSequence]:
    """Every trace of ``results`` with its GRPO advantage (group: the session's task, one prompt) and its loss
    weight (the builder's ``metadata["weight"]``, default 1: a session split into k traces counts once).

    A trace's reward is its own, else the evaluation's, else 0. With ``shuffle`` (``trainer.shuffle_rewards``, the
    control) the session rewards (the evaluation's, else the first trace's) are permuted across the step's sessions
    by :func:`~polar_gym.trainer.losses.shuffled_rewards` before advantages, and every trace of a session gets that
    session's permuted reward. ``true_reward`` keeps each trace's real reward either way. With ``mixed_versions``
    "mask" (``trainer.mixed_version_tokens``) the tokens of a trace's older policy versions are not trained
    (:func:`~polar_gym.trainer.staleness.mixed_version_mask`). A trace with images is not trained: this trainer
    feeds its model token ids only."""
    kept = [(r, r.trajectory.traces) for r in results if r.trajectory is not None and r.trajectory.traces
            and not (completed_only and r.status is not SessionStatus.COMPLETED)]
    true: list[list[float]] = []
    for result, traces in kept:
        outcome = result.evaluation.reward if result.evaluation is not None else None
        true.append([float((t.reward if t.reward is not None else outcome) or 0.0) for t in traces])
    used = true
    if shuffle is not None:
        session = [float(r.evaluation.reward) if r.evaluation is not None and r.evaluation.reward is not None
                   else rewards[0] for (r, _), rewards in zip(kept, true, strict=True)]
        used = [[p] * len(rewards) for p, rewards in zip(shuffled_rewards(session, shuffle), true, strict=True)]
    rows = [(r.task_id, reward, real, trace, trace_weight(trace.metadata, f"session {r.session_id!r} trace {i}"))
            for (r, traces), rewards, reals in zip(kept, used, true, strict=True)
            for i, (trace, reward, real) in enumerate(zip(traces, rewards, reals, strict=True))]
    advantages = group_advantages([reward for _, reward, *_ in rows], [g for g, *_ in rows])
    out = []
    for (g, reward, real, t, w), a in zip(rows, advantages, strict=True):
        versions = trace_versions(t)
        mask = mixed_version_mask(versions, t.loss_mask) if mixed_versions == "mask" else t.loss_mask
        if t.metadata.get("images"):  # a text model's loss would see the placeholders without their pixels
            mask = [0] * len(t.loss_mask)
        out.append(sequence_of_trace(t.prompt_ids, t.response_ids, mask, t.response_logprobs, reward=reward,
                                     group=g, advantage=a, weight=w, true_reward=real,
                                     versions=[numeric_version(v) for v in versions]))
    return out


def _versions(results: Sequence[SessionResult]) -> list[str]:
    found = {str(v) for r in results if r.trajectory for t in r.trajectory.traces
             for v in t.metadata.get("policy_versions", [])}
    return sorted(found)


def _trained_traces(results: Sequence[SessionResult], completed_only: bool) -> list[Trace]:
    """The traces :func:`grpo_sequences` trains on (those with a trained token), for the step's verdict."""
    return [t for r in results if r.trajectory is not None
            and not (completed_only and r.status is not SessionStatus.COMPLETED)
            for t in r.trajectory.traces if any(t.loss_mask)]


async def _evaluate(worker: TrainerWorker, scorer: ReferenceScorer | None, model: Any) -> dict[str, float]:
    return {} if scorer is None else await worker.run(scorer, model)


def _describe(row: Mapping[str, Any]) -> str:
    parts = [f"reward {row['reward_mean']:.3f} ± {row['reward_se']:.3f}"]
    if "eval/p_right" in row:
        parts.append(f"P(right) {row['eval/p_right']:.3f} share {row['eval/share_right']:.3f}")
    if "eval/greedy_success" in row:
        parts.append(f"greedy {row['eval/greedy_success']:.2f}")
    parts.append(f"loss {row.get('loss', float('nan')):.4f}")
    return ", ".join(parts)


class _Judge:
    """The step's verdict, taken inside the update (it needs the mismatch the trainer measures before it)."""

    def __init__(self, sequences: Sequence[TrainSequence], traces: Sequence[Trace], max_mismatch: float | None,
                 mismatch_metric: str):
        self.rewards, self.groups = [s.reward for s in sequences], [s.group for s in sequences]
        self.traces, self.max_mismatch, self.metric = traces, max_mismatch, mismatch_metric
        self.verdict = step_verdict(self.rewards, self.groups, traces)

    def __call__(self, stats: Mapping[str, float]) -> bool:
        self.verdict = step_verdict(self.rewards, self.groups, self.traces, max_mismatch=self.max_mismatch,
                                    mismatch=stats.get(self.metric), mismatch_metric=self.metric)
        return self.verdict.trained


async def run_grpo(settings: TrainerSettings, tasks: Sequence[TaskRequest], client: RolloutSource,
                   out_dir: Path, *, weights: WeightSync | None = None, echo: Any = print,
                   timeout: float = 3600.0, sinks: MetricSinks | None = None, resume: bool = False,
                   control: RunControl | None = None) -> Path:
    """GRPO for ``settings.steps`` steps on ``tasks`` (each ``num_samples`` sessions: one group); after each step
    the checkpoint ``out_dir/checkpoints/step-N`` is pushed to the fleet as policy version ``initial_version + N``.
    Every step's traces go to ``out_dir/trajectories.jsonl``, every metrics row also to ``sinks``. Returns the last
    checkpoint.

    Besides the loss, each row says whether the step trained (:func:`~polar_gym.trainer.verdict.step_verdict`: a
    step with no signal, scripted traces or a trainer-engine mismatch is not an update, and says so) and carries
    the step's evaluation (:mod:`polar_gym.trainer.step_eval`); with ``reference_answers`` a row ``step 0`` holds
    the evaluation of the starting weights, and row N that of the weights after update N.

    With ``resume`` the run goes on after the newest step whose state it saved (:mod:`polar_gym.trainer.resume`);
    ``control`` lets the caller stop it at a step boundary and see how far it got."""
    if settings.push_weights and weights is None:
        raise ValueError("push_weights needs a WeightSync (the fleet's weight-update call)")
    model_dir = _model_dir(settings)
    worker = TrainerWorker(settings.cpus)
    try:
        return await _run_grpo(settings, tasks, client, out_dir, worker, model_dir, weights=weights, echo=echo,
                               timeout=timeout, sinks=sinks, resume=resume, control=control or RunControl())
    finally:
        worker.close()


async def _run_grpo(settings: TrainerSettings, tasks: Sequence[TaskRequest], client: RolloutSource, out_dir: Path,
                    worker: TrainerWorker, model_dir: Path, *, weights: WeightSync | None, echo: Any,
                    timeout: float, sinks: MetricSinks | None, resume: bool, control: RunControl) -> Path:
    point = resume_point(out_dir / "checkpoints") if resume else None
    control.last_step = point.step if point else 0
    trainer = await worker.run(Trainer, settings, model_dir, point.checkpoint if point else None)
    if point is not None:
        await worker.run(trainer.restore, point.trainer, point.loop["version"])
    scorer = (await worker.run(ReferenceScorer, settings.reference_answers, model_dir, PAD_ID)
              if settings.reference_answers else None)
    shuffle = random.Random(settings.seed) if settings.shuffle_rewards else None
    if shuffle is not None and point is not None:
        set_random_state(shuffle, point.loop["shuffle_rng"])
    kept = point.step if point else -1  # a resume without a finished step starts afresh
    log = MetricsLog(out_dir / "train_metrics.jsonl", kept_rows(out_dir / "train_metrics.jsonl", kept)
                     if resume else None)
    if resume:
        kept_rows(out_dir / "trajectories.jsonl", kept)
    if scorer is not None and point is None:
        first = {"step": 0, "version": settings.initial_version, **await _evaluate(worker, scorer, trainer.model)}
        _write(log, first, sinks)
        echo(f"grpo step 0 (before training): P(right) {first['eval/p_right']:.3f} share "
             f"{first['eval/share_right']:.3f}")
    checkpoint = point.checkpoint if point else model_dir
    feed = GroupFeed(client, tasks, steps=settings.steps, max_staleness=settings.max_staleness,
                     stale_groups=settings.stale_groups, greedy_samples=settings.greedy_samples,
                     completed_only=settings.completed_only, timeout=timeout)
    try:
        if point is not None:
            if weights is not None and settings.push_weights:  # before any group samples again
                await weights.update_weights(str(point.checkpoint), point.loop["version"])
            groups = await feed.restore(point.loop["feed"])
            echo(f"grpo: resuming after step {point.step} ({point.checkpoint}, policy version "
                 f"{point.loop['version']}); {groups} group(s) of the earlier job re-attached")
        for step in range(control.last_step + 1, settings.steps + 1):
            if control.stop.is_set():
                break
            checkpoint = await _grpo_step(step, settings, worker, trainer, feed, scorer, shuffle, log, out_dir,
                                          weights, echo, sinks, control)
            control.last_step = step
    except _Stopped:
        pass
    finally:
        if control.stop.is_set() and control.last_step < settings.steps:
            control.handed_over = True
            left = await feed.detach()
            if control.last_step:
                update_loop_state(checkpoint, {"feed": feed.state()})
            echo(f"grpo: stopped after step {control.last_step} of {settings.steps} for the next job, which "
                 f"resumes it; {left} group(s) left to it")
            unused = 0
        else:
            unused = await feed.close()
    if unused:
        echo(f"grpo: {unused} group(s) sampled ahead were not trained on (the run ended; they were cancelled)")
    summary = trained_summary(log.rows)
    if summary is not None:
        echo(summary)
    return checkpoint


async def _grpo_step(step: int, settings: TrainerSettings, worker: TrainerWorker, trainer: Trainer, feed: GroupFeed,
                     scorer: ReferenceScorer | None, shuffle: random.Random | None, log: MetricsLog, out_dir: Path,
                     weights: WeightSync | None, echo: Any, sinks: MetricSinks | None, control: RunControl) -> Path:
    """One GRPO step: the feed's groups (_Stopped when ``control.abandon`` is set while waiting), the update (or the
    verdict against it), the evaluation, the checkpoint and its push, the state a resumed run starts from; returns
    the checkpoint."""
    started = time.monotonic()
    trainer_version = settings.initial_version + step - 1
    batch = await _unless_stopped(control.abandon, feed.next_batch(step, trainer_version))
    await control.groups_in(step)
    results = batch.results
    _keep_traces(out_dir / "trajectories.jsonl", results, step)
    if results and all(r.status is SessionStatus.ERROR for r in results):
        raise RuntimeError(f"every session of step {step} ended in ERROR (the fleet, not the policy): "
                           f"{results[0].reason}")
    sequences = [s for s in grpo_sequences(results, completed_only=settings.completed_only, shuffle=shuffle,
                                           mixed_versions=settings.mixed_version_tokens)
                 if any(s.loss_mask)]
    row: dict[str, Any] = {"step": step, "version": trainer_version,
                           "sessions": len(results), "traces": len(sequences),
                           "errored": sum(r.status is not SessionStatus.COMPLETED for r in results),
                           "sampled_versions": _versions(results), "rollout_seconds": batch.wait_seconds,
                           "shuffled_rewards": settings.shuffle_rewards, **reward_stats(results),
                           **_staleness_row(batch, results, trainer_version, settings)}
    if settings.greedy_samples:
        greedy_stats = reward_stats(batch.greedy, "greedy")
        row.update({"eval/greedy_success": greedy_stats["greedy_mean"], "eval/greedy_n": greedy_stats["greedy_n"]})
    judge = _Judge(sequences, _trained_traces(results, settings.completed_only), settings.max_mismatch,
                   settings.mismatch_metric)
    train_started = time.monotonic()
    if sequences and any(s.weight > 0 for s in sequences):
        report = await worker.run(trainer.grpo_step, sequences, judge)
        row.update({"loss": report.loss, "tokens": report.tokens, "grad_norm": report.grad_norm, **report.stats})
    row.update({"trained": judge.verdict.trained, "not_trained_reasons": list(judge.verdict.reasons),
                "train_seconds": time.monotonic() - train_started})
    row.update(_token_counts(results, sequences, row, settings.completed_only))
    row.update(await _evaluate(worker, scorer, trainer.model))
    checkpoint = await worker.run(trainer.save, out_dir / "checkpoints" / f"step-{step}")
    version = settings.initial_version + step
    if weights is not None and settings.push_weights:
        push_started = time.monotonic()
        await weights.update_weights(str(checkpoint), version)
        row["push_seconds"] = time.monotonic() - push_started
    # the guard scores this version's samples with these weights from now on
    await worker.run(trainer.keep_version, version)
    row["seconds"] = time.monotonic() - started
    _write(log, row, sinks)
    loop_state = {"step": step, "version": version, "feed": feed.state(),
                  "shuffle_rng": random_state(shuffle) if shuffle is not None else None}
    await worker.run(save_state, checkpoint, trainer.state(), loop_state)
    echo(f"grpo step {step}: {_describe(row)}; traces {len(sequences)} -> version {version} "
         f"({row['seconds']:.1f} s)")
    if batch.dropped:
        echo(f"grpo step {step}: dropped {len(batch.dropped)} stale group(s) (more than trainer.max_staleness "
             f"{settings.max_staleness} versions old: {', '.join(d.task_id for d in batch.dropped)}); "
             "fresh groups replace them")
    if not judge.verdict.trained:
        echo(f"grpo step {step}: {judge.verdict.message}")
    keys = [k for k in GRPO_PLOT_KEYS if any(k in r for r in log.rows)]
    _finish(log, out_dir, keys + (list(STALENESS_PLOT_KEYS) if settings.max_staleness else []), "GRPO")
    _prune(out_dir / "checkpoints", checkpoint, settings.save_every)
    return checkpoint


def _token_counts(results: Sequence[SessionResult], sequences: Sequence[TrainSequence], row: Mapping[str, Any],
                  completed_only: bool) -> dict[str, int]:
    """Where every sampled token of the step went: ``tokens/sampled`` (trained tokens of every trace, a dropped
    group's included) = ``tokens/trained`` + the ``masked_tokens/*`` counts, each a reason (stale group, older
    version of a mixed trace, a session that did not complete, a session weight of 0, the rollout correction's mask,
    a step the verdict refused)."""
    traced = [(r, sum(t.loss_mask)) for r in results if r.trajectory is not None for t in r.trajectory.traces]
    incomplete = sum(n for r, n in traced if completed_only and r.status is not SessionStatus.COMPLETED)
    in_batch = sum(sum(s.loss_mask) for s in sequences)
    zero_weight = sum(sum(s.loss_mask) for s in sequences if s.weight == 0)
    trained = bool(row.get("trained")) and "loss" in row
    correction = int(row.get("masked_tokens/rollout_correction", 0)) if trained else 0
    return {"tokens/sampled": sum(n for _, n in traced) + int(row.get("masked_tokens/stale", 0)),
            "tokens/trained": in_batch - zero_weight - correction if trained else 0,
            "masked_tokens/incomplete": incomplete, "masked_tokens/zero_weight": zero_weight if trained else 0,
            "masked_tokens/rollout_correction": correction,
            "masked_tokens/not_trained": 0 if trained else in_batch}


def _staleness_row(batch: Batch, results: Sequence[SessionResult], trainer_version: int,
                   settings: TrainerSettings) -> dict[str, Any]:
    """The step's staleness (per trained sample), the groups it dropped, the rounds its groups came from and the
    tokens masked for age (stale groups dropped, older versions of a mixed trace masked)."""
    ages, mixed = [], 0
    for trace in _trained_traces(results, settings.completed_only):
        versions = trace_versions(trace)
        ages.append(sample_age(versions, trace.loss_mask, trainer_version))
        if settings.mixed_version_tokens == "mask":
            mixed += sum(trace.loss_mask) - sum(mixed_version_mask(versions, trace.loss_mask))
    return {**staleness_stats(ages).as_row(), "rounds": list(batch.rounds),
            "stale_groups_dropped": len(batch.dropped),
            "masked_tokens/stale": sum(d.tokens for d in batch.dropped), "masked_tokens/mixed_version": mixed}


def _keep_traces(path: Path, results: Sequence[SessionResult], step: int) -> None:
    """Append the step's traces to the run's trajectories.jsonl (merge.exports.trajectory_records)."""
    with path.open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in trajectory_records(results, step))


def _prune(folder: Path, keep: Path, every: int) -> None:
    """Drop step checkpoints but the last (the engines read it) and every ``every``-th."""
    import shutil

    for path in folder.glob("step-*"):
        number = path.name.removeprefix("step-")
        if path == keep or not number.isdigit() or (every and int(number) % every == 0):
            continue
        shutil.rmtree(path, ignore_errors=True)
