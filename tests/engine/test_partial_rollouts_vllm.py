"""A weight update cuts a long generation on the real vLLM (CPU build, float32, tiny Qwen3) instead of waiting for it
(issue 37, partial rollouts): the official OpenAI SDK streams a forced-length answer through the proxy (token-in);
the update to perturbed weights returns while the answer is still being sampled, having cut it; the SDK gets one
well-formed stream; the record stamps the tokens before the cut with the old version and the rest with the new one,
and transformers' float32 logprobs of each side under its own weights equal the captured ones (max |Δ| < 1e-4),
the boundary exactly where the stamps put it. The server gets its original weights back at the end."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.chat import ChatRequest
from polar_gym.proxy.engines.tokenin import Generation, StreamedAnswer, VLLMTokenInEngine
from polar_gym.proxy.parsers.base import parser_for
from polar_gym.proxy.prefix import PromptPlan
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.schema import CompletionRecord
from tests._serving import ADMIN, serve
from tests._vllm import VLLMServer
from tests._waiting import BOUND, until
from tests.engine.test_weights_vllm import CHANGED, SAME_WEIGHTS, hf_logprobs, perturbed_copy

pytestmark = pytest.mark.engine

# tokens sampled in all (ignore_eos): the update comes once the proxy has taken CUT_AFTER of them from vLLM. The
# moment is the proxy's, not the client's: a client that reads behind (a busy machine, text a parser holds back)
# once saw 24 pieces only after vLLM had sent all 1500 tokens, and the update found nothing to cut. vLLM samples
# about 100 tokens a second here with both cores busy, so the generation is still under way when the update lands
LONG = 1500
CUT_AFTER = 24


class ForcedLength(VLLMTokenInEngine):
    """The token-in vLLM engine asking vLLM to ignore the end of turn (its own ``ignore_eos``; a continuation's body
    keeps it), so the answer is exactly ``max_tokens`` long; ``taken`` counts the tokens it has read from vLLM."""

    taken = 0

    def _take(self, gen: Generation, segment: StreamedAnswer, ids: list[int], logprobs: list[float]) -> None:
        self.taken += len(ids)
        super()._take(gen, segment, ids, logprobs)

    def token_body(self, request: ChatRequest, plan: PromptPlan) -> dict[str, Any]:
        return {**super().token_body(request, plan), "ignore_eos": True}


def split(rec: CompletionRecord, lo: int, hi: int) -> CompletionRecord:
    """The record's tokens ``lo:hi`` as a completion of their own (their prompt: the prompt and the tokens before)."""
    return rec.model_copy(update={"prompt_ids": rec.prompt_ids + rec.response_ids[:lo],
                                  "response_ids": rec.response_ids[lo:hi],
                                  "response_logprobs": rec.response_logprobs[lo:hi]})


def deltas(rec: CompletionRecord, model_dir: Path) -> list[float]:
    return [abs(a - b) for a, b in zip(rec.response_logprobs, hf_logprobs(model_dir, rec), strict=True)]


async def test_a_weight_update_cuts_a_long_generation_which_goes_on_under_the_new_weights(
        vllm_train_server: VLLMServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server = vllm_train_server
    original, new = server.model_dir, perturbed_copy(server.model_dir, tmp_path / "step-1", seed=3)
    engine = ForcedLength(HFChatTokenizer(server.tokenizer_dir), parser_for("qwen3"),
                          UpstreamPool([server.url], policy_version=0), upstream_model=server.model,
                          # no connection outlives the proxy's own event loop (it runs in a thread of its own)
                          client=httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0),
                                                   limits=httpx.Limits(max_keepalive_connections=0)))
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True), model_names=[server.model])
    running = serve(service)
    proxy = next(running)
    admin = httpx.AsyncClient(base_url=proxy.url, headers={"x-admin-token": ADMIN}, timeout=300.0)
    sdk = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="cut-long", max_retries=0, timeout=300.0)
    pieces: list[str] = []
    finishes: list[str] = []
    try:
        async def read() -> None:
            stream = await sdk.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": "Tell a long story about a lighthouse."}],
                max_tokens=LONG, temperature=1.0, seed=11, stream=True,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            async for chunk in stream:
                for choice in chunk.choices:
                    pieces.append(choice.delta.content or "")
                    if choice.finish_reason:
                        finishes.append(choice.finish_reason)

        reading = asyncio.create_task(read())
        await until(lambda: engine.taken >= CUT_AFTER, timeout=BOUND * 5, what="the generation under way")
        reply = (await admin.post("/admin/weights", json={"checkpoint": str(new), "policy_version": 1})).json()
        still_running = not reading.done()  # read at once: nothing ran between the reply and this
        assert reply.get("cut") == 1, reply
        assert still_running  # the update did not wait for the generation
        await asyncio.wait_for(reading, BOUND * 5)
        with capsys.disabled():
            steps = reply["servers"][server.url]
            print(f"\n[partial-rollouts-vllm] update during a {LONG}-token generation: {reply['total_seconds']:.2f} s "
                  f"(reload {steps['reload_seconds']:.2f} s, drain {reply['drained_seconds']:.3f} s, cut "
                  f"{reply['cut']})", flush=True)
        resp = await admin.get("/sessions/cut-long/completions", headers={"authorization": "Bearer cut-long"})
        (raw,) = resp.json()["completions"]
    finally:
        back = await admin.post("/admin/weights", json={"checkpoint": str(original), "policy_version": 2})
        await sdk.close()
        await admin.aclose()
        next(running, None)
    assert back.status_code == 200, back.text
    rec = CompletionRecord.model_validate(raw)
    assert finishes == ["length"] and "".join(pieces) == (rec.response["message"].get("content") or "")
    assert len(rec.response_ids) == LONG and rec.policy_version == 1
    assert rec.version_spans is not None
    (old, fresh) = rec.version_spans
    cut = old["end"]
    assert (old["start"], old["policy_version"], fresh["start"], fresh["end"], fresh["policy_version"]) == (
        0, 0, cut, LONG, 1)
    assert CUT_AFTER <= cut < LONG
    before, after = split(rec, 0, cut), split(rec, cut, LONG)
    old_gap, new_gap = max(deltas(before, original)), max(deltas(after, new))
    assert old_gap < SAME_WEIGHTS and new_gap < SAME_WEIGHTS
    assert max(deltas(after, original)) > CHANGED  # the new weights sampled them: the boundary is exact
    with capsys.disabled():
        print(f"[partial-rollouts-vllm] cut after {cut} tokens; max |Δ logprob| vs transformers fp32: old side "
              f"{old_gap:.2e} (old weights), new side {new_gap:.2e} (new weights)", flush=True)
