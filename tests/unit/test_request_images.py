"""Issue 42: images in requests, checked once after any front end normalised them. Only inline base64 images of the
four documented types are taken, checked against their bytes, within a size and a count limit; an address is
refused (never fetched: an engine would fetch it from inside the cluster for whoever wrote the request), in each
protocol's own error shape. A taken image reaches the engine as an OpenAI ``image_url`` data URL whatever the front
end, and its record holds its SHA-256, type, size and placeholder span in the prompt."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import httpx
import pytest

from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.chat import ChatMessage, ChatRequest, ContentPart
from polar_gym.proxy.engines.sglang import SGLangEngine
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.errors import PayloadTooLarge, RequestError
from polar_gym.proxy.images import ImageLimits, image_refs, placeholder_runs, request_images
from polar_gym.proxy.providers.base import Route
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.settings import EngineSettings, build_engine
from polar_gym.proxy.tokenizer import image_token_id_in
from polar_gym.proxy.upstreams import UpstreamPool

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(40))  # the checks read the signature, not the pixels
PNG_B64 = base64.b64encode(PNG).decode()
PNG_URL = f"data:image/png;base64,{PNG_B64}"
PAD = 151655
PROMPT = [151644, 872, 198, 151652, PAD, PAD, PAD, PAD, 151653, 3838, 151645]


def _request(*urls: str) -> ChatRequest:
    parts = [ContentPart(type="text", text="what is it?")]
    parts += [ContentPart(type="image_url", image_url={"url": url}) for url in urls]
    return ChatRequest(model="m", messages=[ChatMessage(role="system", content="look"),
                                            ChatMessage(role="user", content=parts)])


def test_an_inline_image_is_described_by_its_bytes() -> None:
    (image,) = request_images(_request(PNG_URL), ImageLimits())
    assert (image.sha256, image.media_type, image.size) == (hashlib.sha256(PNG).hexdigest(), "image/png", len(PNG))
    assert image.where == "image 1 of the conversation"


@pytest.mark.parametrize(("url", "needle"), [
    ("http://169.254.169.254/latest/meta-data/x.png", "image addresses are not fetched (http)"),
    ("https://example.com/cat.png", "image addresses are not fetched (https)"),
    ("file:///etc/passwd", "image addresses are not fetched (file)"),
    ("gs://bucket/cat.png", "image addresses are not fetched (gs)"),
    ("/etc/passwd", "image addresses are not fetched (no scheme)"),
    (f"data:image/png,{PNG_B64}", "must be base64 data"),
    (f"data:image/svg+xml;base64,{PNG_B64}", "image type 'image/svg+xml' is not taken"),
    ("data:image/png;base64,not base64!", "does not decode"),
    (f"data:image/jpeg;base64,{PNG_B64}", "the image's bytes are not image/jpeg"),
    ("data:image/webp;base64," + base64.b64encode(b"RIFF\0\0\0\0WAVEfmt ").decode(), "are not image/webp"),
])
def test_what_cannot_be_taken_is_refused_with_where_and_why(url: str, needle: str) -> None:
    with pytest.raises(RequestError) as caught:
        request_images(_request(PNG_URL, url), ImageLimits())
    assert caught.value.message.startswith("image 2 of the conversation: ") and needle in caught.value.message


def test_the_limits_hold() -> None:
    with pytest.raises(PayloadTooLarge, match="an image of 48 bytes exceeds the limit of 47"):
        request_images(_request(PNG_URL), ImageLimits(max_image_bytes=47))
    with pytest.raises(PayloadTooLarge, match="3 images in the conversation exceed the limit of 2"):
        request_images(_request(PNG_URL, PNG_URL, PNG_URL), ImageLimits(max_images=2))
    with pytest.raises(PayloadTooLarge, match="this model takes no images"):
        request_images(_request(PNG_URL), ImageLimits(max_images=0))
    assert request_images(_request(), ImageLimits(max_images=0)) == []


def test_spans_are_the_runs_of_the_image_token_one_per_image() -> None:
    assert placeholder_runs([PAD, 1, PAD, PAD, 2, PAD], PAD) == [(0, 1), (2, 4), (5, 6)]
    images = request_images(_request(PNG_URL), ImageLimits())
    refs, note = image_refs(images, PROMPT, PAD)
    assert note is None and refs[0]["prompt_span"] == {"start": 4, "end": 8}
    refs, note = image_refs(images, PROMPT, None)
    assert refs[0]["prompt_span"] is None and note is not None and "no tokenizer" in note
    refs, note = image_refs(images * 2, PROMPT, PAD)  # two images, one run: which is which is not known
    assert [r["prompt_span"] for r in refs] == [None, None] and note is not None and "1 placeholder runs" in note


def test_the_image_token_is_read_from_the_tokenizers_added_tokens(tmp_path: Any) -> None:
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [
        {"id": 151643, "content": "<|endoftext|>"}, {"id": PAD, "content": "<|image_pad|>"}]}))
    assert image_token_id_in(tmp_path) == PAD
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": PAD, "content": "[PAD151655]"}]}))
    assert image_token_id_in(tmp_path) is None  # a text model's tokenizer names no image token
    assert image_token_id_in(tmp_path / "missing") is None


def test_an_engine_built_with_the_models_tokenizer_knows_its_image_token(tmp_path: Any) -> None:
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": PAD, "content": "<|image_pad|>"}]}))
    settings = {"engine": "vllm", "upstreams": ["http://engine"], "prompt_mode": "chat"}
    assert build_engine(EngineSettings.model_validate({**settings, "tokenizer": str(tmp_path)})).image_token_id == PAD
    assert build_engine(EngineSettings.model_validate(settings)).image_token_id is None  # no tokenizer: not known


#: one image through each front end, in its own protocol's form
CALLS: dict[str, tuple[Route, dict[str, Any]]] = {
    "openai_chat": (Route("/v1/chat/completions"), {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": PNG_URL}}]}]}),
    "anthropic": (Route("/v1/messages"), {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}}]}]}),
    "openai_responses": (Route("/v1/responses"), {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what?"}, {"type": "input_image", "image_url": PNG_URL}]}]}),
    "google": (Route("/v1beta/models/m:generateContent", model="m", action="generateContent"), {"contents": [
        {"role": "user", "parts": [{"text": "what?"}, {"inline_data": {"mime_type": "image/png", "data": PNG_B64}}]}]}),
}
#: each front end's error body, as its SDK reads it
ERROR_MESSAGE = {
    "openai_chat": lambda body: body["error"]["message"], "openai_responses": lambda body: body["error"]["message"],
    "anthropic": lambda body: body["error"]["message"], "google": lambda body: body["error"]["message"],
}


def _answer() -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "prompt_token_ids": PROMPT,
            "choices": [{"index": 0, "finish_reason": "stop", "token_ids": [9454, 151645],
                         "message": {"role": "assistant", "content": "A cat."},
                         "logprobs": {"content": [{"token": "x", "logprob": -0.5}, {"token": "y", "logprob": -0.1}]}}],
            "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": 2}}


def _sglang_answer() -> dict[str, Any]:
    """SGLang's OpenAI chat answer with return_prompt_token_ids and return_meta_info."""
    answer = _answer()
    choice = answer["choices"][0]
    choice.update(prompt_token_ids=answer.pop("prompt_token_ids"), meta_info={
        "output_token_logprobs": [[-0.5, 9454, None], [-0.1, 151645, None]]})
    return answer


