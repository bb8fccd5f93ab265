"""The verl bridge: a session's prefix-merged trace becomes verl's AgentLoopOutput token for token (ids, mask
boundaries, logprobs aligned with their ids, evaluator reward), rows fit verl's padded lengths without shifting a
token, untrained rows are flagged; then, where verl is installed, the agent loop class runs against a rollout server
and verl's own post-processing pads its output into the batch tensors at the right positions."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar_gym.bridges import verl as bridge
from polar_gym.bridges.verl import EXTRA_FIELDS, VerlBridgeSettings, run_session, session_task, task_spec, verl_row
from polar_gym.result_codec import frame_results, pack
from polar_gym.schema import EvalResult, SessionResult, SessionStatus, Trace, Trajectory
from polar_gym.tasks import DEMO_TASKS
from tests.merge._sessions import EOT, merged, rec

VERL_MISSING = ("verl is not installed: `bash scripts/setup.sh` puts verl 0.9.1's agent loop (pyproject's "
                "[tool.polar_gym] verl-overlay) in .venv/verl-overlay")
#: verl beside the venv (its pins would downgrade transformers): scripts/setup.sh links it here
VERL_OVERLAY = Path(__file__).resolve().parents[2] / ".venv" / "verl-overlay"
FILLER = 151643

# a two-turn session: system+user prompt, a sampled tool call, the tool's output (environment tokens), a sampled answer
PROMPT = [1, 2, 3, 4, 5]
TURN0 = [10, 11, 12, EOT]
TOOL = [20, 21, 22]
TURN1 = [30, 31, 32, 33, EOT]


def _logprob(token: int) -> float:
    """What tests.merge._sessions.rec records for ``token``: a logprob that names its token, so a shift shows."""
    return -0.01 * (token % 50) - 0.001


def _trajectory(policy_versions: tuple[int, int] = (4, 5)) -> Trajectory:
    first = rec(0, PROMPT, TURN0, policy_version=policy_versions[0])
    second = rec(1, [*PROMPT, *TURN0, *TOOL], TURN1, policy_version=policy_versions[1])
    return merged(first, second)


def _result(traj: Trajectory | None = None, status: SessionStatus = SessionStatus.COMPLETED,
            reward: float | None = 0.75, reason: str | None = None) -> SessionResult:
    traj = _trajectory() if traj is None else traj
    for trace in traj.traces:
        trace.reward = None  # the session's evaluation is the reward
    return SessionResult(session_id="sess-1", task_id="task-1", status=status, reason=reason, trajectory=traj,
                         evaluation=EvalResult(reward=reward) if reward is not None else None,
                         timings={"total": 12.5, "postrun": 1.5})


def _row(result: SessionResult | None = None, **kw: Any) -> bridge.VerlRow:
    return verl_row(_result() if result is None else result, **{"prompt_length": 64, "response_length": 64,
                                                                "filler_id": FILLER, **kw})


def _verl_agent_loop() -> Any:
    """verl's agent loop module, from the overlay when set-up made one (after the venv's own packages on the path);
    the test skips, saying how to get it, when there is none."""
    if VERL_OVERLAY.is_dir() and str(VERL_OVERLAY) not in sys.path:
        sys.path.append(str(VERL_OVERLAY))
    return pytest.importorskip("verl.experimental.agent_loop.agent_loop", reason=VERL_MISSING)


# -- the conversion, token for token --------------------------------------------------------------------------------
def test_a_multi_turn_session_becomes_the_trace_token_for_token() -> None:
    result = _result()
    (trace,) = result.trajectory.traces  # type: ignore[union-attr]
    row = _row(result)
    assert row.prompt_ids == PROMPT == trace.prompt_ids
    assert row.response_ids == [*TURN0, *TOOL, *TURN1] == trace.response_ids  # model + tool tokens, in order
    assert row.response_mask == [1] * len(TURN0) + [0] * len(TOOL) + [1] * len(TURN1) == trace.loss_mask
    # mask boundaries: the tool output starts right after the first turn's end token and ends before the second
    assert row.response_mask.index(0) == len(TURN0) and row.response_ids[len(TURN0)] == TOOL[0]
    assert row.response_mask[len(TURN0) + len(TOOL)] == 1 and row.response_ids[len(TURN0) + len(TOOL)] == TURN1[0]
    # every sampled token carries the engine's logprob of that very token
    for token, mask, logprob in zip(row.response_ids, row.response_mask, row.response_logprobs, strict=True):
        if mask:
            assert logprob == _logprob(token)
    assert row.response_logprobs == trace.response_logprobs
    assert row.reward_score == 0.75 and row.num_turns == 4  # prompt, call, tool output, answer
    assert row.metrics == {"generate_sequences": 12.5, "compute_score": 1.5}
    extra = row.extra_fields
    assert tuple(extra) == EXTRA_FIELDS and extra["polar_masked"] is False and extra["polar_reason"] is None
    assert extra["polar_session_id"] == "sess-1" and extra["polar_task_id"] == "task-1"
    assert extra["polar_policy_versions"] == ["4", "5"]
    assert [(s["start"], s["end"], s["policy_version"]) for s in extra["polar_spans"]] == [
        (0, len(TURN0), 4), (len(TURN0) + len(TOOL), len(TURN0) + len(TOOL) + len(TURN1), 5)]


def test_a_long_response_is_cut_at_response_length_with_every_kept_token_in_place() -> None:
    full = _row()
    for limit in (len(TURN0) - 1, len(TURN0) + 1, len(TURN0) + len(TOOL) + 2):
        row = _row(response_length=limit)
        assert row.prompt_ids == PROMPT
        assert row.response_ids == full.response_ids[:limit]
        assert row.response_mask == full.response_mask[:limit]
        assert row.response_logprobs == full.response_logprobs[:limit]
        assert row.reward_score == 0.75 and row.extra_fields["polar_truncated"] is True
        assert row.extra_fields["polar_dropped_tokens"] == len(full.response_ids) - limit
        assert row.extra_fields["polar_overflow"] == "response" and not row.extra_fields["polar_masked"]
    exact = _row(response_length=len(full.response_ids))
    assert exact.response_ids == full.response_ids and exact.extra_fields["polar_truncated"] is False


def test_overflow_mask_keeps_a_long_response_untrained() -> None:
    row = _row(response_length=len(TURN0) + 1, overflow="mask")
    assert row.response_mask == [0] * (len(TURN0) + 1) and row.reward_score == 0.0
    assert row.response_ids == [*TURN0, TOOL[0]]  # still exactly the trace's tokens, only untrained
    assert row.extra_fields["polar_masked"] and "exceeds response_length" in row.extra_fields["polar_reason"]


def test_a_prompt_longer_than_prompt_length_is_never_cut() -> None:
    row = _row(prompt_length=len(PROMPT) - 1)
    assert row.prompt_ids == [FILLER] and row.response_ids == [FILLER] and row.response_mask == [0]
    assert row.reward_score == 0.0 and row.extra_fields["polar_masked"]
    assert row.extra_fields["polar_overflow"] == "prompt"
    assert _row(prompt_length=len(PROMPT)).prompt_ids == PROMPT


@pytest.mark.parametrize("status", [SessionStatus.TIMEOUT, SessionStatus.ERROR, SessionStatus.CANCELLED])
def test_a_session_that_did_not_complete_is_kept_untrained(status: SessionStatus) -> None:
    row = _row(_result(status=status, reason="deadline"))
    assert row.response_ids == [*TURN0, *TOOL, *TURN1]  # partial trace kept, exact
    assert row.response_mask == [0] * len(row.response_ids) and row.reward_score == 0.0
    assert row.extra_fields["polar_masked"] and row.extra_fields["polar_status"] == status.value
    assert "deadline" in row.extra_fields["polar_reason"]


def test_a_completed_session_without_a_reward_is_not_trained() -> None:
    row = _row(_result(reward=None))
    assert row.response_mask == [0] * len(row.response_ids) and row.reward_score == 0.0
    assert row.extra_fields["polar_reward_missing"] and row.extra_fields["polar_masked"]


def test_a_session_without_a_model_call_gives_a_one_token_flagged_row() -> None:
    result = SessionResult(session_id="s", task_id="t", status=SessionStatus.ERROR, reason="init: prepare failed")
    row = _row(result)
    assert (row.prompt_ids, row.response_ids, row.response_mask, row.response_logprobs) == ([FILLER], [FILLER], [0],
                                                                                            [0.0])
    assert row.reward_score == 0.0 and row.extra_fields["polar_reason"] == "init: prepare failed"
    assert tuple(row.extra_fields) == EXTRA_FIELDS


def test_a_session_with_a_sub_agent_chain_gives_its_main_chain() -> None:
    main = _trajectory().traces[0]
    sub = Trace(prompt_ids=[7, 8], response_ids=[9], loss_mask=[1], response_logprobs=[-0.3])
    row = _row(_result(Trajectory(session_id="sess-1", traces=[sub, main], builder="prefix_merging")))
    assert row.response_ids == main.response_ids and row.extra_fields["polar_extra_chains"] == 1
    with pytest.raises(ValueError, match="2 chains"):
        _row(_result(Trajectory(session_id="sess-1", traces=[sub, main])), extra_chains="fail")


# -- tasks ------------------------------------------------------------------------------------------------------------
def _spec() -> dict[str, Any]:
    request = DEMO_TASKS["demo-calc-add"].to_request(harness="pi", model_name="policy")
    return request.model_dump(mode="json", exclude={"task_id", "num_samples"})


def test_the_task_comes_from_extra_info_as_json_or_from_a_column() -> None:
    spec = _spec()
    assert task_spec({"extra_info": {"index": 3, "polar_task": json.dumps(spec)}}) == spec
    assert task_spec({"polar_task": spec, "extra_info": {}}) == spec
    with pytest.raises(ValueError, match="no 'polar_task'"):
        task_spec({"extra_info": {"index": 0}})


def test_each_sample_is_one_session_grouped_by_verls_uid_with_verls_sampling() -> None:
    params = {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    task = session_task(_spec(), params, uid="u-1")
    assert task.num_samples == 1 and task.task_id.startswith("verl-") and task.metadata.group_id == "verl-u-1"
    assert task.metadata.sampling is not None
    assert task.metadata.sampling.overrides() == {"temperature": 0.7, "top_p": 0.9, "top_k": -1}
    assert session_task(_spec(), params, uid="u-1").task_id != task.task_id
    own = {**_spec(), "metadata": {"sampling": {"temperature": 0.0}}}
    assert session_task(own, params).metadata.sampling.overrides() == {"temperature": 0.0}  # type: ignore[union-attr]
    assert session_task(_spec(), params, sampling="harness").metadata.sampling is None


def test_the_settings_come_from_the_environment() -> None:
    with pytest.raises(RuntimeError, match="POLAR_SERVER_URL and POLAR_ADMIN_TOKEN"):
        VerlBridgeSettings.from_env({})
    settings = VerlBridgeSettings.from_env({"POLAR_SERVER_URL": "http://x", "POLAR_ADMIN_TOKEN": "t",
                                            "POLAR_VERL_OVERFLOW": "mask", "POLAR_TIMEOUT_SECONDS": "5"})
    assert settings.overflow == "mask" and settings.timeout_seconds == 5.0 and settings.sampling == "trainer"


def test_the_module_imports_without_verl() -> None:
    with pytest.raises(AttributeError):
        getattr(bridge, "NoSuchLoop")  # noqa: B009 - the module's __getattr__


# -- a fake rollout server (unit tests only) ------------------------------------------------------------------------
class FakeServer:
    """The task routes the bridge calls (its results packed); each submitted task ends with ``result`` (or
    never, ``hang``)."""

    def __init__(self, result: SessionResult, hang: bool = False) -> None:
        self.result, self.hang = result, hang
        self.tasks: dict[str, dict[str, Any]] = {}
        self.cancelled: list[str] = []
        self.released: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        parts = request.url.path.strip("/").split("/")
        if request.method == "POST" and parts == ["tasks"]:
            body = json.loads(request.content)
            self.tasks[body["task_id"]] = body
            return httpx.Response(200, json={"task_id": body["task_id"]})
        if request.method == "POST" and parts[-1] == "cancel":
            self.cancelled.append(parts[1])
            return httpx.Response(200, json={})
        if request.method == "POST" and parts[-1] == "release":
            self.released.append(parts[1])
            return httpx.Response(200, json={"task_id": parts[1], "retention": "keep", "results_changed": 0})
        task_id = parts[1]
        assert parts[-1] == "results", request.url  # RolloutClient.results reads the packed route
        if self.hang:
            return httpx.Response(200, content=frame_results([], {"status": "RUNNING", "cursor": None}))
        blob = pack(self.result.model_copy(update={"task_id": task_id}))
        return httpx.Response(200, content=frame_results([blob], {"status": "COMPLETED", "cursor": [1.0, "s"]}))

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


_SETTINGS = VerlBridgeSettings(server_url="http://polar", admin_token="t")


async def test_a_task_is_submitted_and_its_session_returned() -> None:
    server = FakeServer(_result())
    task = session_task(_spec(), {"temperature": 1.0}, uid="g")
    result = await run_session(task, _SETTINGS, server.transport())
    assert result.task_id == task.task_id and list(server.tasks) == [task.task_id]
    assert server.tasks[task.task_id]["num_samples"] == 1


async def test_a_session_past_the_timeout_is_cancelled_and_comes_back_as_an_error() -> None:
    server = FakeServer(_result(), hang=True)
    task = session_task(_spec(), {"temperature": 1.0})
    settings = _SETTINGS.model_copy(update={"timeout_seconds": 1e-6})
    result = await run_session(task, settings, server.transport())
    assert result.status is SessionStatus.ERROR and server.cancelled == [task.task_id]
    row = verl_row(result, prompt_length=8, response_length=8, filler_id=FILLER)
    assert row.extra_fields["polar_masked"] and "was cancelled" in row.extra_fields["polar_reason"]


# -- against verl's own classes ---------------------------------------------------------------------------------------
@functools.cache
def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    from polar_gym.assets import tokenizer_dir

    if not (tokenizer_dir() / ".complete").exists():
        pytest.fail("the Qwen tokenizer is needed: run `bash scripts/setup.sh`")
    return AutoTokenizer.from_pretrained(str(tokenizer_dir()))


def _verl_config(prompt_length: int, response_length: int) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": prompt_length,
                                                               "response_length": response_length}}})


def _agent_loop(tokenizer: Any, prompt_length: int, response_length: int) -> Any:
    agent_loop = _verl_agent_loop()
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    return bridge.PolarAgentLoop(
        trainer_config=agent_loop.DictConfigWrap(_verl_config(prompt_length, response_length)), server_manager=None,
        tokenizer=tokenizer, processor=None, dataset_cls=RLHFDataset,
        data_config=agent_loop.DictConfigWrap(OmegaConf.create({})), hf_model_type="qwen3")


def _verl_worker(tokenizer: Any, prompt_length: int, response_length: int) -> Any:
    """verl's AgentLoopWorker without its Ray actor setup: the fields its post-processing reads."""
    agent_loop = _verl_agent_loop()
    worker = object.__new__(agent_loop.AgentLoopWorker)
    worker.rollout_config = _verl_config(prompt_length, response_length).actor_rollout_ref.rollout
    worker.tokenizer, worker.processor, worker.mm_processor_kwargs = tokenizer, None, {}
    worker.reward_loop_worker_handles, worker.distillation_enabled = None, False
    return worker


