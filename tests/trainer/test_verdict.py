"""The GRPO step verdict: a step that cannot teach the policy anything (equal rewards, a scripted engine's tokens,
an engine that does not run the trained weights) is reported as not trained. Traces are built by the real builder
(prefix_merging) from completion records as each engine records them."""

from __future__ import annotations

import pytest

from polar_gym.merge import build_trajectory
from polar_gym.report.training import MISMATCH, NO_SIGNAL, NO_TRACES, NOT_POLICY_SAMPLED, trained_summary
from polar_gym.schema import CompletionRecord, CompletionSession, Trace
from polar_gym.trainer.verdict import StepVerdict, sampled_by_policy, step_verdict


def trace(engine: str, *, version: int | None = 0, logprobs: bool = True, session: str = "s0") -> Trace:
    """One session of two calls (a chain) as the proxy records it on ``engine``, through prefix_merging."""
    prompt, first, tool, second = [1, 2, 3], [10, 11], [20], [12, 13]
    records = [CompletionRecord(completion_id=f"{session}-c{i}", session_id=session, index=i, provider="openai_chat",
                                engine=engine, server=f"{engine}://x", policy_version=version, prompt_ids=p,
                                response_ids=r, response_logprobs=[-0.5] * len(r) if logprobs else [],
                                finish_reason="stop", prompt_mode="token_in", started_at=float(i))
               for i, (p, r) in enumerate([(prompt, first), (prompt + first + tool, second)])]
    (out,) = build_trajectory(CompletionSession(session_id=session, completions=records)).traces
    return out


def test_oracle_traces_are_not_sampled_by_the_policy_and_vllm_ones_are() -> None:
    oracle, vllm = trace("oracle"), trace("vllm")
    assert oracle.metadata["engine"] == "oracle" and oracle.response_logprobs  # the oracle makes logprobs up
    assert not sampled_by_policy(oracle)
    assert sampled_by_policy(vllm)
    assert sampled_by_policy(trace("vllm", version=None))  # a user's server: no version before the first push
    assert not sampled_by_policy(trace("vllm", logprobs=False))  # nothing to train against
    assert sampled_by_policy(Trace(prompt_ids=[1], response_ids=[2], loss_mask=[1], response_logprobs=[-1.0]))


def test_a_chain_that_crosses_into_the_oracle_is_not_policy_sampled() -> None:
    mixed = trace("vllm")
    mixed.metadata["spans"][1]["engine"] = "oracle"
    assert mixed.metadata["engine"] == "vllm" and not sampled_by_policy(mixed)


def test_equal_rewards_in_every_group_is_no_signal() -> None:
    verdict = step_verdict([1.0, 1.0, 0.0, 0.0], ["a", "a", "b", "b"], [trace("vllm")] * 4)
    assert verdict == StepVerdict(False, (NO_SIGNAL,), verdict.message)
    assert "every group's rewards were equal (no signal)" in verdict.message
    # one group with a spread is enough to learn from
    assert step_verdict([1.0, 1.0, 0.0, 1.0], ["a", "a", "b", "b"], [trace("vllm")] * 4).trained


def test_the_issue_run_on_the_oracle_lists_every_reason() -> None:
    """The issue's run: reward 1.000 everywhere, the oracle's tokens, mean |Δ logprob| 10.98 nats."""
    verdict = step_verdict([1.0, 1.0], ["t", "t"], [trace("oracle", session="a"), trace("oracle", session="b")],
                           mismatch=10.98, max_mismatch=0.5)
    assert not verdict.trained
    assert verdict.reasons == (NO_SIGNAL, NOT_POLICY_SAMPLED, MISMATCH)
    assert "2 of 2 traces were not sampled by the policy (oracle)" in verdict.message
    assert "audit/logprob_abs_diff_mean = 10.98 nats > trainer.max_mismatch 0.5" in verdict.message
    assert "trainer.engine_dtype" in verdict.message and "trainer.rollout_correction" in verdict.message
    other = step_verdict([1.0, 0.0], ["t", "t"], [trace("vllm")], mismatch=3e-6, max_mismatch=1e-7,
                         mismatch_metric="rollout_corr/k3_kl")
    assert "rollout_corr/k3_kl = 3e-06 > trainer.max_mismatch 1e-07" in other.message


def test_oracle_traces_with_a_reward_spread_still_do_not_train() -> None:
    verdict = step_verdict([1.0, 0.0], ["t", "t"], [trace("oracle"), trace("oracle")])
    assert verdict.reasons == (NOT_POLICY_SAMPLED,)


def test_mismatch_above_the_bound_does_not_train_and_at_the_bound_does() -> None:
    traces, rewards, groups = [trace("vllm")] * 2, [1.0, 0.0], ["t", "t"]
    assert step_verdict(rewards, groups, traces, mismatch=0.51, max_mismatch=0.5).reasons == (MISMATCH,)
    assert step_verdict(rewards, groups, traces, mismatch=0.5, max_mismatch=0.5).trained
    assert step_verdict(rewards, groups, traces, mismatch=None, max_mismatch=0.5).trained  # not measured
    assert step_verdict(rewards, groups, traces, mismatch=9.0, max_mismatch=None).trained  # no bound


def test_a_normal_step_trains() -> None:
    verdict = step_verdict([1.0, 0.0, 0.5, 0.5, 1.0, 0.0], ["a", "a", "b", "b", "c", "c"], [trace("vllm")] * 6,
                           mismatch=2e-5, max_mismatch=0.5)
    assert verdict == StepVerdict(True, (), "trained")


def test_no_trace_does_not_train_and_misaligned_inputs_are_an_error() -> None:
    assert step_verdict([], [], []).reasons == (NO_TRACES,)
    with pytest.raises(ValueError, match="2 rewards for 1 groups"):
        step_verdict([1.0, 0.0], ["a"], [])


def test_rows_summarise_as_n_of_m_steps_trained() -> None:
    rows = [{"step": s, "trained": False, "not_trained_reasons": [NO_SIGNAL]} for s in (1, 2, 3)]
    assert trained_summary(rows) == "GRPO: 0 of 3 steps trained — every group's rewards were equal (no signal)"
    rows[2] = {"step": 3, "trained": False, "not_trained_reasons": [NO_SIGNAL, MISMATCH]}
    rows.append({"step": 4, "trained": True, "not_trained_reasons": []})
    summary = trained_summary(rows)
    assert summary is not None and summary.startswith("GRPO: 1 of 4 steps trained — every group's rewards were "
                                                      "equal (no signal); the trainer's logprobs were far")
    assert summary.endswith("trainer.max_mismatch) (1 step)")
    assert trained_summary(rows[3:]) is None
    assert trained_summary([{"step": 1, "loss": 0.3}]) is None  # SFT, or a run older than the verdict
