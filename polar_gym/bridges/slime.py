"""Slime trainer bridge: a rollout function that runs each prompt group as one Polar task through the rollout
server, so Slime trains on unmodified harness sessions instead of its own SGLang rollout.

    --rollout-function-path polar_gym.bridges.slime.generate_rollout
    POLAR_SERVER_URL=http://HOST:8700 POLAR_ADMIN_TOKEN=... (the rollout server; gateways registered with it)

Each Slime sample's ``metadata["polar_task"]`` holds the task (TaskRequest fields; ``task_id`` and ``num_samples`` are
set here: one session per sample of the group). The samples come back filled from the session's prefix-merged trace
(``polar_gym.merge.exports.slime_samples``): ``tokens`` = prompt + response, ``response_length``, ``loss_mask`` and
``rollout_log_probs`` over the response (the engine's logprobs: truncated importance correction and ``python -m
polar_gym.audit`` use them), ``reward``, ``status``, ``weight_versions`` (the policy version of each sampled turn) and
``metadata["polar"]["spans"]`` (each turn's response range and version). A session that did not complete gives an
"aborted" sample with an all-zero loss mask, so it is kept (group sizes stay fixed) but never trained on. When a session
has several chains (sub-agents, compaction), the sample takes the main one (the chain with the most sampled tokens) and
``metadata["polar_extra_traces"]`` says how many were left out; ``extra_chains="fail"`` refuses such sessions instead.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

from polar_gym.bridges.common import BridgeSettings
from polar_gym.merge.exports import main_chain, slime_samples
from polar_gym.schema import SessionResult, SessionStatus, TaskRequest
from polar_gym.server.client import RolloutClient

__all__ = ["ImagePixels", "SlimeBridgeSettings", "collect_results", "fill_group", "generate_rollout", "group_task",
           "image_pixels_of", "run_groups"]


class SlimeBridgeSettings(BridgeSettings):
    """Where the rollout server is and how groups become tasks (``POLAR_*`` environment variables by default)."""

    bridge_name: ClassVar[str] = "the Slime and Miles bridges"

    task_key: str = "polar_task"
    #: the model directory whose image processor turns a multimodal session's images into the samples'
    #: ``multimodal_train_inputs`` (the trainer's ``--hf-checkpoint``)
    hf_checkpoint: str | None = None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, args: Any = None) -> SlimeBridgeSettings:
        return cls(**cls.server_env(environ), hf_checkpoint=getattr(args, "hf_checkpoint", None) or None)


ImagePixels = Callable[[list[str]], dict[str, Any]]


@functools.lru_cache(maxsize=2)
def image_pixels_of(checkpoint: str) -> ImagePixels:
    """The pixel inputs a vision-language model's forward pass takes for a sample's images (data URLs), computed
    by the image processor of ``checkpoint`` (loaded once)."""
    from polar_gym.audit.recompute import image_pixels, load_image_processor

    processor = load_image_processor(checkpoint)
    return lambda urls: image_pixels(processor, urls)


def group_task(group: Sequence[Any], rollout_id: int, group_index: int, task_key: str = "polar_task",
               prefix: str = "slime") -> TaskRequest:
    """The TaskRequest of one prompt group: the first sample's ``metadata[task_key]``, one session per sample."""
    if not group:
        raise ValueError("an empty prompt group")
    spec = dict((getattr(group[0], "metadata", None) or {}).get(task_key) or {})
    if not spec:
        raise ValueError(f"sample metadata has no {task_key!r}: put the Polar task (TaskRequest fields) there")
    task_id = f"{prefix}-r{rollout_id}-g{group_index}-{uuid.uuid4().hex[:8]}"
    metadata = dict(spec.get("metadata") or {})
    metadata["group_id"] = metadata.get("group_id") or task_id  # the GRPO group: this prompt's samples
    return TaskRequest.model_validate({**spec, "task_id": task_id, "num_samples": len(group), "metadata": metadata})


def _status(sample: Any, value: str) -> Any:
    """Slime's ``Sample.Status`` member when the sample class has one (its values are these strings)."""
    enum = getattr(type(sample), "Status", None)
    return enum(value) if enum is not None else value


