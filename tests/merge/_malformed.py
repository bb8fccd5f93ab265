"""What each malformed-tool-call policy promises a trainer, checked on a captured session whose completion
``bad_id`` sampled one malformed block (shared by the oracle test and the real-engine test)."""

from __future__ import annotations

from polar_gym.merge import apply_rewards, build_trajectory
from polar_gym.merge.fidelity import run_fidelity
from polar_gym.schema import BuilderSpec, CompletionSession, EvalResult
from tests.merge._sessions import check_invariants


def check_policy(session: CompletionSession, bad_id: str, builder: str, policy: str) -> None:
    """Build ``session`` under ``policy``, score it as solved (outcome 1.0), and check the marked trace's reward,
    mask and flags, the clean traces, and the fidelity counts."""
    check_invariants(session, build_trajectory(session, BuilderSpec(strategy=builder)))
    built = build_trajectory(session, BuilderSpec(strategy=builder, config={"malformed_tool_calls": policy}))
    scored = apply_rewards(built, EvalResult(reward=1.0, passed=True))
    (marked,) = [t for t in scored.traces if bad_id in t.metadata["completion_ids"]]
    clean = [t for t in scored.traces if t is not marked]
    assert marked.metadata["tool_call_parse"] == "malformed"
    assert marked.metadata["malformed_tool_call_policy"] == policy
    (where,) = marked.metadata["malformed_tool_calls"]
    (span,) = [s for s in marked.metadata["spans"] if s["completion_id"] == bad_id]
    assert where["completion_id"] == bad_id and where["located"] is True
    assert span["start"] <= where["start"] < where["end"] <= span["end"]
    assert all(t.metadata["tool_call_parse"] == "ok" and t.reward == 1.0 for t in clean)
    reply_mask = marked.loss_mask[span["start"]:span["end"]]
    if policy == "reward_zero_keep":  # zero reward, still trainable: the model must learn not to do it
        assert marked.reward == 0.0 and marked.metadata["reward_reason"] == "malformed_tool_call"
        assert marked.metadata["outcome_reward"] == 1.0 and set(reply_mask) == {1}
    elif policy == "mask":  # the reply is not trained; the reward stays
        assert marked.reward == 1.0 and set(reply_mask) == {0}
        assert marked.metadata["masked_tokens_malformed"] == len(reply_mask)
        sampled = sum(len(r.response_ids) for r in session.completions
                      if r.completion_id in marked.metadata["completion_ids"])
        assert sum(marked.loss_mask) == sampled - len(reply_mask)
    else:
        assert marked.reward == 1.0 and set(reply_mask) == {1} and "reward_reason" not in marked.metadata
    assert len(marked.response_logprobs) == len(marked.response_ids) == len(marked.loss_mask)
    fidelity = run_fidelity([scored])
    assert (fidelity.malformed_tool_calls, fidelity.malformed_traces) == (1, 1)
    assert fidelity.malformed_policies == {policy: 1}
    assert f"malformed tool calls 1 in 1 traces ({policy} 1)" in fidelity.line()
