"""Issue 42, done-when 1: the official SDKs send an image through each of the four front ends, plain and streamed,
to vLLM's CPU build serving the tiny Qwen2-VL, and the prompt ids the proxy captured are what the model's own
template and image processor make of the normalized request (tests/_vision.py); each record names its image by
SHA-256 and says where its placeholders sit. The proxy runs in chat mode (vLLM renders the prompt) with the model's
tokenizer, from which it knows the image token. A tool result that carries an image (how pi's ``read`` and Claude
Code's screenshots send one) reaches the model the same way. The audit recomputes a captured multimodal trace
with transformers."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import types

from polar_gym.audit.__main__ import main as audit_main
from polar_gym.merge import MergeConfig
from polar_gym.merge.exports import trace_lines
from polar_gym.merge.per_request import per_request
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.tokenizer import image_token_id_in
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.schema import CompletionSession
from polar_gym.tiny_vlm import IMAGE_PAD_ID
from tests._serving import RunningProxy, serve
from tests._vision import pad_runs, png_url, processor_view
from tests._vllm import VLLMServer

pytestmark = pytest.mark.engine

URL = png_url((150, 90), (40, 160, 220))  # 6x10 patches once resized (84x140 -> 6x10): 15 placeholders
PNG = base64.b64decode(URL.split(",", 1)[1])
QUESTION = "What colour is this?"


@pytest.fixture(scope="module")
def vlm_proxy(vllm_vlm_server: VLLMServer) -> Iterator[RunningProxy]:
    """The proxy in chat mode, told the image token by the model's tokenizer as ``build_engine`` tells it (an httpx
    client of the test's own: the engine's default client lives on the server thread's loop)."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0),
                               limits=httpx.Limits(max_keepalive_connections=0))  # nothing left open at the end
    engine = VLLMEngine(UpstreamPool([vllm_vlm_server.url]), client=client, upstream_model=vllm_vlm_server.model)
    engine.image_token_id = image_token_id_in(vllm_vlm_server.model_dir)
    assert engine.image_token_id == IMAGE_PAD_ID
    yield from serve(ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True)))


def _records(proxy: RunningProxy, key: str) -> list[dict[str, Any]]:
    reply = httpx.get(f"{proxy.url}/sessions/{key}/completions", headers={"authorization": f"Bearer {key}"})
    reply.raise_for_status()
    return list(reply.json()["completions"])


def _openai_chat(proxy: RunningProxy, key: str, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=key, max_retries=0)
    reply = client.chat.completions.create(model="gpt-x", max_tokens=6, temperature=0, stream=stream, messages=[
        {"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {
            "url": URL}}]}])
    assert list(reply) if stream else reply.choices[0].finish_reason  # type: ignore[union-attr,arg-type]


def _openai_responses(proxy: RunningProxy, key: str, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=key, max_retries=0)
    reply = client.responses.create(model="gpt-x", max_output_tokens=6, temperature=0, stream=stream, input=[
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION},
                                     {"type": "input_image", "image_url": URL, "detail": "auto"}]}])
    assert list(reply) if stream else reply.status in ("completed", "incomplete")  # type: ignore[union-attr,arg-type]