def _service(sent: list[dict[str, Any]], engine_kind: str = "vllm") -> ProxyService:
    def upstream(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json=_answer() if engine_kind == "vllm" else _sglang_answer())

    kind = VLLMEngine if engine_kind == "vllm" else SGLangEngine
    engine = kind(UpstreamPool(["http://engine"]), client=httpx.AsyncClient(transport=httpx.MockTransport(upstream)))
    engine.image_token_id = PAD
    engine.stream_passthrough = False
    return ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True))


HEADERS = {"x-api-key": "s1", "x-goog-api-key": "s1", "authorization": "Bearer s1"}


@pytest.mark.parametrize("engine_kind", ["vllm", "sglang"])
@pytest.mark.parametrize("front_end", sorted(CALLS))
async def test_each_front_end_sends_the_image_as_a_data_url_and_records_it(front_end: str, engine_kind: str) -> None:
    """Chat mode on either engine: the image reaches its OpenAI server as a data URL, and the record names it."""
    sent: list[dict[str, Any]] = []
    service = _service(sent, engine_kind)
    route, body = CALLS[front_end]
    reply = await service.handle(front_end, json.dumps(body).encode(), route, HEADERS)
    assert reply.status == 200, reply.body
    (upstream_body,) = sent
    (user,) = [m for m in upstream_body["messages"] if m["role"] == "user"]
    assert {"type": "image_url", "image_url": {"url": PNG_URL}} in user["content"]
    (record,) = await service.completions("s1")
    assert record.images == [{"sha256": hashlib.sha256(PNG).hexdigest(), "media_type": "image/png",
                               "size": len(PNG), "prompt_span": {"start": 4, "end": 8}}]


