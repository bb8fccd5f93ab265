"""Partial rollouts (issue 37): a weight update cuts in-flight token-in generations instead of waiting for them.
Unit tier, no sockets: the real proxy app (real Qwen tokenizer) in front of a fake vLLM ``/v1/completions`` that
streams one token a chunk and, on the first request, stops mid-generation (a long generation) until its stream is
closed; its logprobs say which weights sampled each token. Checked: the pool cuts only the upstream read; the
update returns while the generation still runs; the continuation's prompt and budgets; one answer (non-streamed and
streamed, a character straddling the cut); the record's version spans; ``in_flight: wait``; the builders' split
and what the exports and the audit make of it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.audit.inputs import trace_from_row
from polar_gym.merge.atif import atif_trajectory
from polar_gym.merge.base import MergeConfig
from polar_gym.merge.exports import check_contiguity, nemo_items, slime_samples
from polar_gym.merge.prefix_merging import prefix_merging
from polar_gym.proxy.app import create_app
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.tokenin import SGLangTokenInEngine, VLLMTokenInEngine
from polar_gym.proxy.parsers.base import parser_for
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import Cut, UpstreamPool
from polar_gym.schema import CompletionRecord, CompletionSession
from tests._waiting import BOUND, until

EOT = 151645
ADMIN = {"x-admin-token": "admin"}
#: "𝔘" is two byte-level tokens, neither a character alone: the cut falls between them
TEXT = "Cut 𝔘 here, then more words follow to the end of the answer."


@pytest.fixture(scope="module")
def tok() -> HFChatTokenizer:
    return HFChatTokenizer(str(tokenizer_dir()))


def logprob(version: int, position: int) -> float:
    """The fake's logprob of token ``position`` sampled by weights ``version``: tells them apart in the record."""
    return -(version + position / 1000)


class HeldVLLM:
    """vLLM's /v1/completions for token prompts, streaming ``ids`` one token a chunk from where the prompt leaves
    off (a continuation's prompt holds the tokens so far). The first request stops after ``hold`` tokens until
    ``release`` is set or its stream is closed (``closed`` counts streams closed before their end). The weight
    routes answer success; ``/collective_rpc`` reload_weights of ``/ckpt/v<N>`` makes N the version."""

    def __init__(self, tok: HFChatTokenizer, hold: int) -> None:
        self.ids = [*tok.encode(TEXT), EOT]
        self.hold = hold
        self.tok = tok
        self.version = 0
        self.sent: list[dict[str, Any]] = []
        self.streamed = 0  # tokens sent by all streams
        self.closed = 0
        self.release = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        if request.url.path == "/collective_rpc":
            if body["method"] == "reload_weights":
                self.version = int(body["kwargs"]["weights_path"].rsplit("v", 1)[1])
            return httpx.Response(200, json={"results": [None]})
        if request.url.path != "/v1/completions":
            return httpx.Response(200, json={"success": True})
        self.sent.append(body)
        first = len(self.sent) == 1
        done = len(body["prompt"]) - len(self.sent[0]["prompt"])
        assert body["prompt"][len(self.sent[0]["prompt"]):] == self.ids[:done]
        version = self.version

        async def chunks() -> AsyncIterator[bytes]:
            ended = False
            try:
                for k in range(done, len(self.ids)):
                    if first and k == self.hold:
                        await self.release.wait()
                    # vLLM's text holds a partial character back; a continuation's is a naive detokenizer's (a
                    # byte token alone is U+FFFD, as a detokenizer started mid-character may give): not to be trusted
                    text = self.text(k) if not done else self.tok.decode([self.ids[k]])
                    choice = {"index": 0, "text": text, "token_ids": [self.ids[k]],
                              "logprobs": {"token_logprobs": [logprob(version, k)]},
                              "finish_reason": "stop" if k == len(self.ids) - 1 else None,
                              "prompt_token_ids": body["prompt"] if k == done else None}
                    self.streamed += 1
                    yield b"data: " + json.dumps({"id": "cmpl", "choices": [choice]}).encode() + b"\n\n"
                    await asyncio.sleep(0)
                yield b"data: [DONE]\n\n"
                ended = True
            finally:
                self.closed += not ended

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())

    def text(self, k: int) -> str:
        """The text token ``k`` adds, a character shown once whole (as vLLM's incremental detokenizer does)."""
        def clean(n: int) -> str:
            return self.tok.decode(self.ids[:n]).rstrip("\ufffd")

        return clean(k + 1)[len(clean(k)):]


