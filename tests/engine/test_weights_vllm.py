"""New weights into a running vLLM (CPU build, float32, tiny Qwen3) through the gateway's admin API, checked by logprobs
rather than checksums: a session's call in flight when an ``in_flight: wait`` update comes finishes first, entirely
under the old weights (its logprobs equal transformers' on the old weights); a call made during the update waits and
goes on; afterwards the engine's logprobs equal transformers' on the new weights (max |Δ| < 1e-4) and differ from the
old ones, also on a turn whose prompt prefix the engine had cached before the update (the prefix cache must not keep
old-weight values); records carry the old version before and the new one after. The checkpoint changes every tensor,
the tied embedding / output layer included (vLLM's CPU build keeps a packed copy of it that a plain reload leaves
stale: polar_vllm_worker)."""

from __future__ import annotations

import asyncio
import functools
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar_gym.gateway.client import GatewayClient
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.tokenin import VLLMTokenInEngine
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.parsers.base import parser_for
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.schema import CompletionRecord, WeightUpdateRequest
from polar_gym.server import RolloutClient
from tests._serving import ADMIN, served_gateway
from tests._vllm import VLLMServer
from tests._waiting import BOUND, until
from tests.server._server_kit import SERVER_TOKEN, Harness

pytestmark = pytest.mark.engine

#: fp32 engine vs fp32 transformers on the same weights (measured here: ~1e-6 on this model)
SAME_WEIGHTS = 1e-4
#: the new weights must move the sampled tokens' logprobs by more than this somewhere
CHANGED = 0.05
#: long enough to fill several of the engine's KV blocks, so later calls reuse cached ones (a shorter prompt never hits
#: the prefix cache and would not show old-weight values leaking from it)
PROMPT = "Count these, then say which ones are even: " + ", ".join(f"item {i}" for i in range(150)) + "."
LONG = 160  # tokens of the call that is in flight when the update comes (a few seconds on two cores)




def perturbed_copy(source: Path, target: Path, seed: int) -> Path:
    """The tiny model with every tensor changed (float32): noise on each layer, a stronger one on the tied
    embedding, so sampled tokens' logprobs move visibly."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        value = tensor.float()
        scale = 3.0 if name == "model.embed_tokens.weight" else 0.5
        noise = torch.randn(value.shape, generator=generator) * value.std().clamp(min=1e-3) * scale
        weights[name] = (value + noise).contiguous()
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


@functools.cache
def _model(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


def hf_logprobs(model_dir: Path, rec: CompletionRecord) -> list[float]:
    """transformers' float32 logprobs of the record's sampled tokens after its exact prompt."""
    import torch

    ids = rec.prompt_ids + rec.response_ids
    with torch.no_grad():
        logits = _model(model_dir)(torch.tensor([ids])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    start = len(rec.prompt_ids) - 1
    return [float(logprobs[start + i, token]) for i, token in enumerate(rec.response_ids)]


def gap(rec: CompletionRecord, model_dir: Path) -> float:
    return max(abs(a - b) for a, b in zip(rec.response_logprobs, hf_logprobs(model_dir, rec), strict=True))


class Caller:
    """Chat calls through the gateway, each session registered on its first call (as the gateway's sessions are)."""

    def __init__(self, client: httpx.AsyncClient, model: str) -> None:
        self.client, self.model = client, model
        self.keys: dict[str, str] = {}

    async def __call__(self, session: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
        if session not in self.keys:
            registered = await self.client.post("/admin/sessions", json={"session_id": session},
                                                headers={"x-admin-token": ADMIN})
            self.keys[session] = registered.json()["api_key"]
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 1.0,
                "seed": 7, "ignore_eos": True}
        resp = await self.client.post("/v1/chat/completions", json=body,
                                      headers={"authorization": f"Bearer {self.keys[session]}"})
        assert resp.status_code == 200, resp.text
        return dict(resp.json())


def training_proxy(server: VLLMServer) -> ProxyService:
    """The gateway's proxy as a training loop's fleet runs it: token-in prompts to the float32 server."""
    tokenizer = HFChatTokenizer(server.tokenizer_dir)
    engine = VLLMTokenInEngine(tokenizer, parser_for("qwen3"), UpstreamPool([server.url], policy_version=0),
                               timeout=300.0, upstream_model=server.model)
    return ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=False), model_names=[server.model])


