"""What mutation testing found loosely pinned in the builders (issue 20): the side-request flag both ways, a
configured builder's config taking effect, the "empty" bookkeeping, the default end-of-turn ids, the causes given
to new chains (with the compaction thresholds at their boundary), which attempt a retry replaces, the builder
called without a config, and the chain numbers of kept superseded attempts."""

from __future__ import annotations

import pytest

from polar_gym.merge import QWEN_END_OF_TURN_IDS, build_trajectory
from polar_gym.merge.base import MergeConfig, partition
from polar_gym.merge.per_request import per_request
from polar_gym.merge.prefix_merging import prefix_merging
from polar_gym.registry import BUILDERS
from polar_gym.schema import BuilderSpec
from tests.merge._sessions import EOT, merged, rec, session

CFG = MergeConfig(end_of_turn_ids=(EOT,))


# ---------------------------------------------------------------------------------------------- merge/base


def test_the_default_end_of_turn_ids_are_qwens():
    assert QWEN_END_OF_TURN_IDS == (151645, 151643)  # <|im_end|>, <|endoftext|>
    assert MergeConfig().end_of_turn_ids == QWEN_END_OF_TURN_IDS == MergeConfig.from_dict(None).end_of_turn_ids


@pytest.mark.parametrize("include", [True, False])
def test_side_requests_are_trained_or_excluded_as_configured(include):
    records = (rec(0, [1], [10, EOT]), rec(1, [200], [30, EOT], side_request=True),
               rec(2, [1, 10, EOT, 50], [11, EOT]))
    config = MergeConfig(end_of_turn_ids=(EOT,), include_side_requests=include)
    for builder in (prefix_merging, per_request):
        traj = builder(session(*records), config)
        trained = [c for t in traj.traces for c in t.metadata["completion_ids"]]
        if include:
            assert "c1" in trained and traj.diagnostics["excluded"] == {}
            assert [t.metadata["side_request"] for t in traj.traces if "c1" in t.metadata["completion_ids"]] == [True]
        else:
            assert "c1" not in trained and traj.diagnostics["excluded"] == {"side_request": ["c1"]}


def test_a_configured_builder_uses_its_config_not_the_defaults():
    records = (rec(0, [1, 2, 3], [10, 11, EOT]), rec(1, [1, 2, 3, 10, 12, EOT, 50], [20, EOT]),
               rec(2, [1, 2, 3, 10, 12, EOT, 50], [21, EOT], started=25),
               rec(3, [500], [40, EOT], side_request=True))
    sess = session(*records)
    config = {"end_of_turn_ids": [EOT], "on_rerender": "merge", "keep_superseded": True,
              "include_side_requests": False}
    assert MergeConfig.from_dict(config) == MergeConfig(end_of_turn_ids=(EOT,), on_rerender="merge",
                                                        keep_superseded=True, include_side_requests=False)
    traj = build_trajectory(sess, BuilderSpec(strategy="prefix_merging", config=config))
    assert traj.diagnostics["rerender_merged"] == 1 and traj.diagnostics["breaks"] == {}  # merge mode, EOT 99
    assert traj.diagnostics["excluded"] == {"side_request": ["c3"]}
    assert traj.diagnostics["superseded"] == ["c1"] and traj.traces[-1].metadata["superseded"] is True
    default = build_trajectory(sess, BuilderSpec(strategy="prefix_merging"))
    assert default.diagnostics["rerender_merged"] == 0 and "c3" in default.traces[-1].metadata["completion_ids"]
    with pytest.raises(ValueError, match="unknown builder config keys"):
        MergeConfig.from_dict({"end_of_turn": [EOT]})


@pytest.mark.parametrize(("prompt", "response"), [([1], []), ([], [10, EOT])])
def test_an_ok_faithful_record_without_prompt_or_reply_is_counted_as_empty(prompt, response):
    empty = rec(1, prompt, response, response_logprobs=[])
    usable, excluded = partition(session(rec(0, [1], [10, EOT]), empty), CFG)
    assert [r.completion_id for r in usable] == ["c0"] and excluded == {"empty": ["c1"]}
    assert merged(rec(0, [1], [10, EOT]), empty).diagnostics["excluded"] == {"empty": ["c1"]}


def test_a_reply_without_logprobs_is_built_into_its_chain_and_marked():
    traj = merged(rec(0, [1], [10, EOT]), rec(1, [1, 10, EOT, 50], [11, 12, EOT], response_logprobs=[]),
                  rec(2, [1, 10, EOT, 50, 11, 12, EOT, 51], [13, EOT]))
    (t,) = traj.traces
    assert t.metadata["completion_ids"] == ["c0", "c1", "c2"]
    assert t.response_ids == [10, EOT, 50, 11, 12, EOT, 51, 13, EOT] and t.loss_mask == [1, 1, 0, 1, 1, 1, 0, 1, 1]
    assert [(s["start"], s["end"]) for s in t.metadata["spans"]] == [(0, 2), (3, 6), (7, 9)]
    assert t.response_logprobs == [] and t.metadata["without_logprobs"] == ["c1"]


