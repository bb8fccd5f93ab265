"""Issue 42, done-when 2's engine half with a real harness: the real pi CLI runs the multimodal demo task through the
gateway on vLLM serving the tiny Qwen2-VL, in token_in mode. Random weights never call a tool, so the first call is
steered (vLLM's structured outputs, a regex over one hermes block) to pi's ``read`` of ``card.png``, as the oracle
plays it; pi then sends the picture, and the next call carries it to the model through vLLM's token-in route. The
session's calls are one contiguous chain across both routes, and the image sits where its placeholders are."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar_gym.merge.exports import check_contiguity, nemo_items
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.chat import ChatRequest
from polar_gym.proxy.engines.oracle import find_read_tool
from polar_gym.proxy.engines.vision import VLLMVisionTokenInEngine
from polar_gym.proxy.parsers.base import parser_for
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.tasks import demo_task
from tests._serving import served_gateway
from tests._vision import pad_runs
from tests._vllm import VLLMServer
from tests.e2e.test_harnesses_e2e import session_for
from tests.engine._engine_kit import SteeredCalls, _regex_literal, regex_steered

pytestmark = [pytest.mark.engine, pytest.mark.harness]


class ReadSteeredEngine(SteeredCalls, VLLMVisionTokenInEngine):
    """The vision token-in engine, its first call of a conversation with a read tool steered to read the card."""

    def steer(self, request: ChatRequest) -> ChatRequest:
        found = find_read_tool(request.tools)
        if found is None or any(m.role == "tool" for m in request.messages):
            return request
        tool, key = found
        block = json.dumps({"name": tool.name, "arguments": {key: "card.png"}})
        return regex_steered(request, _regex_literal(f"<tool_call>\n{block}\n</tool_call>"), max_tokens=160)


async def test_pi_on_the_tiny_vlm_in_token_in_mode_sends_the_card_in_one_contiguous_chain(
        vllm_vlm_server: VLLMServer, tmp_path: Path) -> None:
    client = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0))
    engine = ReadSteeredEngine(HFChatTokenizer(vllm_vlm_server.model_dir), parser_for("qwen3"),
                               UpstreamPool([vllm_vlm_server.url]), client=client, upstream_model=vllm_vlm_server.model)
    service = ProxyService(engine, CaptureJournal(tmp_path / "capture"), SessionRegistry(allow_adhoc=False),
                           max_tokens_cap=24)  # free replies of random weights never stop: capped short
    task = demo_task("demo-colour-card")
    spec = session_for("pi", task.task_id)
    async with served_gateway(service, tmp_path / "gateway", init_workers=1, ready_buffer=1, run_slots=1,
                              postrun_workers=1) as node:
        (result,) = await asyncio.wait_for(node.run([spec]), 600)
    await client.aclose()
    records = await service.journal.records(spec.session_id)
    assert records and all(r.status == "ok" and r.prompt_mode == "token_in" for r in records), \
        (result.status, result.reason, [r.error for r in records])
    calls: list[Any] = [(r.response.get("message") or {}).get("tool_calls") for r in records]
    assert calls[0] and calls[0][0]["function"]["name"] == "read"
    with_image = [r for r in records if r.images]
    card = hashlib.sha256(task.binary_files["card.png"]).hexdigest()
    assert with_image and with_image[0].images[0]["sha256"] == card
    span = with_image[0].images[0]["prompt_span"]
    assert span is not None and [(span["start"], span["end"] - span["start"])] == pad_runs(with_image[0].prompt_ids)
    assert not any(n.startswith("token_in_new_chain") for r in records[1:] for n in r.normalizations)
    trajectory = result.trajectory
    assert trajectory is not None and len(trajectory.traces) == 1, trajectory and trajectory.diagnostics
    check_contiguity(nemo_items(trajectory.traces[0]))  # NeMo RL's rule: no gap between the calls' tokens
    assert trajectory.traces[0].metadata["images"][0]["sha256"] == card