def fill_group(group: Sequence[Any], results: Sequence[SessionResult], group_index: int,
               extra_chains: Literal["main", "fail"] = "main", pixels: ImagePixels | None = None) -> list[Any]:
    """Write each session's trace into the group's samples (sample i gets session sample_index i). A trace with
    images also fills ``multimodal_inputs`` (``{"images": [data URL, ...]}``, in the order of their placeholders)
    and ``multimodal_train_inputs`` (``pixels`` of them: what the trainer's forward pass takes); without ``pixels``
    such a session is refused, since a trainer given the placeholders without the pixels trains on noise."""
    by_index = {int(r.metadata.get("sample_index", i)): r for i, r in enumerate(results)}
    for i, sample in enumerate(group):
        result = by_index.get(i)
        if result is None:
            raise ValueError(f"group {group_index}: no session result for sample {i}")
        chains = slime_samples(result, group_index=group_index, index_base=0)
        if len(chains) > 1 and extra_chains == "fail":
            raise ValueError(f"session {result.session_id} has {len(chains)} chains (extra_chains='fail')")
        meta = dict(getattr(sample, "metadata", None) or {})
        images: tuple[dict[str, Any] | None, dict[str, Any] | None] = (None, None)  # the session's, never the prompt's
        if chains:
            main = main_chain(chains)
            sample.tokens, sample.response_length = list(main.tokens), main.response_length
            sample.loss_mask, sample.rollout_log_probs = list(main.loss_mask), list(main.rollout_log_probs)
            sample.reward, sample.status = main.reward, _status(sample, main.status)
            # slime's own field: one policy version per sampled turn (staleness); per-token ranges in
            # metadata["polar"]["spans"], so a trainer can weight each span by the version that sampled it
            sample.weight_versions = list(main.weight_versions)
            if main.multimodal_inputs:
                if pixels is None:
                    raise ValueError(f"session {result.session_id} has images, and no image processor computes "
                                     "their pixel inputs: set hf_checkpoint (the trainer's --hf-checkpoint)")
                images = main.multimodal_inputs, pixels(list(main.multimodal_inputs["images"]))
            meta.update(polar=main.metadata, polar_extra_traces=len(chains) - 1)
        else:  # no model call at all (e.g. the sandbox failed to start): nothing to train, kept for the group size
            sample.tokens, sample.response_length, sample.loss_mask, sample.rollout_log_probs = [], 0, [], []
            sample.reward, sample.status = 0.0, _status(sample, "aborted")
            meta.update(polar={"session_id": result.session_id, "session_status": SessionStatus(result.status).value,
                               "reason": result.reason, "masked": True}, polar_extra_traces=0)
        sample.multimodal_inputs, sample.multimodal_train_inputs = images
        sample.metadata = meta
        sample.group_index = group_index
    return list(group)


async def collect_results(groups: Sequence[Sequence[Any]], rollout_id: int, settings: SlimeBridgeSettings,
                          prefix: str = "slime") -> list[list[SessionResult]]:
    """Submit one task per group and wait for every session: each group's SessionResults, in group order."""
    tasks = [group_task(g, rollout_id, i, settings.task_key, prefix) for i, g in enumerate(groups)]
    async with RolloutClient(settings.server_url, settings.admin_token) as client:
        await client.submit_all(tasks)
        results: dict[str, list[SessionResult]] = {t.task_id: [] for t in tasks}
        async for result in client.results(list(results), timeout=settings.timeout_seconds):
            results[result.task_id].append(result)
    return [results[t.task_id] for t in tasks]


async def run_groups(groups: Sequence[Sequence[Any]], rollout_id: int,
                     settings: SlimeBridgeSettings) -> list[list[Any]]:
    """Submit one task per group, wait for every session, fill the samples in place."""
    results = await collect_results(groups, rollout_id, settings)
    pixels = image_pixels_of(settings.hf_checkpoint) if settings.hf_checkpoint else None
    return [fill_group(g, r, i, settings.extra_chains, pixels)
            for i, (g, r) in enumerate(zip(groups, results, strict=True))]


def _take_groups(data_source: Any, args: Any) -> list[list[Any]]:
    """Prompt groups from Slime's data source (``get_samples`` in current Slime; older ones are callables)."""
    count = int(getattr(args, "rollout_batch_size", 1))
    take = getattr(data_source, "get_samples", None) or data_source
    return [list(g) for g in take(count)]


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """Slime's ``--rollout-function-path`` entry: ``list[list[Sample]]`` groups, wrapped in Slime's
    RolloutFnTrainOutput when Slime is importable."""
    if evaluation:
        raise NotImplementedError("evaluation rollouts: run them through the rollout server directly")
    groups = _take_groups(data_source, args)
    filled = asyncio.run(run_groups(groups, rollout_id, SlimeBridgeSettings.from_env(args=args)))
    try:
        from slime.rollout.base_types import RolloutFnTrainOutput
    except ImportError:
        return filled
    return RolloutFnTrainOutput(samples=filled)
