"""The gateway with vLLM's CPU build behind it (tiny random Qwen3, real tokenizer): real pi and Qwen Code CLIs run
sessions in the local sandbox; every recorded completion carries exactly the token IDs and logprobs the engine
returned, and the traces train only those sampled tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.schema import BuilderSpec, CompletionSession, EvaluatorSpec, RuntimeSpec, SessionSpec
from polar_gym.tasks import demo_task
from tests._serving import served_gateway
from tests.merge._sessions import check_invariants

pytestmark = pytest.mark.engine


async def test_real_harnesses_on_a_real_engine_record_the_engines_tokens(vllm_server, tmp_path: Path):
    from tests.engine._engine_kit import RecordingTransport  # keeps every raw upstream answer

    transport = RecordingTransport()
    client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(120.0, connect=5.0))
    engine = VLLMEngine(UpstreamPool([vllm_server.url]), client=client, upstream_model=vllm_server.model)
    # random weights rarely stop: cap every call so a session takes seconds
    service = ProxyService(engine, CaptureJournal(tmp_path / "capture"), SessionRegistry(allow_adhoc=False),
                           max_tokens_cap=24)
    specs = []
    for harness in ("pi", "qwen_code"):
        request = demo_task("demo-calc-add").to_request(
            harness=harness, runtime=RuntimeSpec(backend="local", network="gateway", workdir="/workspace"),
            builder=BuilderSpec(strategy="prefix_merging"), evaluator=EvaluatorSpec(strategy="session_completed"),
            timeout_seconds=300)
        specs.append(SessionSpec.from_task(request, 0))
    async with served_gateway(service, tmp_path / "gateway", run_slots=2) as node:
        results = await asyncio.wait_for(node.run(specs), 600)
    answers = {(tuple(x.answer["prompt_token_ids"]), tuple(x.answer["choices"][0]["token_ids"])):
               [c["logprob"] for c in x.answer["choices"][0]["logprobs"]["content"]]
               for x in transport.exchanges if x.status == 200}
    for spec, result in zip(specs, results, strict=True):
        records = await service.journal.records(spec.session_id)
        assert records, (spec.agent.harness, result.status, result.reason)
        for rec in records:
            assert rec.status == "ok" and rec.token_faithful and rec.engine == "vllm", (spec.agent.harness, rec.error)
            key = (tuple(rec.prompt_ids), tuple(rec.response_ids))
            assert key in answers, "recorded tokens are exactly an answer the engine gave"
            assert rec.response_logprobs == answers[key]
        assert result.trajectory is not None
        check_invariants(CompletionSession(session_id=spec.session_id, completions=records), result.trajectory)
    await client.aclose()
    service.journal.close()
