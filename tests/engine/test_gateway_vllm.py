"""The gateway with vLLM's CPU build behind it (tiny random Qwen3, real tokenizer): real pi and Qwen Code CLIs run
sessions in the local sandbox; every recorded completion carries exactly the token IDs and logprobs the engine
returned, and the traces train only those sampled tokens. In token_in mode (the proxy sends exact prefix token IDs)
every completion that does not start a new chain extends an earlier completion's prompt + response token for
token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.tokenin import VLLMTokenInEngine
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.parsers.base import parser_for
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.schema import BuilderSpec, CompletionSession, EvaluatorSpec, RuntimeSpec, SessionSpec
from polar_gym.tasks import demo_task
from tests._serving import served_gateway
from tests.merge._sessions import check_invariants

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("prompt_mode", ["chat", "token_in"])
async def test_real_harnesses_on_a_real_engine_record_the_engines_tokens(vllm_server, tmp_path: Path,
                                                                         prompt_mode: str):
    from tests.engine._engine_kit import RecordingTransport  # keeps every raw upstream answer

    transport = RecordingTransport()
    client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(120.0, connect=5.0))
    engine: VLLMEngine | VLLMTokenInEngine
    if prompt_mode == "chat":
        engine = VLLMEngine(UpstreamPool([vllm_server.url]), client=client, upstream_model=vllm_server.model)
    else:
        engine = VLLMTokenInEngine(HFChatTokenizer(vllm_server.tokenizer_dir), parser_for("qwen3"),
                                   UpstreamPool([vllm_server.url]), client=client, upstream_model=vllm_server.model)
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
    answers = {}
    for x in transport.exchanges:
        if x.status != 200:
            continue
        choice = x.answer["choices"][0]
        if prompt_mode == "chat":
            answers[(tuple(x.answer["prompt_token_ids"]), tuple(choice["token_ids"]))] = [
                c["logprob"] for c in choice["logprobs"]["content"]]
        else:
            assert x.path == "/v1/completions" and x.request["prompt"] == choice["prompt_token_ids"]
            answers[(tuple(choice["prompt_token_ids"]), tuple(choice["token_ids"]))] = choice["logprobs"][
                "token_logprobs"]
    for spec, result in zip(specs, results, strict=True):
        records = await service.journal.records(spec.session_id)
        assert records, (spec.agent.harness, result.status, result.reason)
        for rec in records:
            assert rec.status == "ok" and rec.token_faithful and rec.engine == "vllm", (spec.agent.harness, rec.error)
            key = (tuple(rec.prompt_ids), tuple(rec.response_ids))
            assert key in answers, "recorded tokens are exactly an answer the engine gave"
            assert rec.response_logprobs == answers[key]
        if prompt_mode == "token_in":
            seen: list[list[int]] = []
            prompts: list[list[int]] = []
            extended = 0
            for rec in records:
                assert rec.prompt_mode == "token_in"
                if not any(n.startswith("token_in_new_chain") for n in rec.normalizations):
                    # NeMo RL's contiguity rule: the prompt starts with an earlier prompt + sampled response, or is
                    # exactly an earlier prompt (Qwen Code asks twice from one context)
                    extends = any(rec.prompt_ids[:len(s)] == s for s in seen)
                    extended += extends
                    assert extends or rec.prompt_ids in prompts, (spec.agent.harness, rec.index)
                seen.append(rec.prompt_ids + rec.response_ids)
                prompts.append(rec.prompt_ids)
            if spec.agent.harness == "qwen_code":
                assert extended >= 1  # its agent loop goes on for more turns even on random weights
        assert result.trajectory is not None
        check_invariants(CompletionSession(session_id=spec.session_id, completions=records), result.trajectory)
    await client.aclose()
    service.journal.close()