@pytest.mark.parametrize("front_end", sorted(CALLS))
async def test_an_image_address_is_refused_in_each_protocols_shape_and_never_sent(front_end: str) -> None:
    sent: list[dict[str, Any]] = []
    service = _service(sent)
    route, body = CALLS[front_end]
    text = json.dumps(body)
    for old in (PNG_URL, PNG_B64):  # Google and Anthropic name an address in their own fields
        text = text.replace(json.dumps(old)[1:-1], "http://169.254.169.254/latest/meta-data/", 1)
    hostile = json.loads(text)
    if front_end == "anthropic":
        hostile["messages"][0]["content"][1]["source"] = {"type": "url", "url": "http://169.254.169.254/x.png"}
    if front_end == "google":
        hostile["contents"][0]["parts"][1] = {"file_data": {"file_uri": "http://169.254.169.254/x.png",
                                                            "mime_type": "image/png"}}
    reply = await service.handle(front_end, json.dumps(hostile).encode(), route, HEADERS)
    assert reply.status == 400, reply.body
    message = ERROR_MESSAGE[front_end](json.loads(reply.body))
    # named by its rank, which every protocol keeps (a system prompt or Google's contents shift the positions)
    assert message.startswith("image 1 of the conversation: image addresses are not fetched (http)"), message
    assert sent == [] and await service.completions("s1") == []


async def test_googles_url_safe_base64_reaches_the_engine_in_the_standard_alphabet() -> None:
    """The google-genai SDK writes bytes URL-safe (proto3 JSON reads both alphabets): the same image."""
    png = PNG + b"\xfb\xff\xbf\xfe"  # bytes whose base64 holds both + and /
    standard = base64.b64encode(png).decode()
    assert "+" in standard and "/" in standard
    sent: list[dict[str, Any]] = []
    service = _service(sent)
    route, body = CALLS["google"]
    body = json.loads(json.dumps(body))
    body["contents"][0]["parts"][1]["inline_data"]["data"] = base64.urlsafe_b64encode(png).decode().rstrip("=")
    reply = await service.handle("google", json.dumps(body).encode(), route, HEADERS)
    assert reply.status == 200, reply.body
    (user,) = sent[0]["messages"]
    assert user["content"][1]["image_url"]["url"] == f"data:image/png;base64,{standard}"
    (record,) = await service.completions("s1")
    assert record.images[0]["sha256"] == hashlib.sha256(png).hexdigest()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_token_in_engine_refuses_an_image_it_would_lose(tok: Any, stream: bool) -> None:
    """token_in renders the chat template's text: until it carries images, a call with one is refused (the caller's
    400, journaled as an error) rather than answered from a prompt without it."""
    from polar_gym.proxy.engines.tokenin import VLLMTokenInEngine
    from polar_gym.proxy.parsers.base import parser_for

    sent: list[bytes] = []
    engine = VLLMTokenInEngine(tok, parser_for("qwen3"), UpstreamPool(["http://engine"]), client=httpx.AsyncClient(
        transport=httpx.MockTransport(lambda r: sent.append(r.content) or httpx.Response(500))))
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True))
    route, body = CALLS["openai_chat"]
    reply = await service.handle("openai_chat", json.dumps({**body, "stream": stream}).encode(), route, HEADERS)
    assert reply.status == 400 and "prompt_mode chat" in json.loads(reply.body)["error"]["message"]
    (record,) = await service.completions("s1")
    assert record.status == "error" and record.images and sent == []


