"""The TRL bridge (polar_gym.bridges.trl): sessions as rows of TRL's rollout output, token for token, and the
bridge's own rules. TRL's GRPOTrainer itself trains through a real fleet in tests/bridges/test_trl_vllm.py (vLLM,
what TRL received equals trajectories.jsonl, weights pushed and audited) and in docs/trainers/trl.md's example
(the oracle engine playing pi's multi-turn sessions: tests/docs/test_doc_commands.py checks its output)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from polar_gym.bridges.trl import (
    PolarRollout,
    TRLBridgeSettings,
    polar_reward,
    prompt_runs,
    rollout_output,
    session_row,
)
from polar_gym.schema import EvalResult, SamplingOverride, SessionResult, SessionStatus, Trace, Trajectory
from polar_gym.tasks import DEMO_TASKS

END = 151645
SETTINGS = TRLBridgeSettings(server_url="http://127.0.0.1:9", admin_token="t")


def _result(traces: list[Trace], status: SessionStatus = SessionStatus.COMPLETED,
            reward: float | None = 1.0) -> SessionResult:
    return SessionResult(session_id="s0", task_id="t", status=status,
                         trajectory=Trajectory(session_id="s0", traces=traces),
                         evaluation=None if reward is None else EvalResult(reward=reward))


def _trace(prompt: list[int], response: list[int], mask: list[int], versions: list[int] | None = None) -> Trace:
    meta = {} if versions is None else {"policy_versions": versions}
    return Trace(prompt_ids=prompt, response_ids=response, loss_mask=mask,
                 response_logprobs=[-(i + 1) / 10 for i in range(len(response))], metadata=meta)


def test_prompt_runs_group_trls_repeated_prompts_in_order() -> None:
    assert prompt_runs(["a", "a", "b", "b", "a"]) == [("a", 2), ("b", 2), ("a", 1)]
    assert prompt_runs([]) == []


def test_a_multi_turn_session_is_one_row_split_where_sampling_starts() -> None:
    trace = _trace([5, 6, 7], [10, 11, 12, 13, 14, END], [1, 1, 0, 0, 1, 1])
    row = session_row(_result([trace], reward=0.75), END)
    assert row.prompt_ids == [5, 6, 7] and row.completion_ids == [10, 11, 12, 13, 14, END]
    assert row.env_mask == [1, 1, 0, 0, 1, 1]  # the tool output between the turns: context, not trained
    assert row.logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]  # aligned with completion_ids, untouched
    assert row.reward == 0.75 and row.status == "COMPLETED" and row.extra_chains == 0


def test_an_unfinished_session_gives_a_row_with_no_reward_and_nothing_trained() -> None:
    trace = _trace([5], [10, 11], [1, 1])
    timed_out = session_row(_result([trace], SessionStatus.TIMEOUT, reward=1.0), END)
    assert timed_out.completion_ids == [10, 11] and timed_out.env_mask == [0, 0] and timed_out.reward is None
    no_call = session_row(SessionResult(session_id="s1", task_id="t", status=SessionStatus.ERROR), END)
    assert (no_call.prompt_ids, no_call.completion_ids, no_call.env_mask) == ([END], [END], [0])
    assert no_call.reward is None and no_call.status == "ERROR"
    unscored = session_row(_result([trace], reward=None), END)
    assert unscored.reward is None and unscored.env_mask == [1, 1]  # completed, no evaluator: TRL skips its reward


def test_a_session_with_a_sub_agent_gives_its_main_chain() -> None:
    main = _trace([1, 2], [3, 4, 5, 6], [1, 1, 0, 1], versions=[3, 4])
    sub = _trace([1, 9], [7], [1])
    row = session_row(_result([sub, main]), END)
    assert row.prompt_ids == [1, 2] and row.completion_ids == [3, 4, 5, 6] and row.extra_chains == 1
    with pytest.raises(ValueError, match="2 chains"):
        session_row(_result([sub, main]), END, extra_chains="fail")


def test_rollout_output_has_trls_keys_and_the_reward_fields() -> None:
    rows = [session_row(_result([_trace([1], [2, END], [1, 1])], reward=r), END) for r in (1.0, 0.0)]
    out = rollout_output(rows)
    assert out["prompt_ids"] == [[1], [1]] and out["completion_ids"] == [[2, END], [2, END]]
    assert out["env_mask"] == [[1, 1], [1, 1]] and out["polar_reward"] == [1.0, 0.0]
    assert polar_reward(["x", "y"], polar_reward=out["polar_reward"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="rollout_func"):
        polar_reward(["x"])
    with pytest.raises(ValueError, match="1 rewards for 2"):
        polar_reward(["x", "y"], polar_reward=[1.0])


def test_tasks_are_named_by_their_instruction() -> None:
    task = DEMO_TASKS["demo-calc-add"].to_request(harness="pi", model_name="policy")
    with pytest.raises(ValueError, match="same instruction"):
        PolarRollout([task, task.model_copy(update={"task_id": "other"})], SETTINGS)
    rollout = PolarRollout([task], SETTINGS)
    args = SimpleNamespace(temperature=0.7, top_p=0.9, top_k=0)
    request = rollout._request(task.instruction, 3, 5, args)
    assert request.num_samples == 3 and request.metadata.group_id == request.task_id != task.task_id
    assert request.metadata.rollout_step == 5
    assert request.metadata.sampling == SamplingOverride(temperature=0.7, top_p=0.9, top_k=-1)  # TRL's values
    greedy = task.model_copy(update={"metadata": task.metadata.model_copy(
        update={"sampling": SamplingOverride(temperature=0.0)})})
    assert PolarRollout([greedy], SETTINGS)._request(task.instruction, 1, 0, args).metadata.sampling == \
        SamplingOverride(temperature=0.0)  # the task's own sampling wins
    harness = PolarRollout([task], SETTINGS.model_copy(update={"sampling": "harness"}))
    assert harness._request(task.instruction, 1, 0, args).metadata.sampling is None
    with pytest.raises(ValueError, match="no task has the instruction"):
        rollout._request("write me a poem", 1, 0, args)


def _trainer(out: Path, processes: int = 1, index: int = 0) -> SimpleNamespace:
    """The attributes of a TRL GRPOTrainer the bridge reads."""
    return SimpleNamespace(args=SimpleNamespace(output_dir=str(out), temperature=1.0, top_p=1.0, top_k=0),
                           state=SimpleNamespace(global_step=3), eos_token_ids=[END],
                           accelerator=SimpleNamespace(num_processes=processes, process_index=index,
                                                       is_main_process=index == 0))


def test_a_refused_batch_keeps_its_traces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = DEMO_TASKS["demo-calc-add"].to_request(harness="pi", model_name="policy")
    settings = SETTINGS.model_copy(update={"weight_sync": "none", "extra_chains": "fail"})
    rollout = PolarRollout([task], settings)
    two_chains = _result([_trace([1], [2, END], [1, 1]), _trace([1, 9], [3, END], [1, 1])])

    async def run(requests: list[Any]) -> dict[str, list[SessionResult]]:
        return {r.task_id: [two_chains.model_copy(update={"task_id": r.task_id})] for r in requests}

    monkeypatch.setattr(rollout, "_run", run)
    with pytest.raises(ValueError, match="2 chains"):
        rollout([task.instruction], _trainer(tmp_path))
    lines = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert [(t["trace_index"], t["step"], t["response_ids"]) for t in lines] == [(0, 4, [2, END]), (1, 4, [3, END])]
    # another training process writes a file of its own; rows come back in TRL's order
    rollout.settings = settings.model_copy(update={"extra_chains": "main"})
    output = rollout([task.instruction], _trainer(tmp_path, processes=2, index=1))
    assert output["completion_ids"] == [[2, END]] and (tmp_path / "trajectories.rank1.jsonl").exists()


def test_the_bridge_needs_the_server_address() -> None:
    with pytest.raises(RuntimeError, match="POLAR_SERVER_URL and POLAR_ADMIN_TOKEN"):
        TRLBridgeSettings.from_env({})
    assert TRLBridgeSettings.from_env({"POLAR_SERVER_URL": "http://h:1", "POLAR_ADMIN_TOKEN": "x"},
                                      weight_sync="none").weight_sync == "none"


async def test_a_bridge_hook_called_inside_an_event_loop_still_runs() -> None:
    from polar_gym.bridges.common import run_sync

    assert run_sync(lambda: asyncio.sleep(0, result=3)) == 3  # a notebook or an async trainer calling rollout_func
