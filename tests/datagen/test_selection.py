"""Empty generations, the one retry, rejection sampling and the repository split, on real built trajectories."""

from __future__ import annotations

import pytest

from polar_gym.datagen import (
    attempt_of,
    dataset_requests,
    final_attempts,
    is_empty_generation,
    judge,
    rejection_sample,
    retry_plan,
    retry_requests,
    sample_key,
    stratified_split,
)
from polar_gym.schema import SessionResult, SessionStatus, Trace, Trajectory
from tests.datagen._datagen_kit import EXAMPLE, empty_result, session_result, template


# -- empty generations ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["blank", "no_trace", "error"])
def test_sessions_where_the_model_produced_nothing_are_empty(kind):
    assert is_empty_generation(empty_result("t", kind=kind))


def test_a_session_with_a_tool_call_or_text_is_not_empty():
    assert not is_empty_generation(session_result("t"))
    # a timeout after real turns keeps its partial traces and is not empty either
    assert not is_empty_generation(session_result("t", status=SessionStatus.TIMEOUT))


def test_a_tool_call_alone_counts_as_output_and_reasoning_alone_too():
    def one(message: dict) -> SessionResult:
        trace = Trace(prompt_ids=[1], response_ids=[7], loss_mask=[1], response_messages=[message])
        return SessionResult(session_id="s", task_id="t", status=SessionStatus.COMPLETED,
                             trajectory=Trajectory(session_id="s", traces=[trace]))
    call = {"id": "c", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    assert not is_empty_generation(one({"role": "assistant", "content": None, "tool_calls": [call]}))
    assert not is_empty_generation(one({"role": "assistant", "content": "", "reasoning_content": "hmm"}))
    assert is_empty_generation(one({"role": "assistant", "content": [{"type": "text", "text": " "}]}))
    # a trace built elsewhere without messages: sampled tokens are the evidence
    bare = Trace(prompt_ids=[1], response_ids=[7, 8], loss_mask=[0, 1])
    result = SessionResult(session_id="s", task_id="t", status=SessionStatus.COMPLETED,
                           trajectory=Trajectory(session_id="s", traces=[bare]))
    assert not is_empty_generation(result)
    masked = bare.model_copy(update={"loss_mask": [0, 0]})
    assert is_empty_generation(result.model_copy(update={"trajectory": Trajectory(session_id="s", traces=[masked])}))


# -- the one retry ----------------------------------------------------------------------------------------------------
def test_retry_plan_names_empty_first_attempts_only():
    results = [session_result("a", 0), empty_result("a", 1), empty_result("b", 0, kind="error"),
               session_result("b", 1, reward=0.0, passed=False)]
    cancelled = empty_result("c", 0, kind="error").model_copy(update={"status": SessionStatus.CANCELLED})
    assert retry_plan([*results, cancelled]) == [("a", 1), ("b", 0)]


def test_a_retried_sample_is_never_retried_again_even_when_the_retry_is_empty():
    tasks = dataset_requests(template(), str(EXAMPLE), limit=2)
    first = [session_result("acme__calc-1", 0), empty_result("acme__calc-1", 1),
             empty_result("globex__mathkit-7", 0), empty_result("globex__mathkit-7", 1, kind="error")]
    plan = retry_plan(first)
    assert plan == [("acme__calc-1", 1), ("globex__mathkit-7", 0), ("globex__mathkit-7", 1)]
    retries = retry_requests(plan, tasks)
    assert [(r.task_id, r.num_samples) for r in retries] == [("acme__calc-1--retry", 1),
                                                               ("globex__mathkit-7--retry", 2)]
    meta = retries[1].metadata.model_dump()
    assert (meta["datagen_attempt"], meta["retry_of"], meta["retry_samples"]) == (2, "globex__mathkit-7", [0, 1])
    assert meta["repo"] == "globex/mathkit" and meta["oracle"]  # the task itself is unchanged
    # the gateway copies the task metadata into each result; every retry comes back empty
    second = [empty_result("acme__calc-1--retry", 0, task_meta=retries[0].metadata.model_dump()),
              empty_result("globex__mathkit-7--retry", 0, task_meta=meta),
              empty_result("globex__mathkit-7--retry", 1, task_meta=meta)]
    assert [attempt_of(r) for r in second] == [2, 2, 2]
    assert [sample_key(r) for r in second] == [("acme__calc-1", 1), ("globex__mathkit-7", 0), ("globex__mathkit-7", 1)]
    assert retry_plan([*first, *second]) == []


def test_final_attempts_replace_the_empty_first_attempt_by_its_retry():
    meta = {"datagen_attempt": 2, "retry_of": "a", "retry_samples": [1]}
    retry = session_result("a--retry", 0, task_meta=meta)
    finals = final_attempts([session_result("a", 0), empty_result("a", 1), retry])
    assert [(r.task_id, r.metadata["sample_index"], attempt_of(r)) for r in finals] == [("a", 0, 1), ("a", 1, 2)]
    assert finals[1].session_id == retry.session_id and not is_empty_generation(finals[1])


def test_a_result_without_metadata_finds_its_sample_in_the_session_id():
    lost = SessionResult(session_id="task-x-3-0123abcd", task_id="task-x", status=SessionStatus.ERROR, reason="lost")
    assert sample_key(lost) == ("task-x", 3) and retry_plan([lost]) == [("task-x", 3)]


def test_retry_requests_refuse_an_unknown_task():
    with pytest.raises(ValueError, match="unknown task"):
        retry_requests([("ghost", 0)], dataset_requests(template(), str(EXAMPLE), limit=1))


# -- rejection sampling -----------------------------------------------------------------------------------------------
def mixed() -> list[SessionResult]:
    return [session_result("a", 0), session_result("a", 1, reward=0.0, passed=False), empty_result("a", 2),
            session_result("b", 0, reward=0.5, passed=None), session_result("b", 1, status=SessionStatus.TIMEOUT),
            session_result("b", 2, reward=1.0, passed=False)]


def test_rejection_sampling_keeps_only_passing_sessions_by_default():
    selection = rejection_sample(mixed())
    assert [v.result.session_id for v in selection.accepted] == [mixed()[0].session_id]
    assert selection.failures == [] and len(selection.dropped) == 5
    reasons = [v.reason for v in selection.dropped]
    assert reasons == ["evaluator: not passed (reward 0)", "empty generation", "reward 0.5 below 1", "status TIMEOUT",
                       "evaluator: not passed (reward 1)"]


def test_keep_failures_labels_failed_sessions_but_still_drops_empty_ones():
    selection = rejection_sample(mixed(), keep_failures=True)
    assert len(selection.accepted) == 1 and len(selection.failures) == 4
    assert all(not v.passed and not v.empty for v in selection.failures)
    assert [v.reason for v in selection.dropped] == ["empty generation"]


def test_min_reward_sets_the_bar():
    assert judge(session_result("b", 0, reward=0.5, passed=None), min_reward=0.5).passed
    assert len(rejection_sample(mixed(), min_reward=0.5).accepted) == 2


# -- split ------------------------------------------------------------------------------------------------------------
REPOS = {"getmoto/moto": 18, "python/mypy": 10, "conan-io/conan": 3, "pydantic/pydantic": 3, "iterative/dvc": 5,
         "pandas-dev/pandas": 10, "dask/dask": 3}
RECORDS = [(repo, i) for repo, n in REPOS.items() for i in range(n)]


def test_the_split_keeps_each_repository_on_one_side_and_is_deterministic():
    train, test = stratified_split(RECORDS, key=lambda r: r[0], test_fraction=0.1, seed=7)
    assert sorted(train + test) == sorted(RECORDS)
    assert {r[0] for r in train}.isdisjoint({r[0] for r in test}) and test
    assert abs(len(test) - 0.1 * len(RECORDS)) <= max(REPOS.values())
    assert (train, test) == stratified_split(list(RECORDS), key=lambda r: r[0], test_fraction=0.1, seed=7)
    assert train == [r for r in RECORDS if r in train]  # input order kept
    seeds = {tuple(sorted({r[0] for r in stratified_split(RECORDS, lambda r: r[0], 0.1, s)[1]})) for s in range(12)}
    assert len(seeds) > 1  # the seed matters


def test_the_split_gets_close_to_the_fraction():
    train, test = stratified_split(RECORDS, key=lambda r: r[0], test_fraction=0.5, seed=1)
    assert abs(len(test) - len(RECORDS) / 2) <= 3 and train


@pytest.mark.parametrize("fraction", [0.01, 0.99])
def test_two_repositories_put_one_on_each_side(fraction):
    records = [("big", i) for i in range(50)] + [("small", 0)]
    train, test = stratified_split(records, key=lambda r: r[0], test_fraction=fraction, seed=0)
    assert len({r[0] for r in train}) == 1 and len({r[0] for r in test}) == 1


def test_edge_fractions_and_a_single_repository():
    assert stratified_split(RECORDS, lambda r: r[0], 0.0, 0) == (RECORDS, [])
    assert stratified_split(RECORDS, lambda r: r[0], 1.0, 0) == ([], RECORDS)
    only = [("one", i) for i in range(5)]
    assert stratified_split(only, lambda r: r[0], 0.2, 0) == (only, [])
    with pytest.raises(ValueError, match="test_fraction"):
        stratified_split(RECORDS, lambda r: r[0], 1.5, 0)


def test_final_attempts_is_idempotent():
    meta = {"datagen_attempt": 2, "retry_of": "a", "retry_samples": [1]}
    once = final_attempts([empty_result("a", 1), session_result("a--retry", 0, task_meta=meta)])
    assert final_attempts(once) == once and once[0].metadata["retry_task_id"] == "a--retry"