async def _verl_batch(outputs: list[Any], tokenizer: Any, prompt_length: int, response_length: int) -> Any:
    worker = _verl_worker(tokenizer, prompt_length, response_length)
    padded = [await worker._agent_loop_postprocess(o, False, raw_prompt=[{"role": "user", "content": "x"}])
              for o in outputs]
    return worker._postprocess(padded)


@pytest.mark.slow  # importing verl (Ray, tensordict) and the tokenizer take seconds
async def test_the_agent_loop_output_lands_in_verls_padded_batch_at_the_right_positions() -> None:
    _verl_agent_loop()
    tokenizer = _tokenizer()
    P, R = 8, 16  # verl's prompt_length and response_length
    server = FakeServer(_result())
    loop = _agent_loop(tokenizer, P, R)
    loop.transport = server.transport()
    failed = _agent_loop(tokenizer, P, R)
    failed.transport = FakeServer(_result(status=SessionStatus.TIMEOUT, reason="deadline")).transport()
    sample = {"uid": "u-7", "extra_info": {"index": 0, "polar_task": json.dumps(_spec())}}
    env = {"POLAR_SERVER_URL": "http://polar", "POLAR_ADMIN_TOKEN": "t"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        output = await loop.run({"temperature": 0.6, "top_p": 1.0, "top_k": -1}, **sample)
        masked = await failed.run({"temperature": 0.6}, **sample)
    (submitted,) = server.tasks.values()
    assert submitted["metadata"]["group_id"] == "verl-u-7" and submitted["metadata"]["sampling"]["temperature"] == 0.6
    assert output.response_ids == [*TURN0, *TOOL, *TURN1] and output.reward_score == 0.75
    assert output.extra_fields["polar_session_id"] == "sess-1" and output.metrics.generate_sequences == 12.5

    batch = await _verl_batch([output, masked], tokenizer, P, R)
    n = len(output.response_ids)
    prompts, responses = batch.batch["prompts"], batch.batch["responses"]
    assert prompts.shape == (2, P) and responses.shape == (2, R)
    assert prompts[0, P - len(PROMPT):].tolist() == PROMPT  # left-padded: the prompt ends where the response starts
    assert prompts[0, :P - len(PROMPT)].tolist() == [tokenizer.pad_token_id] * (P - len(PROMPT))
    assert responses[0, :n].tolist() == output.response_ids  # right-padded, not shifted
    assert batch.batch["input_ids"][0].tolist() == [*prompts[0].tolist(), *responses[0].tolist()]
    assert batch.batch["response_mask"][0, :n].tolist() == output.response_mask
    assert batch.batch["response_mask"][0, n:].tolist() == [0] * (R - n)
    rollout = batch.batch["rollout_log_probs"][0]
    for i, token in enumerate(output.response_ids):
        if output.response_mask[i]:
            assert rollout[i].item() == pytest.approx(_logprob(token), abs=1e-6)  # float32
    assert batch.batch["attention_mask"][0].tolist() == [0] * (P - len(PROMPT)) + [1] * (len(PROMPT) + n) + [0] * (
        R - n)
    scores = batch.batch["rm_scores"]
    assert scores[0, n - 1].item() == 0.75 and scores[0].sum().item() == 0.75  # on the last response token
    assert batch.batch["response_mask"][1].sum().item() == 0 and scores[1].sum().item() == 0.0
    assert list(batch.non_tensor_batch["polar_masked"]) == [False, True]
    assert batch.non_tensor_batch["polar_policy_versions"][0] == ["4", "5"]


@pytest.mark.slow
async def test_a_truncated_row_fills_verls_response_exactly() -> None:
    agent_loop = _verl_agent_loop()
    tokenizer = _tokenizer()
    R = len(TURN0) + 2
    row = _row(response_length=R, prompt_length=len(PROMPT))
    output = agent_loop.AgentLoopOutput(
        prompt_ids=row.prompt_ids, response_ids=row.response_ids, response_mask=row.response_mask,
        response_logprobs=row.response_logprobs, reward_score=row.reward_score, num_turns=row.num_turns,
        metrics=agent_loop.AgentLoopMetrics(**row.metrics), extra_fields=dict(row.extra_fields))
    batch = await _verl_batch([output], tokenizer, len(PROMPT), R)
    assert batch.batch["responses"][0].tolist() == [*TURN0, *TOOL[:2]]
    assert batch.batch["response_mask"][0].tolist() == [1] * len(TURN0) + [0, 0]
    assert batch.batch["prompts"][0].tolist() == PROMPT


# -- a real fleet: pi in bubblewrap, the oracle engine -----------------------------------------------------------
@pytest.mark.slow
async def test_the_agent_loop_trains_exactly_what_the_engine_sampled(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _verl_agent_loop()
    from polar_gym.assets import tokenizer_dir
    from polar_gym.fleet import InferenceSettings, local_fleet
    from polar_gym.gateway.config import GatewayPools
    from polar_gym.journal import read_session
    from polar_gym.merge.cli import find_journals

    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")
    tokenizer = _tokenizer()
    P, R = 8192, 8192
    sample = {"uid": "g", "extra_info": {"index": 0, "polar_task": json.dumps(_spec())}}
    async with local_fleet(tmp_path / "fleet", InferenceSettings(), pools=GatewayPools(run_slots=2)) as (url, token):
        monkeypatch.setenv("POLAR_SERVER_URL", url)
        monkeypatch.setenv("POLAR_ADMIN_TOKEN", token)
        loops = [_agent_loop(tokenizer, P, R) for _ in range(2)]
        outputs = await asyncio.gather(*(loop.run({"temperature": 1.0}, **sample) for loop in loops))
    records = {}
    for journal in find_journals([tmp_path / "fleet" / "capture"]):
        session = read_session(journal)
        records[session[0].session_id] = [r for r in session if not r.side_request]
    batch = await _verl_batch(list(outputs), tokenizer, P, R)
    for i, output in enumerate(outputs):
        assert output.reward_score == 1.0 and not output.extra_fields["polar_masked"]
        calls = records[output.extra_fields["polar_session_id"]]
        assert len(calls) > 1 and output.prompt_ids == calls[0].prompt_ids
        mask = batch.batch["response_mask"][i].tolist()
        responses = batch.batch["responses"][i].tolist()
        logprobs = batch.batch["rollout_log_probs"][i].tolist()
        assert [t for t, m in zip(responses, mask, strict=True) if m] == [t for c in calls for t in c.response_ids]
        expected = [lp for c in calls for lp in c.response_logprobs]
        assert [lp for lp, m in zip(logprobs, mask, strict=True) if m] == pytest.approx(expected, abs=1e-6)
        assert 0 in mask[:len(output.response_ids)]  # the tool outputs between the calls: context, not trained
        assert batch.batch["rm_scores"][i].sum().item() == 1.0