async def test_update_in_flight_reaches_the_engine_and_logprobs_follow_the_new_weights(
        vllm_train_server: VLLMServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def say(line: str) -> None:
        with capsys.disabled():  # the numbers to report, on the terminal
            print(f"\n[weights-vllm] {line}", flush=True)

    service = training_proxy(vllm_train_server)
    try:
        await run_updates(vllm_train_server, service, tmp_path, say)
    finally:
        await service.engine.aclose()


async def run_updates(vllm_train_server: VLLMServer, training_proxy: ProxyService, tmp_path: Path,
                      say: Callable[[str], None]) -> None:
    original = vllm_train_server.model_dir
    new = perturbed_copy(original, tmp_path / "step-1", seed=1)
    model, pool = vllm_train_server.model, training_proxy.engine.pool
    async with served_gateway(training_proxy, tmp_path / "gw") as node:
        url = f"http://127.0.0.1:{node.config.endpoint.port}"
        async with httpx.AsyncClient(base_url=url, timeout=300.0) as http, \
                GatewayClient.connect(url, ADMIN, timeout=300.0) as admin:
            call = Caller(http, model)
            first = [{"role": "user", "content": PROMPT}]
            opened = await call("cached", first, 24)  # its prefix sits in the engine's cache
            in_flight = asyncio.create_task(call("long", first, LONG))
            await until(lambda: any(s.in_flight for s in pool.servers()), what="a model call in flight")
            update = asyncio.create_task(admin.update_weights(WeightUpdateRequest(  # (a cut: test_partial_rollouts)
                checkpoint=str(new), policy_version=1, in_flight="wait")))
            await until(lambda: pool.paused, what="the pool to pause")
            waiting = asyncio.create_task(call("waiting", first, 16))
            reply = await asyncio.wait_for(update, BOUND * 5)
            assert reply.policy_version == 1 and reply.previous_version == 0 and not reply.paused
            assert in_flight.done()  # the update waited for it
            await asyncio.wait_for(waiting, BOUND)
            second = [*first, {"role": "assistant", "content": opened["choices"][0]["message"]["content"] or ""},
                      {"role": "user", "content": "Again."}]
            await call("cached", second, 24)  # extends a prefix computed with the old weights
            steps = reply.servers[vllm_train_server.url]
            say(f"update 0->1: drained {reply.drained_seconds:.2f} s (a {LONG}-token call in flight), reload "
                 f"{steps['reload_seconds']:.2f} s, prefix-cache reset {steps['cache_reset_seconds']:.3f} s, "
                 f"version tag {steps['version_tag_seconds']:.3f} s, total {reply.total_seconds:.2f} s")

            back = await admin.update_weights(WeightUpdateRequest(checkpoint=str(original), policy_version=2))
            steps = back.servers[vllm_train_server.url]
            say(f"update 1->2 (idle): reload {steps['reload_seconds']:.2f} s, prefix-cache reset "
                 f"{steps['cache_reset_seconds']:.3f} s, total {back.total_seconds:.2f} s")
            restored = await call("restored", first, 16)
            assert restored["choices"][0]["message"] is not None

    (long_rec,) = await training_proxy.journal.records("long")
    (waited,) = await training_proxy.journal.records("waiting")
    cached_before, cached_after = await training_proxy.journal.records("cached")
    (restored_rec,) = await training_proxy.journal.records("restored")
    assert cached_after.prompt_ids[:len(cached_before.prompt_ids)] == cached_before.prompt_ids
    assert [r.policy_version for r in (cached_before, long_rec, waited, cached_after, restored_rec)] == [0, 0, 1, 1, 2]
    assert len(long_rec.response_ids) == LONG
    for rec in (cached_before, long_rec, restored_rec):  # sampled entirely under the original weights
        assert gap(rec, original) < SAME_WEIGHTS, rec.session_id
    for rec in (waited, cached_after):  # under the new ones, the cached prefix included
        assert gap(rec, new) < SAME_WEIGHTS, rec.session_id
        assert gap(rec, original) > CHANGED, rec.session_id
    say(f"max |Δ logprob| engine vs transformers: old weights {gap(long_rec, original):.2e}, new weights "
         f"{max(gap(waited, new), gap(cached_after, new)):.2e}; new vs old {gap(cached_after, original):.2f}")


async def test_a_restarted_server_replaces_the_old_one_through_the_rollout_server(
        vllm_server: VLLMServer, vllm_train_server: VLLMServer, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An engine the proxy cannot reload (or a change a reload cannot make: dtype, parallelism): the trainer
    restarts a server on the checkpoint and the fleet swaps it in through the rollout server's backends. Here the
    gateway starts on the session's bfloat16 server; the "restarted" one is the float32 server on the stock weights
    (a restart takes 40-125 s, so the session's running one stands in). A session's call before the swap ran on the
    old server under version 0, its next call on the new one under version 1 with float32 logprobs (checked against
    transformers); the rollout server's backends are the new server."""
    harness = Harness(tmp_path)
    engine = VLLMEngine(UpstreamPool([vllm_server.url], policy_version=0), timeout=300.0,
                        upstream_model=vllm_server.model)
    try:
        gateway = await harness.gateway(engine=engine)
        srv = await harness.server(weight_servers=[vllm_train_server.url])  # --weight-server: a new engine
        await srv.register(gateway, 2)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=300.0) as http, \
                RolloutClient(srv.url, SERVER_TOKEN) as client:
            call = Caller(http, vllm_server.model)
            first = [{"role": "user", "content": PROMPT}]
            before = await call("swapped", first, 16)
            reply = await client.update_weights(str(vllm_train_server.model_dir), 1, servers=[vllm_train_server.url])
            assert reply.updated and srv.core.backends == [vllm_train_server.url]
            (answer,) = reply.gateways.values()
            assert answer["weights"]["body"]["replaced"] == [vllm_server.url]
            second = [*first, {"role": "assistant", "content": before["choices"][0]["message"]["content"] or ""},
                      {"role": "user", "content": "Again."}]
            await call("swapped", second, 16)
        with capsys.disabled():
            print(f"\n[weights-vllm] swap to a restarted server: {reply.seconds:.2f} s", flush=True)
    finally:
        await harness.close()
        await engine.aclose()
    old, new = await gateway.service.journal.records("swapped")
    assert (old.server, old.policy_version) == (vllm_server.url, 0)
    assert (new.server, new.policy_version) == (vllm_train_server.url, 1)
    assert gap(new, vllm_train_server.model_dir) < SAME_WEIGHTS