def _anthropic(proxy: RunningProxy, key: str, stream: bool) -> None:
    client = anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0)
    content = [{"type": "text", "text": QUESTION}, {"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}}]
    if stream:
        with client.messages.stream(model="claude-x", max_tokens=6,
                                    messages=[{"role": "user", "content": content}]) as events:  # type: ignore[misc]
            assert events.get_final_message().stop_reason
    else:
        reply = client.messages.create(model="claude-x", max_tokens=6,
                                       messages=[{"role": "user", "content": content}])  # type: ignore[misc]
        assert reply.stop_reason


def _google(proxy: RunningProxy, key: str, stream: bool) -> None:
    client = genai.Client(api_key=key, http_options=types.HttpOptions(
        base_url=proxy.url, retry_options=types.HttpRetryOptions(attempts=1)))
    contents = [types.Content(role="user", parts=[types.Part(text=QUESTION),
                                                  types.Part.from_bytes(data=PNG, mime_type="image/png")])]
    config = types.GenerateContentConfig(max_output_tokens=6, temperature=0)
    if stream:
        assert list(client.models.generate_content_stream(model="gemini-x", contents=contents, config=config))
    else:
        assert client.models.generate_content(model="gemini-x", contents=contents, config=config).candidates
    client.close()


SDKS = {"openai_chat": _openai_chat, "openai_responses": _openai_responses, "anthropic": _anthropic,
        "google": _google}


def _assert_captured_as_the_processor_makes_it(record: dict[str, Any], model_dir: Any) -> None:
    messages = record["normalized_request"]["messages"]
    _, expected = processor_view(model_dir, messages)
    assert record["prompt_ids"] == expected
    spans = [(image["prompt_span"]["start"], image["prompt_span"]["end"]) for image in record["images"]]
    assert [(start, end - start) for start, end in spans] == pad_runs(expected)
    assert record["images"][0]["sha256"] == hashlib.sha256(PNG).hexdigest()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("front_end", sorted(SDKS))
def test_an_image_through_each_front_end_is_captured_as_the_models_processor_makes_it(
        vlm_proxy: RunningProxy, vllm_vlm_server: VLLMServer, front_end: str, stream: bool) -> None:
    key = f"vlm-{front_end}-{stream}"
    SDKS[front_end](vlm_proxy, key, stream)
    (record,) = _records(vlm_proxy, key)
    assert record["status"] == "ok" and record["stream"] is stream and record["prompt_mode"] == "chat"
    _assert_captured_as_the_processor_makes_it(record, vllm_vlm_server.model_dir)
    assert len(record["images"]) == 1 and record["images"][0]["prompt_span"]["end"] - \
        record["images"][0]["prompt_span"]["start"] == 15
    assert len(record["response_ids"]) == len(record["response_logprobs"]) > 0


def test_an_image_in_a_tool_result_reaches_the_model(vlm_proxy: RunningProxy, vllm_vlm_server: VLLMServer) -> None:
    """pi's ``read`` of a PNG, as Anthropic's protocol carries it: the tool result holds the image."""
    key = "vlm-tool-result"
    client = anthropic.Anthropic(base_url=vlm_proxy.url, api_key=key, max_retries=0)
    tools = [{"name": "read", "description": "Read a file", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
    client.messages.create(model="claude-x", max_tokens=6, tools=tools, messages=[  # type: ignore[arg-type]
        {"role": "user", "content": "What colour is in card.png?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read",
                                           "input": {"path": "card.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "Read image file [image/png]"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(PNG).decode()}}]}]}])
    (record,) = _records(vlm_proxy, key)
    tool_message = record["normalized_request"]["messages"][-1]
    assert tool_message["role"] == "tool" and tool_message["content"][1]["type"] == "image_url"
    messages, tools_sent = record["normalized_request"]["messages"], record["normalized_request"]["tools"]
    # vLLM validates the tools and renders them in its own model's key order (name, description, parameters)
    tools_rendered = [{"type": "function", "function": {key: tool["function"][key] for key in
                                                        ("name", "description", "parameters")}} for tool in tools_sent]
    _, expected = processor_view(vllm_vlm_server.model_dir, messages, tools_rendered)
    assert record["prompt_ids"] == expected and len(pad_runs(expected)) == 1


def test_the_audit_recomputes_a_multimodal_trace_and_sees_a_swapped_image(
        vlm_proxy: RunningProxy, vllm_vlm_server: VLLMServer, tmp_path: Path) -> None:
    """Done-when 3: transformers' Qwen2-VL, fed the trace's tokens and its images through the model's processor,
    scores the sampled tokens as vLLM did (float32 both: max |Δ| < 1e-4); with the trace's two images swapped (same
    size, other colours: the same placeholders) it does not, and the audit fails."""
    key = "vlm-audit"
    red, blue = png_url((112, 84), (220, 40, 40)), png_url((112, 84), (40, 40, 220))
    client = openai.OpenAI(base_url=f"{vlm_proxy.url}/v1", api_key=key, max_retries=0)
    client.chat.completions.create(model="gpt-x", max_tokens=24, temperature=1.0, seed=3, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Which is warmer, "},
                                     {"type": "image_url", "image_url": {"url": red}},
                                     {"type": "text", "text": " or "},
                                     {"type": "image_url", "image_url": {"url": blue}}]}])
    records = _records(vlm_proxy, key)
    trajectory = per_request(CompletionSession.model_validate({"session_id": key, "completions": records}),
                             MergeConfig())
    (row,) = [line.model_dump(mode="json") for line in trace_lines(trajectory)]
    assert [image["prompt_span"] for image in row["metadata"]["images"]] == [
        {"start": start, "end": start + length} for start, length in pad_runs(row["prompt_ids"])]
    traces = tmp_path / "traces.jsonl"
    traces.write_text(json.dumps(row) + "\n")
    assert audit_main(["--model", str(vllm_vlm_server.model_dir), str(traces)]) == 0
    summary = json.loads((tmp_path / "audit_summary.json").read_text())
    assert summary["audited"] == 1 and summary["metrics"]["audit/tokens"] == len(row["response_ids"]) > 0
    assert summary["metrics"]["audit/logprob_abs_diff_max"] < 1e-4

    swapped = json.loads(json.dumps(row).replace(red, "RED").replace(blue, red).replace("RED", blue))
    out = tmp_path / "swapped"
    out.mkdir()
    (out / "traces.jsonl").write_text(json.dumps(swapped) + "\n")
    assert audit_main(["--model", str(vllm_vlm_server.model_dir), str(out / "traces.jsonl")]) == 1
    summary = json.loads((out / "audit_summary.json").read_text())
    assert not summary["passed"] and summary["metrics"]["audit/logprob_abs_diff_max"] > 1e-3


def test_a_token_in_session_with_images_is_one_contiguous_chain(vllm_vlm_server: VLLMServer) -> None:
    """Done-when 2's engine half: in token_in mode each call extends the exact IDs the engine saw, images
    included. The proxy expands each new image's placeholder by the processor's resize rule and sends vLLM's
    token-in route the prompt collapsed, with the images; vLLM's expansion must equal ours (else the call fails),
    and the first prompt equals what transformers makes of the conversation."""
    from polar_gym.proxy.engines.vision import VLLMVisionTokenInEngine
    from polar_gym.proxy.parsers.base import parser_for
    from polar_gym.proxy.tokenizer import HFChatTokenizer

    client = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0),
                               limits=httpx.Limits(max_keepalive_connections=0))
    engine = VLLMVisionTokenInEngine(HFChatTokenizer(vllm_vlm_server.model_dir), parser_for("qwen3"),
                                     UpstreamPool([vllm_vlm_server.url]), client=client,
                                     upstream_model=vllm_vlm_server.model)
    key = "vlm-token-in"
    small, wide = png_url((96, 64), (200, 40, 40)), png_url((200, 60), (40, 200, 40))  # 6 and 14 placeholders
    for running in serve(ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True))):
        sdk = openai.OpenAI(base_url=f"{running.url}/v1", api_key=key, max_retries=0)
        messages: list[dict[str, Any]] = []
        for turn, (text, url) in enumerate([("What is this?", small), ("And this one?", wide), ("Compare.", None)]):
            content: Any = text if url is None else [{"type": "text", "text": text},
                                                     {"type": "image_url", "image_url": {"url": url}}]
            messages.append({"role": "user", "content": content})
            if turn < 2:
                reply = sdk.chat.completions.create(model="m", max_tokens=8, temperature=1.0, seed=turn,
                                                    messages=messages)  # type: ignore[arg-type]
                messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            else:  # the last turn streamed: the same route, read chunk by chunk
                assert list(sdk.chat.completions.create(model="m", max_tokens=8, temperature=1.0, seed=turn,
                                                        messages=messages, stream=True))  # type: ignore[arg-type]
        records = _records(running, key)
    assert [r["prompt_mode"] for r in records] == ["token_in"] * 3 and all(r["status"] == "ok" for r in records)
    for before, after in itertools.pairwise(records):  # one chain: each call extends the IDs of the one before
        assert after["prompt_ids"][:len(before["prompt_ids"]) + len(before["response_ids"])] == \
            before["prompt_ids"] + before["response_ids"]
        assert not any(n.startswith("token_in_new_chain") for n in after["normalizations"])
    _, expected = processor_view(vllm_vlm_server.model_dir, records[0]["normalized_request"]["messages"])
    assert records[0]["prompt_ids"] == expected
    spans = [image["prompt_span"] for image in records[2]["images"]]
    assert [s["end"] - s["start"] for s in spans] == [6, 14]
    assert [(s["start"], s["end"] - s["start"]) for s in spans] == pad_runs(records[2]["prompt_ids"])
