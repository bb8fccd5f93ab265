"""Miles trainer bridge: the Slime bridge's rollout function, fitted to Miles (radixark's fork of Slime).

    --rollout-function-path polar_gym.bridges.miles.generate_rollout
    POLAR_SERVER_URL=http://HOST:8700 POLAR_ADMIN_TOKEN=... (the rollout server; gateways registered with it)

Miles's ``Sample`` (``miles/utils/types.py``) has every field the Slime bridge fills, so each group is filled by
:func:`polar_gym.bridges.slime.fill_group` (one session per sample, its main chain, token for token). Miles adds
what this module handles on top:

- Partial groups (a session timed out, errored or was cancelled). Miles's own fully-async rollout returns a group
  with an aborted sample to the data source (``reset_for_retry`` + ``add_samples``) and refills the batch, and its
  default GRPO normalization needs ``n_samples_per_prompt`` samples per group. ``POLAR_PARTIAL_GROUPS=recycle``
  (the default) does the same; ``drop`` discards the group and refills; ``keep`` keeps it with the failed sessions
  as ``remove_sample`` samples (Miles zeroes their loss mask), as Miles's Polar PR does, when at least
  ``POLAR_MIN_COMPLETE_FRACTION`` of the sessions completed. With ``keep``, the failed sessions' reward 0 would
  pull Miles's group mean down: use :func:`leave_one_out_rewards` as ``--custom-reward-post-process-path``.
- Stale groups. ``weight_versions`` holds the policy version of each sampled span (Miles reads its minimum as
  ``oldest_weight_version``). A group whose oldest version is more than ``--max-weight-staleness`` (Miles's flag) or
  ``POLAR_MAX_STALENESS`` behind the current version (``rollout_id``: number policy versions as Miles numbers its
  rollouts) is recycled, as Miles's fully-async rollout does. ``POLAR_STAMP_VERSIONS=1`` stamps ``rollout_id`` on
  the fleet before each batch (for Miles updating its own engines, which polar_gym does not see).
- ``status`` is FAILED for a session that errored (ABORTED for a timeout or a cancellation), ``reward`` is a dict
  under ``--reward-key`` when Miles is given one, and ``metadata["polar"]`` adds ``policy_staleness``.

Advantages: with whole groups (``recycle``, ``drop``) the rollout function provides rewards only and Miles's own
GRPO normalization applies unchanged; :func:`leave_one_out_rewards` is for ``keep``.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from polar_gym.bridges.common import run_sync
from polar_gym.bridges.slime import SlimeBridgeSettings, collect_results, fill_group, image_pixels_of
from polar_gym.schema import SessionResult, SessionStatus
from polar_gym.server.client import RolloutClient

__all__ = ["GroupVerdict", "MilesBridgeSettings", "assemble_batch", "fill_miles_group", "generate_rollout",
           "judge_group", "leave_one_out_rewards", "oldest_version", "reset_sample"]

PartialGroups = Literal["recycle", "drop", "keep"]
Runner = Callable[[list[list[Any]], int], Awaitable[list[list[SessionResult]]]]
_OUR_KEYS = ("polar", "polar_extra_traces")
_COMPLETED = SessionStatus.COMPLETED.value


class MilesBridgeSettings(SlimeBridgeSettings):
    """The Slime bridge's settings plus Miles's partial-group and staleness rules."""

    model_config = ConfigDict(extra="forbid")

    partial_groups: PartialGroups = "recycle"
    min_complete_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    max_staleness: int | None = Field(default=None, ge=0)
    stamp_versions: bool = False
    max_rounds: int = Field(default=4, ge=1)
    reward_key: str | None = None
    placeholder_token_id: int = Field(default=0, ge=0)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, args: Any = None) -> MilesBridgeSettings:
        env = os.environ if environ is None else environ
        base = SlimeBridgeSettings.from_env(dict(env), args).model_dump()
        staleness = env.get("POLAR_MAX_STALENESS") or getattr(args, "max_weight_staleness", None)
        return cls(**base, partial_groups=env.get("POLAR_PARTIAL_GROUPS", "recycle"),
                   min_complete_fraction=float(env.get("POLAR_MIN_COMPLETE_FRACTION", 0.0)),
                   max_staleness=None if staleness in (None, "") else int(staleness),
                   stamp_versions=env.get("POLAR_STAMP_VERSIONS", "0") not in ("", "0", "false"),
                   max_rounds=int(env.get("POLAR_MAX_ROUNDS", 4)), reward_key=getattr(args, "reward_key", None) or None)


class GroupVerdict(BaseModel):
    """Whether a filled group trains, and why not: ``partial`` (sessions that did not complete) or ``stale``."""

    keep: bool
    reason: Literal["partial", "stale"] | None = None
    completed: int
    oldest_version: int | None = None
    staleness: int | None = None


def _set_status(sample: Any, value: str) -> None:
    enum = getattr(type(sample), "Status", None)
    if enum is not None and value not in {m.value for m in enum}:
        value = "aborted"  # a Sample.Status without FAILED (older Miles, Slime)
    sample.status = enum(value) if enum is not None else value


def fill_miles_group(group: Sequence[Any], results: Sequence[SessionResult], group_index: int,
                     settings: MilesBridgeSettings) -> list[Any]:
    """:func:`fill_group`, then Miles's fields: a session that did not complete is a ``remove_sample`` sample, FAILED
    when it errored; one that never reached the model holds a one-token placeholder (Miles packs no empty
    sequence); ``reward`` goes under ``reward_key`` when Miles reads rewards through one."""
    fill_group(group, results, group_index, settings.extra_chains,
               image_pixels_of(settings.hf_checkpoint) if settings.hf_checkpoint else None)
    for sample in group:
        polar = sample.metadata["polar"]
        session = polar.get("session_status")
        if session != _COMPLETED:
            sample.remove_sample = True
            _set_status(sample, "failed" if session == SessionStatus.ERROR.value else "aborted")
            if sample.response_length == 0:
                pad = settings.placeholder_token_id
                sample.tokens, sample.response_length = [pad, pad], 1
                sample.loss_mask, sample.rollout_log_probs = [0], [0.0]
                polar["placeholder"] = True
        if settings.reward_key:
            sample.reward = {settings.reward_key: sample.reward}
    return list(group)


def oldest_version(samples: Sequence[Any]) -> int | None:
    """The oldest integer policy version across the samples' ``weight_versions`` (Miles's ``oldest_weight_version``;
    a version that is not an integer, such as an unnumbered base model, is not counted)."""
    versions = [int(v) for s in samples for v in (getattr(s, "weight_versions", None) or []) if str(v).isdigit()]
    return min(versions) if versions else None


def judge_group(group: Sequence[Any], settings: MilesBridgeSettings, current_version: int | None) -> GroupVerdict:
    """Staleness first (a stale group is recycled whatever its sessions did), then partial groups."""
    completed = sum(s.metadata["polar"].get("session_status") == _COMPLETED for s in group)
    oldest = oldest_version(group)
    staleness = current_version - oldest if oldest is not None and current_version is not None else None
    verdict = GroupVerdict(keep=True, completed=completed, oldest_version=oldest, staleness=staleness)
    if staleness is not None and settings.max_staleness is not None and staleness > settings.max_staleness:
        return verdict.model_copy(update={"keep": False, "reason": "stale"})
    if completed < len(group):
        enough = completed > 0 and completed >= math.ceil(len(group) * settings.min_complete_fraction)
        return verdict.model_copy(update={"keep": settings.partial_groups == "keep" and enough, "reason": "partial"})
    return verdict


def reset_sample(sample: Any) -> None:
    """Back to a prompt for the data source: Miles's ``reset_for_retry`` when the Sample has it, and our metadata."""
    if callable(getattr(sample, "reset_for_retry", None)):
        sample.reset_for_retry()
    else:
        sample.tokens, sample.response_length, sample.response = [], 0, ""
        sample.reward = sample.loss_mask = sample.rollout_log_probs = None
        sample.weight_versions, sample.remove_sample = [], False
        _set_status(sample, "pending")
    sample.metadata = {k: v for k, v in (sample.metadata or {}).items() if k not in _OUR_KEYS}