def proxy(tok: HFChatTokenizer, fake: HeldVLLM) -> tuple[ProxyService, httpx.AsyncClient]:
    engine = VLLMTokenInEngine(tok, parser_for("qwen3"), UpstreamPool(["http://engine"], policy_version=0),
                               client=httpx.AsyncClient(transport=httpx.MockTransport(fake)), upstream_model="tiny")
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True))
    return service, httpx.AsyncClient(transport=httpx.ASGITransport(create_app(service, "admin")),
                                      base_url="http://proxy")


CHAT = {"model": "m", "max_tokens": 200, "temperature": 0.7, "top_p": 0.9, "seed": 5,
        "messages": [{"role": "user", "content": "say it"}],
        "chat_template_kwargs": {"enable_thinking": False}}


async def chat(client: httpx.AsyncClient, session: str, **extra: Any) -> httpx.Response:
    return await client.post("/v1/chat/completions", json={**CHAT, **extra},
                             headers={"authorization": f"Bearer {session}"})


async def record(client: httpx.AsyncClient, session: str) -> dict[str, Any]:
    resp = await client.get(f"/sessions/{session}/completions", headers={"authorization": f"Bearer {session}"})
    (rec,) = resp.json()["completions"]
    return dict(rec)


def straddle(tok: HFChatTokenizer) -> int:
    """The index of the second token of "𝔘": holding there cuts the character in two."""
    ids = tok.encode(TEXT)
    return next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))


async def test_a_cutting_pause_cancels_only_the_upstream_read_and_waits_for_uncuttable_calls() -> None:
    pool = UpstreamPool(["http://a"])
    read: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    outcome: list[str] = []

    async def generation() -> None:
        cut = Cut()
        async with pool.lease("s1", cut):
            cut.task = asyncio.current_task()
            try:
                await read
            except asyncio.CancelledError:
                outcome.append("cut" if cut.cancelled_by_cut() else "cancelled")
                cut.done = True
            finally:
                cut.task = None
        await asyncio.sleep(0)  # the task goes on normally: the cut did not leave it cancelled
        outcome.append("went on")

    other = asyncio.Event()

    async def chat_call() -> None:  # a call without a Cut (chat mode): waited for
        async with pool.lease("s2"):
            await other.wait()

    tasks = [asyncio.create_task(generation()), asyncio.create_task(chat_call())]
    await until(lambda: sum(s.in_flight for s in pool.servers()) == 2, what="two calls in flight")
    pausing = asyncio.create_task(pool.pause(in_flight="cut"))
    await until(lambda: outcome == ["cut", "went on"], what="the generation cut")
    assert not pausing.done()  # the chat call still runs: the pause waits for it
    other.set()
    assert await asyncio.wait_for(pausing, BOUND) == 1
    await asyncio.gather(*tasks)
    pool.resume()
    # in_flight "wait" cuts nothing
    read = asyncio.get_running_loop().create_future()
    outcome.clear()
    task = asyncio.create_task(generation())
    await until(lambda: pool.servers()[0].in_flight == 1, what="a generation in flight")
    pausing = asyncio.create_task(pool.pause(in_flight="wait"))
    await asyncio.sleep(0.01)  # (a chance to fail: a waiting pause must not cut)
    assert not pausing.done() and outcome == []
    read.set_result(b"")
    assert await asyncio.wait_for(pausing, BOUND) == 0
    await task


