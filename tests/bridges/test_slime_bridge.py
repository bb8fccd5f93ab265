"""The Slime bridge against a real local fleet (rollout server + gateway, pi in bubblewrap, oracle engine with the
real Qwen tokenizer): samples come back with tokens, loss masks and logprobs that line up with exactly what the
engine sampled (read back from the capture journal), and a session that never reached the model is kept, masked."""

from __future__ import annotations

import asyncio
import enum
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.bridges.slime import fill_group, generate_rollout, group_task
from polar_gym.fleet import InferenceSettings, local_fleet
from polar_gym.gateway.config import GatewayPools
from polar_gym.journal import read_session
from polar_gym.merge.cli import find_journals
from polar_gym.schema import PrepareAction, RuntimeSpec, SessionResult, SessionStatus, Trace, Trajectory
from polar_gym.tasks import DEMO_TASKS


@dataclass
class Sample:
    """The fields of slime.utils.types.Sample the bridge reads and writes. Slime itself does not install here: PyPI's
    `slime` is an unrelated package and THUDM/slime is only on GitHub (docs/trainers/slime.md)."""

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    response_length: int = 0
    label: str | None = None
    reward: float | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    weight_versions: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None


class DataSource:
    def __init__(self, groups: list[list[Sample]]) -> None:
        self.groups = groups

    def get_samples(self, count: int) -> list[list[Sample]]:
        taken, self.groups = self.groups[:count], self.groups[count:]
        return taken


def _task(demo: str, **runtime: Any) -> dict[str, Any]:
    request = DEMO_TASKS[demo].to_request(harness="pi", model_name="policy")
    if runtime:
        request = request.model_copy(update={"runtime": RuntimeSpec(**{**request.runtime.model_dump(), **runtime})})
    return request.model_dump(mode="json", exclude={"task_id", "num_samples"})


async def test_slime_samples_align_with_what_the_engine_sampled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")
    broken = _task("demo-slugify", prepare=[PrepareAction(type="exec", command="exit 7")])
    groups = [[Sample(index=i, prompt="add", metadata={"polar_task": _task("demo-calc-add")}) for i in range(2)],
              [Sample(index=2, prompt="slug", metadata={"polar_task": broken})]]
    async with local_fleet(tmp_path / "fleet", InferenceSettings(), pools=GatewayPools(run_slots=3)) as (url, token):
        monkeypatch.setenv("POLAR_SERVER_URL", url)
        monkeypatch.setenv("POLAR_ADMIN_TOKEN", token)
        args = SimpleNamespace(rollout_batch_size=2)
        filled = await asyncio.to_thread(generate_rollout, args, 7, DataSource(groups))
    assert [len(g) for g in filled] == [2, 1] and filled[0][0] is groups[0][0]  # filled in place, sizes kept

    records = {}
    for journal in find_journals([tmp_path / "fleet" / "capture"]):
        session = read_session(journal)
        records[session[0].session_id] = [r for r in session if not r.side_request]
    for sample in filled[0]:
        assert sample.status is Sample.Status.COMPLETED and sample.reward == 1.0 and sample.group_index == 0
        polar = sample.metadata["polar"]
        calls = records[polar["session_id"]]
        prompt_length = polar["prompt_length"]
        n = sample.response_length
        assert len(sample.tokens) == prompt_length + n and len(sample.loss_mask) == len(sample.rollout_log_probs) == n
        assert sample.tokens[:prompt_length] == calls[0].prompt_ids  # the first call's exact prompt
        response = sample.tokens[prompt_length:]
        sampled = [t for t, m in zip(response, sample.loss_mask, strict=True) if m]
        logprobs = [lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if m]
        assert sampled == [t for c in calls for t in c.response_ids]  # every sampled token, in order, trained
        assert logprobs == [lp for c in calls for lp in c.response_logprobs]  # with the engine's own logprobs
        assert 0 in sample.loss_mask  # tool outputs between the calls are context, not trained
        assert len(calls) > 1 and sample.metadata["polar_extra_traces"] == 0

    (aborted,) = filled[1]
    assert aborted.status is Sample.Status.ABORTED and aborted.reward == 0.0 and aborted.metadata["polar"]["masked"]
    assert aborted.tokens == [] and aborted.loss_mask == [] and aborted.response_length == 0
    assert aborted.metadata["polar"]["reason"].startswith("init: prepare action 0 (exec) 'exit 7' failed")


def test_the_bridge_needs_the_server_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POLAR_SERVER_URL", raising=False)
    monkeypatch.delenv("POLAR_ADMIN_TOKEN", raising=False)
    with pytest.raises(RuntimeError, match="POLAR_SERVER_URL and POLAR_ADMIN_TOKEN"):
        generate_rollout(SimpleNamespace(rollout_batch_size=1), 0, DataSource([]))


