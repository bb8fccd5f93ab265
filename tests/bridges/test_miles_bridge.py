"""The Miles bridge against a stand-in of Miles's Sample (tests/bridges/_miles_types.py, from Miles's source): each
sample holds the session's prefix-merged chain token for token (mask boundaries, logprobs, versions per span),
partial and stale groups follow Miles's conventions, and the leave-one-out hook matches Miles's own GRPO on whole
groups. One slow test runs the rollout function against a real local fleet (pi, oracle engine)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.bridges.miles import (
    MilesBridgeSettings,
    assemble_batch,
    fill_miles_group,
    generate_rollout,
    judge_group,
    leave_one_out_rewards,
)
from polar_gym.schema import SessionResult, SessionStatus, Trace, Trajectory
from tests.bridges._miles_types import DataSource, Sample, default_rewards

PROMPT = [101, 102, 103, 104]
TURN1, TOOL, TURN2 = [201, 202, 203], [301, 302], [401, 402, 403, 404]  # sampled, tool output, sampled


def _settings(**kw: Any) -> MilesBridgeSettings:
    return MilesBridgeSettings(server_url="http://x", admin_token="t", **kw)


def _trace(versions: tuple[Any, Any] = (5, 6), reward: float = 1.0) -> Trace:
    """Two sampled turns with a tool output between them; each response token has its own logprob."""
    response = [*TURN1, *TOOL, *TURN2]
    a, b = len(TURN1), len(TURN1) + len(TOOL)
    return Trace(prompt_ids=PROMPT, response_ids=response, loss_mask=[1] * a + [0] * len(TOOL) + [1] * len(TURN2),
                 response_logprobs=[-0.01 * (i + 1) for i in range(len(response))], reward=reward,
                 metadata={"spans": [{"start": 0, "end": a, "policy_version": versions[0], "completion_id": "c1"},
                                     {"start": b, "end": len(response), "policy_version": versions[1],
                                      "completion_id": "c2"}]})


def _result(i: int, status: SessionStatus = SessionStatus.COMPLETED, traces: list[Trace] | None = None,
            reward: float = 1.0, versions: tuple[Any, Any] = (5, 6)) -> SessionResult:
    traces = [_trace(versions, reward)] if traces is None else traces
    return SessionResult(session_id=f"s{i}", task_id="t", status=status, reason=None if status == "COMPLETED" else "x",
                         trajectory=Trajectory(session_id=f"s{i}", traces=traces, builder="prefix_merging"),
                         metadata={"sample_index": i})


def _group(n: int, group_index: int | None = None, first: int = 0) -> list[Sample]:
    return [Sample(group_index=group_index, index=first + i, prompt="p", metadata={"polar_task": {"demo": "x"}})
            for i in range(n)]


def assert_faithful(sample: Sample, trace: Trace) -> None:
    """Everything Miles trains on, compared token by token with the trace."""
    sample.validate()
    n = len(trace.response_ids)
    assert sample.response_length == n and sample.tokens == [*trace.prompt_ids, *trace.response_ids]
    assert sample.tokens[:sample.metadata["polar"]["prompt_length"]] == trace.prompt_ids
    assert sample.loss_mask == trace.loss_mask
    assert sample.rollout_log_probs == trace.response_logprobs
    response = sample.tokens[len(sample.tokens) - sample.response_length:]
    spans = sample.metadata["polar"]["spans"]
    assert sample.weight_versions == [str(s["policy_version"]) for s in trace.metadata["spans"]]
    for span, want in zip(spans, trace.metadata["spans"], strict=True):
        assert (span["start"], span["end"], span["policy_version"]) == (want["start"], want["end"],
                                                                        want["policy_version"])
        assert all(sample.loss_mask[span["start"]:span["end"]])  # a version per sampled span, on sampled tokens
        assert response[span["start"]:span["end"]] == trace.response_ids[span["start"]:span["end"]]
    assert sum(sample.loss_mask) == sum(s["end"] - s["start"] for s in spans)  # every sampled token is in a span


def test_a_multi_turn_session_fills_miles_sample_token_for_token() -> None:
    [sample] = fill_miles_group(_group(1), [_result(0)], 3, _settings())
    assert_faithful(sample, _trace())
    response = sample.tokens[len(PROMPT):]
    assert [t for t, m in zip(response, sample.loss_mask, strict=True) if m] == [*TURN1, *TURN2]
    assert [t for t, m in zip(response, sample.loss_mask, strict=True) if not m] == TOOL
    assert sample.loss_mask.index(0) == len(TURN1) and sample.loss_mask.index(1, len(TURN1)) == len(TURN1) + len(TOOL)
    assert sample.weight_versions == ["5", "6"] and sample.oldest_weight_version == 5
    assert sample.status is Sample.Status.COMPLETED and sample.reward == 1.0 and not sample.remove_sample
    assert sample.group_index == 3 and sample.index == 0 and sample.metadata["polar_task"] == {"demo": "x"}


MUTATIONS = {
    "tokens shifted by one": lambda s: setattr(s, "tokens", [*s.tokens[1:], 0]),
    "loss mask shifted by one": lambda s: setattr(s, "loss_mask", [0, *s.loss_mask[:-1]]),
    "logprobs shifted by one": lambda s: setattr(s, "rollout_log_probs", [0.0, *s.rollout_log_probs[:-1]]),
    "a response token dropped": lambda s: (setattr(s, "tokens", s.tokens[:-1]), setattr(s, "response_length", 8)),
    "re-tokenized tool output": lambda s: setattr(s, "tokens", [*s.tokens[:7], 999, *s.tokens[9:]]),
    "weight versions dropped": lambda s: setattr(s, "weight_versions", []),
    "versions swapped between spans": lambda s: setattr(s, "weight_versions", s.weight_versions[::-1]),
    "logprobs dropped": lambda s: setattr(s, "rollout_log_probs", None),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_the_contract_check_catches_a_broken_sample(name: str) -> None:
    [sample] = fill_miles_group(_group(1), [_result(0)], 0, _settings())
    MUTATIONS[name](sample)
    with pytest.raises(AssertionError):
        assert_faithful(sample, _trace())


def test_sessions_that_did_not_complete_are_kept_out_of_the_loss() -> None:
    group = _group(3)
    empty = SessionResult(session_id="s2", task_id="t", status=SessionStatus.ERROR, reason="init failed",
                          metadata={"sample_index": 2})
    fill_miles_group(group, [_result(0, SessionStatus.TIMEOUT), _result(1, SessionStatus.ERROR), empty], 0,
                     _settings())
    timeout, error, never = group
    assert timeout.status is Sample.Status.ABORTED and error.status is Sample.Status.FAILED
    for sample in (timeout, error):
        assert sample.remove_sample and sample.loss_mask == [0] * 9
        assert sample.tokens == [*PROMPT, *TURN1, *TOOL, *TURN2]  # kept for inspection, never trained
    assert never.status is Sample.Status.FAILED and never.remove_sample and never.metadata["polar"]["placeholder"]
    assert (never.tokens, never.response_length, never.loss_mask, never.rollout_log_probs) == ([0, 0], 1, [0], [0.0])
    for sample in group:
        sample.validate()


def test_miles_reward_key_and_extra_chains() -> None:
    sub = Trace(prompt_ids=[1], response_ids=[2], loss_mask=[1], response_logprobs=[-0.5], reward=0.0)
    [sample] = fill_miles_group(_group(1), [_result(0, traces=[sub, _trace()])], 0, _settings(reward_key="score"))
    assert sample.reward == {"score": 1.0} and sample.get_reward_value(SimpleNamespace(reward_key="score")) == 1.0
    assert sample.metadata["polar_extra_traces"] == 1 and sample.response_length == 9


def _runner(outcomes: dict[int, list[SessionStatus]], versions: tuple[Any, Any] = (5, 6),
            retries: dict[int, list[SessionStatus]] | None = None) -> tuple[Any, list[list[int]]]:
    """Session results per group, by the index of the group's first sample (``retries``: from its second run on);
    records what each round ran."""
    rounds: list[list[int]] = []

    async def run(groups: list[list[Sample]], rollout_id: int) -> list[list[SessionResult]]:
        again = {i for r in rounds for i in r}
        rounds.append([g[0].index for g in groups])
        return [[_result(i, s, versions=versions) for i, s in enumerate(
            (retries or {}).get(g[0].index, outcomes[g[0].index]) if g[0].index in again else outcomes[g[0].index])]
            for g in groups]
    return run, rounds


C, T = SessionStatus.COMPLETED, SessionStatus.TIMEOUT


def test_a_partial_group_is_recycled_and_the_batch_refilled() -> None:
    source = DataSource([_group(2, 0, 0), _group(2, 1, 10), _group(2, 2, 20)])
    seen: list[list[Any]] = []
    add = source.add_samples
    source.add_samples = lambda groups: (seen.extend([[(s.tokens, s.status, s.remove_sample, s.metadata)
                                                        for s in g] for g in groups]), add(groups))  # type: ignore
    run, rounds = _runner({0: [C, C], 10: [C, T], 20: [C, C]}, retries={10: [C, C]})
    groups, metrics = asyncio.run(assemble_batch(source, 2, 7, _settings(), run, 7))
    # back to the data source as a prompt (Miles's fully-async rollout does the same), which serves it again first
    assert seen == [[([], Sample.Status.PENDING, False, {"polar_task": {"demo": "x"}})] * 2]
    assert rounds == [[0, 10], [10]] and [g[0].index for g in groups] == [0, 10] and source.buffer == []
    assert [s.group_index for g in groups for s in g] == [0, 0, 1, 1] and all(len(g) == 2 for g in groups)
    assert [g[0].index for g in source.groups] == [20]
    assert metrics["polar/recycled_partial_groups"] == 1.0
    args = SimpleNamespace(n_samples_per_prompt=2, rollout_batch_size=2, reward_key=None)
    assert default_rewards(args, [s for g in groups for s in g]) == [0.0] * 4  # Miles's own GRPO takes it whole


def test_drop_discards_the_partial_group() -> None:
    source = DataSource([_group(2, 0, 0), _group(2, 1, 10)])
    run, _ = _runner({0: [T, C], 10: [C, C]})
    groups, metrics = asyncio.run(assemble_batch(source, 1, 0, _settings(partial_groups="drop"), run, None))
    assert [g[0].index for g in groups] == [10] and source.buffer == []
    assert metrics["polar/dropped_partial_groups"] == 1.0


@pytest.mark.parametrize(("fraction", "kept"), [(0.5, True), (0.75, False)])
def test_keep_holds_the_group_size_when_enough_sessions_completed(fraction: float, kept: bool) -> None:
    source = DataSource([_group(2, 0, 0), _group(2, 1, 10)])
    run, rounds = _runner({0: [C, T], 10: [C, C]}, retries={0: [C, C]})
    settings = _settings(partial_groups="keep", min_complete_fraction=fraction)
    [group], metrics = asyncio.run(assemble_batch(source, 1, 0, settings, run, None))
    assert group[0].index == 0 and len(group) == 2 and rounds == ([[0]] if kept else [[0], [0]])
    assert [s.remove_sample for s in group] == [False, kept] and metrics["polar/kept_partial_groups"] == kept


def test_stale_groups_are_recycled_and_staleness_recorded() -> None:
    group = _group(2, 0)
    fill_miles_group(group, [_result(0, versions=(3, 9)), _result(1, versions=(9, 9))], 0, _settings())
    verdict = judge_group(group, _settings(max_staleness=2), current_version=10)
    assert (verdict.keep, verdict.reason, verdict.oldest_version, verdict.staleness) == (False, "stale", 3, 7)
    assert judge_group(group, _settings(max_staleness=7), 10).keep
    assert judge_group(group, _settings(), 10).keep  # no bound: only reported

    source = DataSource([_group(2, 0, 0)])
    run, _ = _runner({0: [C, C]}, versions=(8, 9))
    [kept], metrics = asyncio.run(assemble_batch(source, 1, 10, _settings(max_staleness=2), run, 10))
    assert [s.metadata["polar"]["policy_staleness"] for s in kept] == [2, 2] and metrics["polar/staleness_max"] == 2
    source = DataSource([_group(2, 0, 0)])
    run, rounds = _runner({0: [C, C]}, versions=(6, 9))
    with pytest.raises(RuntimeError, match="0 of 1 prompt groups passed after 4 rounds"):
        asyncio.run(assemble_batch(source, 1, 10, _settings(max_staleness=2), run, 10))
    assert rounds == [[0]] * 4 and len(source.buffer) == 1  # recycled every round, then refused


def test_unnumbered_versions_are_not_judged() -> None:
    group = _group(1)
    fill_miles_group(group, [_result(0, versions=("stock", None))], 0, _settings())
    assert group[0].weight_versions == ["stock", "None"]
    assert judge_group(group, _settings(max_staleness=0), 10).staleness is None


def _filled(rewards: list[float], statuses: list[SessionStatus], group_index: int) -> list[Sample]:
    group = _group(len(rewards), group_index)
    results = [_result(i, s, reward=r) for i, (r, s) in enumerate(zip(rewards, statuses, strict=True))]
    return fill_miles_group(group, results, group_index, _settings())


def test_leave_one_out_matches_miles_grpo_on_whole_groups() -> None:
    samples = _filled([1.0, 0.0, 0.0, 1.0], [C] * 4, 0) + _filled([1.0, 1.0, 0.0, 0.0], [C] * 4, 1)
    args = SimpleNamespace(n_samples_per_prompt=4, rollout_batch_size=2, reward_key=None, advantage_estimator="grpo",
                           rewards_normalization=True, grpo_std_normalization=False)
    raw, loo = leave_one_out_rewards(args, samples)
    assert raw == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert loo == pytest.approx([a * 4 / 3 for a in default_rewards(args, samples)])  # RLOO = n/(n-1) x GRPO


def test_leave_one_out_keeps_failed_sessions_out_of_the_baseline() -> None:
    samples = _filled([1.0, 0.0, 1.0], [C, C, T], 0)
    args = SimpleNamespace(reward_key=None, advantage_estimator="grpo", grpo_std_normalization=False)
    _, loo = leave_one_out_rewards(args, samples)
    assert loo == [1.0, -1.0, 0.0]  # the timed-out session is no one's baseline and gets nothing
    _, std = leave_one_out_rewards(SimpleNamespace(**{**vars(args), "grpo_std_normalization": True}), samples)
    assert std == pytest.approx([1.0 / (2 ** 0.5 / 2 + 1e-6), -1.0 / (2 ** 0.5 / 2 + 1e-6), 0.0])
    assert leave_one_out_rewards(SimpleNamespace(advantage_estimator="ppo"), samples)[1] == [1.0, 0.0, 1.0]  # raw
    assert leave_one_out_rewards(args, _filled([1.0, 0.0], [C, T], 1))[1] == [0.0, 0.0]  # alone: no signal


def test_settings_read_miles_args_and_the_environment() -> None:
    env = {"POLAR_SERVER_URL": "http://h:1", "POLAR_ADMIN_TOKEN": "t", "POLAR_PARTIAL_GROUPS": "keep",
           "POLAR_MIN_COMPLETE_FRACTION": "0.5", "POLAR_STAMP_VERSIONS": "1"}
    s = MilesBridgeSettings.from_env(env, SimpleNamespace(max_weight_staleness=3, reward_key="score"))
    assert (s.partial_groups, s.min_complete_fraction, s.max_staleness, s.stamp_versions, s.reward_key) == (
        "keep", 0.5, 3, True, "score")
    assert MilesBridgeSettings.from_env({**env, "POLAR_MAX_STALENESS": "1"}, None).max_staleness == 1
    with pytest.raises(RuntimeError, match="POLAR_ADMIN_TOKEN"):
        MilesBridgeSettings.from_env({"POLAR_SERVER_URL": "http://h:1"})


@pytest.mark.slow
async def test_miles_rollout_against_a_real_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken group is dropped and the batch refilled from the data source; the stamped version reaches every
    span; the samples line up with the capture journal."""
    from polar_gym.fleet import InferenceSettings, local_fleet
    from polar_gym.gateway.config import GatewayPools
    from polar_gym.journal import read_session
    from polar_gym.merge.cli import find_journals
    from polar_gym.schema import PrepareAction, RuntimeSpec
    from polar_gym.tasks import DEMO_TASKS

    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")

    def task(demo: str, **runtime: Any) -> dict[str, Any]:
        request = DEMO_TASKS[demo].to_request(harness="pi", model_name="policy")
        if runtime:
            request = request.model_copy(update={"runtime": RuntimeSpec(**{**request.runtime.model_dump(),
                                                                           **runtime})})
        return request.model_dump(mode="json", exclude={"task_id", "num_samples"})

    broken = task("demo-slugify", prepare=[PrepareAction(type="exec", command="exit 7")])
    source = DataSource([[Sample(group_index=0, index=0, metadata={"polar_task": broken})],
                         [Sample(group_index=1, index=10 + i, metadata={"polar_task": task("demo-calc-add")})
                          for i in range(2)]])
    async with local_fleet(tmp_path / "fleet", InferenceSettings(), pools=GatewayPools(run_slots=2)) as (url, token):
        for key, value in {"POLAR_SERVER_URL": url, "POLAR_ADMIN_TOKEN": token, "POLAR_PARTIAL_GROUPS": "drop",
                           "POLAR_STAMP_VERSIONS": "1"}.items():
            monkeypatch.setenv(key, value)
        args = SimpleNamespace(rollout_batch_size=1, max_weight_staleness=0)
        [group] = await asyncio.to_thread(generate_rollout, args, 7, source)
    assert [s.index for s in group] == [10, 11] and source.buffer == [] and source.groups == []

    records = {}
    for journal in find_journals([tmp_path / "fleet" / "capture"]):
        session = read_session(journal)
        records[session[0].session_id] = [r for r in session if not r.side_request]
    for sample in group:
        sample.validate()
        polar = sample.metadata["polar"]
        calls = records[polar["session_id"]]
        assert sample.status is Sample.Status.COMPLETED and sample.reward == 1.0 and not sample.remove_sample
        assert sample.tokens[:polar["prompt_length"]] == calls[0].prompt_ids
        response = sample.tokens[polar["prompt_length"]:]
        assert [t for t, m in zip(response, sample.loss_mask, strict=True) if m] == [
            t for c in calls for t in c.response_ids]
        assert [lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if m] == [
            lp for c in calls for lp in c.response_logprobs]
        assert {c.policy_version for c in calls} == {7} and set(sample.weight_versions) == {"7"}
        assert len(sample.weight_versions) == len(polar["spans"]) >= 2 and polar["policy_staleness"] == 0
