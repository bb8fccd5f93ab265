"""Sessions that must not be scored, end to end through a real gateway and real local (bubblewrap) sandboxes (issue
35): a harness whose CLI is not there (exit 127 with zero model calls was COMPLETED with reward 0) ends ERROR with
the infrastructure cause ``harness_not_run``; an evaluator whose reward is not a finite number ends the session
ERROR with cause ``invalid_reward``, and its result still travels as JSON a reader takes back."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from polar_gym.causes import HARNESS_NOT_RUN, INVALID_REWARD, error_cause
from polar_gym.evaluate.base import EvalContext, Evaluator
from polar_gym.schema import AgentSpec, EvalResult, EvaluatorSpec, SessionResult, SessionSpec, SessionStatus
from tests._waiting import BOUND
from tests.gateway._gateway_kit import LiveGateway, MakeGateway

S = SessionStatus
HERE = "tests.gateway.test_never_scored"


class InfiniteEvaluator(Evaluator):
    """Hands back a reward that skipped validation (``model_construct``), as a careless user evaluator could."""

    name: ClassVar[str] = "test_infinite"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        return EvalResult.model_construct(reward=float(self.config.get("reward", "inf")), passed=None,
                                          per_trace_rewards=None, details={})


async def _run(gw: LiveGateway, spec: SessionSpec) -> SessionResult:
    gw.node.submit(spec)
    result = await gw.node.wait(spec.session_id, BOUND)
    # what the rollout server reads: the result must survive the wire (inf went out as null and never came back)
    return SessionResult.model_validate_json(result.model_dump_json())


def _agent(gw: LiveGateway, harness: str, **config: Any) -> SessionSpec:
    spec = gw.spec()
    return spec.model_copy(update={"agent": AgentSpec(harness=harness, model_name="policy", config=config)})


@pytest.mark.parametrize(("harness", "config", "code", "says"), [
    ("codex", {"cli_path": "/opt/polar-not-installed/codex"}, 127,
     "polar relay: cannot run /opt/polar-not-installed/codex: No such file or directory"),
    ("shell", {"command": "polar-not-installed-cli --run"}, 127, "polar-not-installed-cli: not found"),
    ("shell", {"command": ["./agent.sh"], "files": {"agent.sh": "#!/bin/sh\necho never\n"}}, 126,
     "polar relay: cannot run ./agent.sh: Permission denied"),
], ids=["codex-missing", "sh-command-not-found", "not-executable"])
async def test_a_harness_that_never_ran_is_an_infrastructure_error_not_a_zero(
        make_gateway: MakeGateway, harness: str, config: dict[str, Any], code: int, says: str) -> None:
    gw = await make_gateway()
    result = await _run(gw, _agent(gw, harness, **config))
    assert result.status is S.ERROR and result.evaluation is None, result.reason
    assert error_cause(result) == HARNESS_NOT_RUN
    reason = result.reason or ""
    assert reason.startswith(f"{HARNESS_NOT_RUN}: the harness command exited {code} before any model call")
    assert says in reason
    assert result.metadata["harness"]["exit_code"] == code and result.metadata["artifacts"]["completions"] == 0


async def test_a_harness_that_called_the_model_ran_whatever_it_exited_with(make_gateway: MakeGateway) -> None:
    """127 after a model call is the agent's own exit (a tool it ran was missing): scored as before."""
    gw = await make_gateway()
    result = await _run(gw, gw.spec(calls=1, exit_code=127))
    assert result.status is S.COMPLETED and result.evaluation is not None and result.evaluation.reward == 0.0
    assert error_cause(result) is None and result.metadata["artifacts"]["completions"] == 1


@pytest.mark.parametrize("reward", ["inf", "nan", "-inf", "1e300"])
async def test_a_reward_that_is_not_a_finite_number_ends_the_session_error(make_gateway: MakeGateway,
                                                                          reward: str) -> None:
    gw = await make_gateway()
    spec = gw.spec(calls=1).model_copy(update={"evaluator": EvaluatorSpec(
        strategy=f"{HERE}:InfiniteEvaluator", config={"reward": reward})})
    result = await _run(gw, spec)
    assert result.status is S.ERROR and error_cause(result) == INVALID_REWARD
    assert (result.reason or "").startswith(f"{INVALID_REWARD}: evaluator 'test_infinite' gave reward "
                                            f"{float(reward)!r}, not finite or beyond ±1e+09")
    assert result.evaluation is None
    assert result.trajectory is not None and result.trajectory.traces  # the traces are kept, with no reward
    assert all(t.reward is None for t in result.trajectory.traces)