async def test_an_update_cuts_a_non_streamed_generation_which_continues_under_the_new_weights(
        tok: HFChatTokenizer) -> None:
    hold = straddle(tok)
    fake = HeldVLLM(tok, hold)
    service, client = proxy(tok, fake)
    call = asyncio.create_task(chat(client, "s1"))
    await until(lambda: fake.streamed == hold, what="the generation under way")
    reply = await client.post("/admin/weights", json={"checkpoint": "/ckpt/v1", "policy_version": 1},
                              headers=ADMIN)
    assert reply.status_code == 200, reply.text
    assert reply.json()["cut"] == 1 and reply.json()["policy_version"] == 1
    assert fake.closed == 1  # the first stream was closed (vLLM aborts the request)
    resp = await asyncio.wait_for(call, BOUND)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == TEXT  # one answer, the character whole
    first, following = fake.sent
    assert following["prompt"] == first["prompt"] + fake.ids[:hold]
    assert following["max_tokens"] == first["max_tokens"] - hold == 200 - hold
    same = {k: v for k, v in first.items() if k not in ("prompt", "max_tokens")}
    assert {k: v for k, v in following.items() if k in same} == same  # temperature, top_p, seed, stops, ...
    rec = await record(client, "s1")
    assert rec["response_ids"] == fake.ids and rec["prompt_ids"] == first["prompt"]
    assert rec["response_logprobs"] == [logprob(0 if k < hold else 1, k) for k in range(len(fake.ids))]
    assert rec["version_spans"] == [{"start": 0, "end": hold, "policy_version": 0},
                                    {"start": hold, "end": len(fake.ids), "policy_version": 1}]
    assert rec["policy_version"] == 1 and rec["finish_reason"] == "stop"
    assert rec["response"]["usage"]["completion_tokens"] == len(fake.ids)
    assert service.engine.pool.servers()[0].in_flight == 0


def test_a_continuation_spends_the_token_budgets(tok: HFChatTokenizer) -> None:
    vllm = VLLMTokenInEngine(tok, parser_for("qwen3"), UpstreamPool(["http://engine"]))
    body = {"prompt": [1, 2], "max_tokens": 10, "min_tokens": 6, "ignore_eos": True, "temperature": 0.5}
    assert vllm.continuation_body(body, [1, 2, 7, 8, 9, 10], 4) == {
        "prompt": [1, 2, 7, 8, 9, 10], "max_tokens": 6, "min_tokens": 2, "ignore_eos": True, "temperature": 0.5}
    assert vllm.continuation_body({**body, "min_tokens": 3}, [1, 2, 7, 8, 9, 10], 4)["min_tokens"] == 0
    assert vllm.continuation_body(body, [1, 2, *range(10)], 10) is None  # nothing left to sample
    assert vllm.continuation_body({"prompt": [1]}, [1, 5], 1) == {"prompt": [1, 5]}  # no budget: none to spend
    sglang = SGLangTokenInEngine(tok, parser_for("qwen3"), UpstreamPool(["http://engine"]))
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8, "min_new_tokens": 2, "top_k": 5},
            "return_logprob": True, "stream": True}
    assert sglang.continuation_body(body, [1, 2, 3], 1) == {
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 7, "min_new_tokens": 1, "top_k": 5},
        "return_logprob": True, "stream": True}
    assert body["sampling_params"]["max_new_tokens"] == 8  # the first segment's body is left as it was


async def test_a_streamed_client_gets_one_continuous_stream_across_the_cut(tok: HFChatTokenizer) -> None:
    hold = straddle(tok)
    fake = HeldVLLM(tok, hold)
    _, client = proxy(tok, fake)
    events: list[dict[str, Any]] = []
    done = asyncio.Event()

    async def read() -> None:
        async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                                 headers={"authorization": "Bearer s2"}) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done.set()
                elif line.startswith("data: "):
                    events.append(json.loads(line[6:]))

    reading = asyncio.create_task(read())
    await until(lambda: fake.streamed == hold, what="the generation under way")
    reply = await client.post("/admin/weights", json={"checkpoint": "/ckpt/v4", "policy_version": "v4"},
                              headers=ADMIN)
    assert reply.status_code == 200 and reply.json()["cut"] == 1
    await asyncio.wait_for(reading, BOUND)
    assert done.is_set()
    content = "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
    assert content == TEXT
    assert len({e["id"] for e in events}) == 1  # one completion, not two
    finishes = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    assert finishes == ["stop"]
    rec = await record(client, "s2")
    assert rec["stream"] is True and rec["response_ids"] == fake.ids
    assert [s["policy_version"] for s in rec["version_spans"]] == [0, "v4"]


