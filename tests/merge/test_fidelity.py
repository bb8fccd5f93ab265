"""The token-fidelity totals a launch reports (polar_gym.merge.fidelity), on sessions whose numbers are known."""

from __future__ import annotations

from polar_gym.merge.base import MergeConfig
from polar_gym.merge.fidelity import Fidelity, run_fidelity
from polar_gym.merge.prefix_merging import prefix_merging
from polar_gym.schema import Trace, Trajectory
from tests.merge._sessions import EOT, rec, session

CONFIG = MergeConfig(end_of_turn_ids=[EOT])


def test_a_session_with_a_drift_a_retry_and_a_side_request():
    sess = session(
        rec(0, [1, 2], [10, EOT], prompt_mode="token_in"),
        rec(1, [1, 2, 10, EOT, 50], [11, 12, EOT], prompt_mode="token_in"),  # extends call 0: one chain
        rec(2, [1, 2, 10, EOT, 50, 11, 13, EOT, 51], [14, EOT], prompt_mode="chat"),  # call 1 re-rendered: drift
        rec(3, [7, 8], [20, EOT], side_request=True, prompt_mode="token_in"),  # a side request (title)
        rec(4, [1, 2, 10, EOT, 50, 11, 13, EOT, 51, 14, EOT, 52], [15, EOT], prompt_mode="chat",
            response_logprobs=[]),  # a reply without logprobs
    )
    traj = prefix_merging(sess, CONFIG)
    fidelity = run_fidelity([traj, None])
    assert (fidelity.sessions, fidelity.traces) == (2, 3)
    assert fidelity.breaks == {"drift": 1, "new_context": 1}
    assert fidelity.trainable_tokens == (2 + 3) + (2 + 2) + 2 and fidelity.masked_tokens == 1 + 1  # bridges 50, 52
    assert fidelity.prompt_tokens == 2 + 9 + 2
    assert (fidelity.side_request_traces, fidelity.without_logprobs, fidelity.not_contiguous) == (1, 1, 0)
    assert fidelity.prompt_modes == {"token_in": 3, "chat": 2}
    line = fidelity.line()
    assert "11 trainable / 2 masked tokens in 3 traces (1.50 per session)" in line
    assert "new chains by cause: drift 1, new_context 1" in line and "contiguity ok" in line
    assert "prompt mode token_in 3, chat 2 (calls)" in line


def test_superseded_retries_are_counted_not_trained():
    sess = session(rec(0, [1, 2], [10, EOT], started=0.0), rec(1, [1, 2], [11, EOT], started=5.0),
                   rec(2, [1, 2, 11, EOT, 50], [12, EOT], started=9.0))
    kept = prefix_merging(sess, MergeConfig(end_of_turn_ids=[EOT], keep_superseded=True))
    fidelity = run_fidelity([kept])
    assert fidelity.superseded == 1 and fidelity.traces == 1  # the kept superseded trace is not a training trace
    assert fidelity.trainable_tokens == 4 and "1 superseded retries" in fidelity.line()


def test_a_trace_that_breaks_nemo_rls_contiguity_rule_is_flagged():
    broken = Trace(prompt_ids=[1], response_ids=[10, EOT, 11, EOT], loss_mask=[1, 1, 1, 1],
                   metadata={"spans": [{"start": 0, "end": 3}, {"start": 1, "end": 4}]})
    fidelity = run_fidelity([Trajectory(session_id="s", traces=[broken])])
    assert fidelity.not_contiguous == 1 and "contiguity BROKEN in 1 traces" in fidelity.line()
    assert Fidelity.model_validate(fidelity.model_dump()) == fidelity  # what summary totals carry, read back