def test_the_token_counts_every_builder_reports():
    """Trainable tokens are the sampled ones; masked ones are the bridges (tool results, the next user turn)."""
    records = (rec(0, [1, 2], [10, EOT]), rec(1, [1, 2, 10, EOT, 50, 51, 52], [11, 12, EOT]))
    for builder in (prefix_merging, per_request):
        traj = builder(session(*records), CFG)
        mask = [m for t in traj.traces for m in t.loss_mask]
        assert traj.diagnostics["trainable_tokens"] == sum(mask) == 5
        assert traj.diagnostics["masked_tokens"] == mask.count(0) == (3 if builder is prefix_merging else 0)
        assert traj.diagnostics["prompt_tokens"] == sum(len(t.prompt_ids) for t in traj.traces)


# ------------------------------------------------------------------------------------ merge/prefix_merging


def causes(traj):
    return [t.metadata["chain_cause"] for t in traj.traces]


@pytest.mark.parametrize(("third", "cause"), [
    ([1, 2, 3, 4, 10, EOT, 60, 61, 62], "history_rewritten"),  # an earlier turn edited: longer, not an extension
    ([1, 2, 3, 4, 10, EOT, 60], "history_rewritten"),  # as long as the chain's last prompt
    ([1, 2, 70, 71, 72, 73, 74, 75], "history_rewritten"),  # longer, shares exactly half the first prompt
    ([1, 9, 70, 71, 72, 73, 74, 75], "new_context"),  # longer, shares less than half of it
    ([1, 2, 60], "compaction"),  # shorter, shares exactly half the first prompt (the boundary)
    ([1, 9, 60], "new_context"),  # shares less than half of it
    ([7, 2, 3, 4], "new_context"),  # another system prompt
    ([1, 2, 3, 4, 10, EOT, 50], "fork"),  # the chain's last prompt again, after its answer was used
])
def test_a_new_chain_is_given_its_cause(third, cause):
    records = (rec(0, [1, 2, 3, 4], [10, EOT]), rec(1, [1, 2, 3, 4, 10, EOT, 50], [11, EOT]),
               rec(2, third, [12, EOT], started=30))
    if cause == "fork":  # both answers are gone on from: two conversations, not a retry
        records = (*records, rec(3, [*third, 11, EOT, 52], [13, EOT], started=40),
                   rec(4, [*third, 12, EOT, 53], [14, EOT], started=50))
    traj = merged(*records)
    assert causes(traj) == ["first", cause]
    assert traj.diagnostics["breaks"] == {cause: 1}


def test_which_attempt_a_retry_replaces():
    p2 = [1, 10, EOT, 50]
    attempts = (rec(1, p2, [20, EOT], started=10, seconds=2), rec(2, p2, [21, EOT], started=15, seconds=2),
                rec(3, p2, [22, EOT], started=20))
    # the conversation goes on from the middle attempt: the other two were thrown away, listed in journal order
    traj = merged(rec(0, [1], [10, EOT]), *attempts, rec(4, [*p2, 21, EOT, 51], [23, EOT], started=30))
    assert [t.metadata["completion_ids"] for t in traj.traces] == [["c0", "c2", "c4"], ["c3"]]
    assert causes(traj) == ["first", "fork"]  # the latest attempt is kept: nothing came after it to replace it
    assert traj.diagnostics["superseded"] == ["c1"]
    # going on from the last attempt: both earlier ones were replaced
    last = merged(rec(0, [1], [10, EOT]), *attempts, rec(4, [*p2, 22, EOT, 51], [23, EOT], started=30))
    assert [t.metadata["completion_ids"] for t in last.traces] == [["c0", "c3", "c4"]]
    assert last.diagnostics["superseded"] == ["c1", "c2"]


def test_the_builder_called_without_a_config_uses_the_defaults():
    eot = QWEN_END_OF_TURN_IDS[0]
    sess = session(rec(0, [1], [10, eot]), rec(1, [1, 10, eot, 50], [11, eot]))
    for builder in (prefix_merging, BUILDERS.get("prefix_merging")):
        (t,) = builder(sess).traces
        assert t.metadata["completion_ids"] == ["c0", "c1"] and t.loss_mask == [1, 1, 0, 1, 1]


def test_per_request_without_a_config_gives_one_unmerged_trace_per_completion():
    eot = QWEN_END_OF_TURN_IDS[0]
    sess = session(rec(0, [1], [10, eot]), rec(1, [1, 10, eot, 50], [11, eot]), rec(2, [7], [8, 9], side_request=True))
    traj = per_request(sess)
    assert [t.metadata["completion_ids"] for t in traj.traces] == [["c0"], ["c1"], ["c2"]]  # side requests kept
    assert {k: traj.diagnostics[k] for k in ("completions", "chains", "completions_merged", "breaks")} == {
        "completions": 3, "chains": 3, "completions_merged": 0, "breaks": {}}


def test_kept_superseded_attempts_are_numbered_after_the_chains():
    p2 = [1, 10, EOT, 50]
    records = (rec(0, [1], [10, EOT]), rec(1, p2, [20, EOT], started=10, seconds=2),
               rec(2, p2, [21, EOT], started=15, seconds=2), rec(3, p2, [22, EOT], started=20),
               rec(4, [*p2, 22, EOT, 51], [23, EOT], started=30), rec(5, [300], [40, EOT], started=40))
    traj = merged(*records, config=MergeConfig(end_of_turn_ids=(EOT,), keep_superseded=True))
    assert [(t.metadata["chain"], t.metadata["completion_ids"], t.metadata["chain_cause"]) for t in traj.traces] == [
        (0, ["c0", "c3", "c4"], "first"), (1, ["c5"], "new_context"),
        (2, ["c1"], "superseded"), (3, ["c2"], "superseded")]