def _annotate(group: Sequence[Any], current_version: int | None) -> None:
    for sample in group:
        oldest = oldest_version([sample])
        sample.metadata["polar"]["policy_staleness"] = (
            current_version - oldest if oldest is not None and current_version is not None else None)


async def assemble_batch(data_source: Any, target: int, rollout_id: int, settings: MilesBridgeSettings, run: Runner,
                         current_version: int | None) -> tuple[list[list[Any]], dict[str, float]]:
    """``target`` groups that pass :func:`judge_group`, refilled from ``data_source`` up to ``max_rounds`` times;
    recycled groups go back through ``data_source.add_samples``. ``run`` gives each group's SessionResults."""
    accepted: list[list[Any]] = []
    counts = {"recycled_partial": 0, "dropped_partial": 0, "recycled_stale": 0, "kept_partial": 0}
    staleness: list[int] = []
    taken = 0
    for _ in range(settings.max_rounds):
        need = target - len(accepted)
        if need <= 0:
            break
        groups = [list(g) for g in data_source.get_samples(need)]
        if not groups:
            break
        for group, results in zip(groups, await run(groups, rollout_id), strict=True):
            first = getattr(group[0], "group_index", None)
            fill_miles_group(group, results, first if first is not None else taken, settings)
            taken += 1
            verdict = judge_group(group, settings, current_version)
            if verdict.staleness is not None:
                staleness.append(verdict.staleness)
            if verdict.keep:
                counts["kept_partial"] += verdict.reason == "partial"
                _annotate(group, current_version)
                accepted.append(group)
                continue
            drop = verdict.reason == "partial" and settings.partial_groups == "drop"
            counts[("dropped_" if drop else "recycled_") + str(verdict.reason)] += 1
            if not drop:
                for sample in group:
                    reset_sample(sample)
                data_source.add_samples([group])
    if len(accepted) < target:
        raise RuntimeError(f"only {len(accepted)} of {target} prompt groups passed after {settings.max_rounds} rounds "
                           f"({counts}): see the sessions' reasons on the rollout server")
    metrics: dict[str, float] = {f"polar/{k}_groups": float(v) for k, v in counts.items()}
    if staleness:
        metrics["polar/staleness_mean"] = sum(staleness) / len(staleness)
        metrics["polar/staleness_max"] = float(max(staleness))
    return accepted, metrics