def test_placeholders_expand_by_the_processors_resize_rule_and_collapse_back() -> None:
    from polar_gym.proxy.images import ImageGrid, collapse_placeholders, expand_placeholders
    from polar_gym.tiny_vlm import PROCESSOR_CONFIG

    grid = ImageGrid.from_config(PROCESSOR_CONFIG)
    assert grid is not None and ImageGrid.from_config({"patch_size": 14}) is None
    assert [grid.placeholders(w, h) for w, h in [(96, 64), (200, 60), (20, 20), (4000, 3000)]] == [6, 14, 4, 54]
    ids = [1, PAD, 2, PAD, 3]
    expanded = expand_placeholders(ids, PAD, [3, 2])
    assert expanded == [1, PAD, PAD, PAD, 2, PAD, PAD, 3] and collapse_placeholders(expanded, PAD) == ids
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        expand_placeholders(ids, PAD, [3])


def _vision_model(tmp_path: Any) -> Any:
    """A vision model's tokenizer folder (the built Qwen tokenizer with the tiny VLM's edits), no weights."""
    import shutil

    from polar_gym.assets import tokenizer_dir
    from polar_gym.tiny_vlm import PROCESSOR_CONFIG, multimodal_template, name_vision_tokens

    if not (tokenizer_dir() / ".complete").exists():
        pytest.skip("the Qwen tokenizer is not built (bash scripts/setup.sh)")
    model = tmp_path / "vlm"
    shutil.copytree(tokenizer_dir(), model)
    (model / "tokenizer.json").write_text(json.dumps(name_vision_tokens(json.loads(
        (tokenizer_dir() / "tokenizer.json").read_text()))))
    template = (tokenizer_dir() / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(multimodal_template(template))
    (model / "preprocessor_config.json").write_text(json.dumps(PROCESSOR_CONFIG))
    return model


async def test_a_vision_token_in_call_sends_the_collapsed_prompt_and_its_images_to_the_token_in_route(
        tmp_path: Any) -> None:
    """The body vLLM's token-in route takes: every run of placeholders collapsed to one, the images as content
    parts in order; the answer's expanded prompt must be the planned one (here the fake says so)."""
    from polar_gym.proxy.engines.vision import VISION_ROUTE, VLLMVisionTokenInEngine
    from polar_gym.proxy.parsers.base import parser_for
    from polar_gym.proxy.tokenizer import HFChatTokenizer
    from polar_gym.tasks.demo import solid_png

    model = _vision_model(tmp_path)
    url = "data:image/png;base64," + base64.b64encode(solid_png(96, 64, (1, 2, 3))).decode()
    sent: list[tuple[str, dict[str, Any]]] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append((request.url.path, body))
        ids = body["token_ids"]
        at = ids.index(PAD)
        expanded = ids[:at] + [PAD] * 6 + ids[at + 1:]
        return httpx.Response(200, json={"output_mode": "text", "prompt_token_ids": expanded, "choices": [{
            "index": 0, "token_ids": [9454, 151645], "text": "Red.", "finish_reason": "stop",
            "logprobs": {"content": [{"token": "Red", "logprob": -0.5}, {"token": ".", "logprob": -0.1}]}}]})

    engine = VLLMVisionTokenInEngine(HFChatTokenizer(model), parser_for("qwen3"), UpstreamPool(["http://engine"]),
                                     client=httpx.AsyncClient(transport=httpx.MockTransport(upstream)))
    engine.cut_non_streamed = False
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True))
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": url}}]}]}
    reply = await service.handle("openai_chat", json.dumps(body).encode(), Route("/v1/chat/completions"), HEADERS)
    assert reply.status == 200, reply.body
    ((path, upstream_body),) = sent
    assert path == VISION_ROUTE and upstream_body["content_parts"] == [{"type": "image_url", "url": url}]
    assert upstream_body["token_ids"].count(PAD) == 1 and upstream_body["sampling_params"]["logprobs"] == 0
    (record,) = await service.completions("s1")
    assert record.prompt_ids.count(PAD) == 6 and record.images[0]["prompt_span"]["end"] - \
        record.images[0]["prompt_span"]["start"] == 6