def _result(sample_index: int, traces: list[Trace], status: SessionStatus = SessionStatus.COMPLETED) -> SessionResult:
    return SessionResult(session_id=f"s{sample_index}", task_id="t", status=status,
                         trajectory=Trajectory(session_id=f"s{sample_index}", traces=traces),
                         metadata={"sample_index": sample_index})


def _trace(prompt: list[int], response: list[int], mask: list[int], reward: float = 1.0) -> Trace:
    return Trace(prompt_ids=prompt, response_ids=response, loss_mask=mask,
                 response_logprobs=[-0.5] * len(response), reward=reward)


def test_a_session_with_a_sub_agent_chain_keeps_the_main_chain_and_reports_the_other() -> None:
    main = _trace([1, 2], [3, 4, 5, 6], [1, 1, 0, 1])
    sub = _trace([1, 9], [7], [1], reward=0.5)
    group = [Sample(), Sample()]
    fill_group(group, [_result(1, [_trace([1], [2], [1])], SessionStatus.TIMEOUT), _result(0, [sub, main])], 3)
    assert group[0].tokens == [1, 2, 3, 4, 5, 6] and group[0].loss_mask == [1, 1, 0, 1]
    assert group[0].metadata["polar_extra_traces"] == 1 and group[0].reward == 1.0
    assert group[1].status is Sample.Status.ABORTED and group[1].loss_mask == [0]  # partial: kept, never trained
    assert group[0].group_index == group[1].group_index == 3
    with pytest.raises(ValueError, match="2 chains"):
        fill_group([Sample()], [_result(0, [sub, main])], 0, extra_chains="fail")


def test_a_group_without_a_polar_task_is_refused() -> None:
    with pytest.raises(ValueError, match="no 'polar_task'"):
        group_task([Sample(metadata={})], 0, 0)
    task = group_task([Sample(metadata={"polar_task": _task("demo-calc-add")})] * 3, 4, 1)
    assert task.num_samples == 3 and task.task_id.startswith("slime-r4-g1-") and task.metadata.group_id


def test_samples_carry_the_policy_version_of_every_turn() -> None:
    trace = _trace([1, 2], [3, 4, 5, 6], [1, 1, 0, 1])
    trace.metadata = {"spans": [{"start": 0, "end": 2, "policy_version": 5, "completion_id": "a"},
                                {"start": 3, "end": 4, "policy_version": 6, "completion_id": "b"}],
                      "policy_versions": [5, 6]}
    [sample] = fill_group([Sample()], [_result(0, [trace])], 0)
    assert sample.weight_versions == ["5", "6"]
    assert [(s["start"], s["end"], s["policy_version"]) for s in sample.metadata["polar"]["spans"]] == [
        (0, 2, 5), (3, 4, 6)]
    assert sample.rollout_log_probs == [-0.5] * 4


def test_a_multimodal_session_gives_slime_its_images_and_the_models_pixel_inputs(tmp_path: Path) -> None:
    """Slime's two multimodal fields: the images as data URLs in the order of their placeholders, and what the
    model's image processor makes of them, one grid per run of placeholders in ``tokens``."""
    import json

    from polar_gym.bridges.slime import image_pixels_of
    from polar_gym.tiny_vlm import IMAGE_PAD_ID, PROCESSOR_CONFIG
    from tests._vision import image_session, pad_runs

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR_CONFIG))
    result, _ = image_session()
    trace = result.trajectory.traces[0]  # type: ignore[union-attr]
    [sample] = fill_group([Sample(multimodal_inputs={"images": ["the prompt's own"]})], [result], 0,
                          pixels=image_pixels_of(str(tmp_path)))
    assert sample.multimodal_inputs == {"images": [m["content"][1]["image_url"]["url"] for m in
                                                   [*trace.prompt_messages, *trace.response_messages]
                                                   if isinstance(m.get("content"), list)]}
    grids = sample.multimodal_train_inputs["image_grid_thw"].tolist()
    merge = PROCESSOR_CONFIG["merge_size"] ** 2
    assert [t * h * w // merge for t, h, w in grids] == [n for _, n in pad_runs(sample.tokens)] == [4, 4]
    assert sample.multimodal_train_inputs["pixel_values"].shape[0] == sum(t * h * w for t, h, w in grids)
    assert sample.tokens.count(IMAGE_PAD_ID) == 8

    # the same sample recycled for a text session keeps none of them
    fill_group([sample], [_result(0, [_trace([1, 2], [3], [1])])], 0)
    assert sample.multimodal_inputs is None and sample.multimodal_train_inputs is None


def test_a_multimodal_session_without_an_image_processor_is_refused() -> None:
    """Slime's trainer, given the placeholders without their pixels, would train on noise: refuse, say what to set."""
    from tests._vision import image_session

    with pytest.raises(ValueError, match=r"has images.*hf_checkpoint"):
        fill_group([Sample()], [image_session()[0]], 0)