def _reward_of(sample: Any, reward_key: str | None) -> float:
    reward = sample.reward
    if isinstance(reward, dict):
        reward = reward[reward_key] if reward_key else next(iter(reward.values()))
    return 0.0 if reward is None else float(reward)


def leave_one_out_rewards(args: Any, samples: Sequence[Any]) -> tuple[list[float], list[float]]:
    """Miles's ``--custom-reward-post-process-path`` for kept partial groups: ``(raw rewards, advantages)``. Each
    sample's baseline is the mean reward of the other trainable samples of its group (``group_index``); a
    ``remove_sample`` sample is no one's baseline and gets 0. Miles's switches apply as in its own GRPO:
    ``rewards_normalization``, ``advantage_estimator`` and ``grpo_std_normalization``."""
    raw = [_reward_of(s, getattr(args, "reward_key", None)) for s in samples]
    estimator = getattr(args, "advantage_estimator", "grpo")
    if not getattr(args, "rewards_normalization", True) or estimator not in ("grpo", "gspo",
                                                                             "reinforce_plus_plus_baseline"):
        return raw, list(raw)
    std_norm = estimator in ("grpo", "gspo") and bool(getattr(args, "grpo_std_normalization", False))
    groups: dict[Any, list[int]] = {}
    for i, sample in enumerate(samples):
        if not getattr(sample, "remove_sample", False):
            groups.setdefault(getattr(sample, "group_index", None), []).append(i)
    advantages = [0.0] * len(samples)
    for members in groups.values():
        if len(members) < 2:
            continue  # nothing to compare against: no signal
        rewards = [raw[i] for i in members]
        total, scale = sum(rewards), (statistics.stdev(rewards) + 1e-6) if std_norm else 1.0
        for i in members:
            advantages[i] = (raw[i] - (total - raw[i]) / (len(members) - 1)) / scale
    return raw, advantages


async def _stamp(settings: MilesBridgeSettings, version: int) -> None:
    """Every gateway stamps ``version`` on later completions (``POST /backends/resume``)."""
    async with RolloutClient(settings.server_url, settings.admin_token) as client:
        resp = await client.http.post("/backends/resume", json={"policy_version": version})
        resp.raise_for_status()


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """Miles's ``--rollout-function-path`` entry: ``rollout_batch_size`` whole groups in Miles's
    RolloutFnTrainOutput (with polar metrics) when Miles is importable, else the ``list[list[Sample]]``."""
    if evaluation:
        raise NotImplementedError("evaluation rollouts: run them through the rollout server directly")
    settings = MilesBridgeSettings.from_env(args=args)

    async def run(groups: list[list[Any]], rid: int) -> list[list[SessionResult]]:
        return await collect_results(groups, rid, settings, prefix="miles")

    async def batch() -> tuple[list[list[Any]], dict[str, float]]:
        if settings.stamp_versions:
            await _stamp(settings, rollout_id)
        target = int(getattr(args, "rollout_batch_size", 1))
        return await assemble_batch(data_source, target, rollout_id, settings, run, rollout_id)

    groups, metrics = run_sync(batch)
    try:
        from miles.rollout.base_types import RolloutFnTrainOutput  # type: ignore[import-not-found]  # not on PyPI
    except ImportError:
        return groups
    return RolloutFnTrainOutput(samples=groups, metrics=metrics)