def test_a_cut_image_call_continues_on_the_token_in_route_with_its_images(tmp_path: Any) -> None:
    """A weight update cuts a call with images: the rest is asked of the same route, from the prompt vLLM expanded
    and the tokens sampled so far, collapsed again (vLLM expands only an unexpanded prompt), with the same images
    and what is left of the token budget."""
    from polar_gym.proxy.engines.vision import VISION_ROUTE, VLLMVisionTokenInEngine
    from polar_gym.proxy.parsers.base import parser_for
    from polar_gym.proxy.tokenizer import HFChatTokenizer

    engine = VLLMVisionTokenInEngine(HFChatTokenizer(_vision_model(tmp_path)), parser_for("qwen3"),
                                     UpstreamPool(["http://engine"]))
    parts = [{"type": "image_url", "url": PNG_URL}]
    body = {"model": "m", "token_ids": [1, 151652, PAD, 151653, 2], "content_parts": parts,
            "sampling_params": {"max_tokens": 10, "temperature": 1.0}, "output_mode": "text", "stream": True}
    expanded_and_sampled = [1, 151652, *[PAD] * 6, 151653, 2, 40, 41, 42]
    following = engine.continuation_body(body, expanded_and_sampled, 3)
    assert following is not None and engine.route_of(following) == VISION_ROUTE
    assert following["token_ids"] == [1, 151652, PAD, 151653, 2, 40, 41, 42]
    assert following["content_parts"] == parts and following["sampling_params"] == {"max_tokens": 7,
                                                                                     "temperature": 1.0}
    assert engine.continuation_body(body, expanded_and_sampled, 10) is None  # the budget is spent


@pytest.mark.parametrize("header", ["corrupt", "bomb"])
async def test_a_png_whose_header_lies_is_the_callers_400_in_token_in_mode(tmp_path: Any, header: str) -> None:
    """A hostile picture that passes the signature check: garbage after the signature, or a header that claims
    50,000 x 50,000 pixels (a decompression bomb). Placing it is the caller's error, never sent upstream."""
    import struct
    import zlib

    from polar_gym.proxy.engines.vision import VLLMVisionTokenInEngine
    from polar_gym.proxy.parsers.base import parser_for
    from polar_gym.proxy.tokenizer import HFChatTokenizer

    if header == "corrupt":
        data = PNG
    else:
        ihdr = struct.pack(">IIBBBBB", 50_000, 50_000, 8, 2, 0, 0, 0)
        data = (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr
                + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr)))
    sent: list[bytes] = []
    engine = VLLMVisionTokenInEngine(HFChatTokenizer(_vision_model(tmp_path)), parser_for("qwen3"),
                                     UpstreamPool(["http://engine"]), client=httpx.AsyncClient(
            transport=httpx.MockTransport(lambda r: sent.append(r.content) or httpx.Response(500))))
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True))
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": url}}]}]}
    reply = await service.handle("openai_chat", json.dumps(body).encode(), Route("/v1/chat/completions"), HEADERS)
    assert reply.status == 400, reply.body
    assert "an image cannot be placed in the prompt" in json.loads(reply.body)["error"]["message"]
    assert sent == []

