"""The rubric evaluator with a real judge: vLLM CPU serving the tiny model scores each trace of a real harness's
session (pi, oracle policy, a demo task whose tests decide the outcome), batched, its answer's shape enforced while
sampling. Every trace's reward is outcome + weight x score / max_score, the score is on the trace and in the export
trainers read; a judge that is down, or one asked without the enforced shape (the tiny model then answers
garbage), ends its session ERROR with the cause named and the traces kept, never a silent 0."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.causes import error_cause
from polar_gym.evaluate.judge import JudgeEndpoint
from polar_gym.merge import token_rewards, trace_lines
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.schema import BuilderSpec, EvaluatorSpec, RuntimeSpec, SessionSpec, SessionStatus
from polar_gym.tasks import demo_task
from tests._serving import served_gateway
from tests._vllm import VLLMServer

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rubric_session(judge: str, index: int) -> SessionSpec:
    task = demo_task("demo-calc-add")
    request = task.to_request(harness="pi", runtime=RuntimeSpec(backend="local", network="gateway",
                                                                workdir="/workspace"),
                              builder=BuilderSpec(strategy="per_request"), timeout_seconds=240)
    outcome = request.evaluator.model_dump()
    request = request.model_copy(update={"evaluator": EvaluatorSpec(strategy="rubric", config={
        "judge": judge, "outcome": {"strategy": outcome["strategy"], "config": outcome["config"]}})})
    return SessionSpec.from_task(request, index)


async def test_a_real_judge_scores_every_trace_and_a_broken_one_names_its_cause(vllm_server: VLLMServer,
                                                                               tmp_path: Path) -> None:
    judges = {"tiny": JudgeEndpoint(url=f"{vllm_server.url}/v1", model=vllm_server.model, max_tokens=64),
              "down": JudgeEndpoint(url=f"http://127.0.0.1:{closed_port()}/v1", model="judge", timeout_seconds=10),
              "raw": JudgeEndpoint(url=f"{vllm_server.url}/v1", model=vllm_server.model, structured="none",
                                   max_tokens=32)}
    service = ProxyService(OracleEngine(HFChatTokenizer(tokenizer_dir())), CaptureJournal(tmp_path / "capture"),
                           SessionRegistry(allow_adhoc=False))
    specs = [rubric_session(name, i) for i, name in enumerate(["tiny", "tiny", "down", "raw"])]
    async with served_gateway(service, tmp_path / "gateway", run_slots=4, postrun_workers=4,
                              judges=judges) as node:
        results = await asyncio.wait_for(node.run(specs), 600)
    service.journal.close()
    good, also_good, down, garbage = results
    for result in (good, also_good):
        assert result.status is SessionStatus.COMPLETED, result.reason
        evaluation, trajectory = result.evaluation, result.trajectory
        assert evaluation is not None and trajectory is not None and evaluation.reward == 1.0  # the tests pass
        scores = evaluation.per_trace_scores
        assert scores is not None and len(scores) == len(trajectory.traces) >= 2  # per_request: a trace per call
        assert all(0 <= s <= 5 for s in scores) and evaluation.details["rubric"]["scores"] == scores
        for trace, score in zip(trajectory.traces, scores, strict=True):
            assert trace.reward == pytest.approx(1.0 + 0.2 * score / 5)
            assert trace.metadata["trace_score"] == score and trace.metadata["outcome_reward"] == 1.0
            assert sum(token_rewards(trace)) == pytest.approx(trace.reward)
        exported = trace_lines(result)  # what a launch's trajectories.jsonl and the trainer bridges read
        assert [line.reward for line in exported] == [t.reward for t in trajectory.traces]
        assert [line.metadata["trace_score"] for line in exported] == scores
    for result, cause in ((down, "judge_unreachable"), (garbage, "judge_garbage")):
        assert result.status is SessionStatus.ERROR and error_cause(result) == cause, (result.status, result.reason)
        assert result.reason is not None and cause in result.reason
        assert result.evaluation is None  # unscored, not 0
        assert result.trajectory is not None and result.trajectory.traces  # nothing captured is lost
        assert all(t.reward is None for t in result.trajectory.traces)