async def test_in_flight_wait_lets_the_generation_finish_first(tok: HFChatTokenizer) -> None:
    fake = HeldVLLM(tok, 5)
    _, client = proxy(tok, fake)
    call = asyncio.create_task(chat(client, "s3"))
    await until(lambda: fake.streamed == 5, what="the generation under way")
    updating = asyncio.create_task(client.post(
        "/admin/weights", json={"checkpoint": "/ckpt/v2", "policy_version": 2, "in_flight": "wait"}, headers=ADMIN))
    await asyncio.sleep(0.01)  # (a chance to fail: nothing may be cut or loaded)
    assert not updating.done() and fake.closed == 0
    fake.release.set()
    reply = await asyncio.wait_for(updating, BOUND)
    assert reply.status_code == 200 and reply.json()["cut"] == 0
    assert (await asyncio.wait_for(call, BOUND)).json()["choices"][0]["message"]["content"] == TEXT
    rec = await record(client, "s3")
    assert rec["version_spans"] is None and rec["policy_version"] == 0 and len(fake.sent) == 1


async def test_a_pause_without_a_version_change_keeps_one_span(tok: HFChatTokenizer) -> None:
    fake = HeldVLLM(tok, 5)
    _, client = proxy(tok, fake)
    call = asyncio.create_task(chat(client, "s4"))
    await until(lambda: fake.streamed == 5, what="the generation under way")
    paused = await client.post("/admin/pause", headers=ADMIN)
    assert paused.json()["cut"] == 1
    assert (await client.post("/admin/resume", json={}, headers=ADMIN)).status_code == 200
    assert (await asyncio.wait_for(call, BOUND)).json()["choices"][0]["message"]["content"] == TEXT
    rec = await record(client, "s4")
    assert rec["version_spans"] is None and rec["response_ids"] == fake.ids and len(fake.sent) == 2


def cut_session() -> CompletionSession:
    """Two turns of one chain; the first was cut after 4 of its 10 tokens by the update from version 3 to 4."""
    user = {"role": "user", "content": "go"}
    first = CompletionRecord(
        completion_id="c0", session_id="s", index=0, provider="openai_chat", engine="vllm", policy_version=4,
        normalized_request={"messages": [user]}, response={"message": {"role": "assistant", "content": "a"}},
        prompt_ids=[1, 2, 3], response_ids=list(range(10, 20)), response_logprobs=[-0.1] * 10,
        version_spans=[{"start": 0, "end": 4, "policy_version": 3}, {"start": 4, "end": 10, "policy_version": 4}])
    second = CompletionRecord(
        completion_id="c1", session_id="s", index=1, provider="openai_chat", engine="vllm", policy_version=4,
        normalized_request={"messages": [user, {"role": "assistant", "content": "a"}, user]},
        response={"message": {"role": "assistant", "content": "b"}},
        prompt_ids=[1, 2, 3, *range(10, 20), 7, 8], response_ids=[30, 31], response_logprobs=[-0.2, -0.3])
    return CompletionSession(session_id="s", completions=[first, second])


def test_builders_split_a_cut_completion_per_version_and_the_exports_and_audit_follow() -> None:
    traj = prefix_merging(cut_session(), MergeConfig(end_of_turn_ids=(EOT,)))
    (trace,) = traj.traces
    spans = trace.metadata["spans"]
    assert [(s["completion_id"], s["start"], s["end"], s["policy_version"], s.get("cut")) for s in spans] == [
        ("c0", 0, 4, 3, True), ("c0", 4, 10, 4, True), ("c1", 12, 14, 4, None)]
    assert trace.metadata["policy_versions"] == [3, 4]
    audit = trace_from_row(trace.model_dump(mode="json"))
    assert [audit.version_at(i) for i in (0, 3, 4, 9, 10, 12, 13)] == [3, 3, 4, 4, None, 4, 4]
    items = nemo_items(trace)
    assert [(len(i.generation_token_ids), i.policy_version, i.completion_id) for i in items] == [
        (4, 3, "c0"), (6, 4, "c0"), (2, 4, "c1")]
    assert items[1].prompt_token_ids == [1, 2, 3, 10, 11, 12, 13]  # the continuation's prompt, as the engine saw
    check_contiguity(items)
    (sample,) = slime_samples(traj)
    assert sample.weight_versions == ["3", "4", "4"]
    assert [s["policy_version"] for s in sample.metadata["spans"]] == [3, 4, 4]
    steps = [s for s in atif_trajectory(traj).steps if s.metrics is not None]  # ATIF: one step per model call
    assert [s.metrics.completion_tokens for s in steps if s.metrics is not None] == [10, 2]
