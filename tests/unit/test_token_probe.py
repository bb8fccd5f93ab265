"""Issue 41: a token_in proxy in front of an upstream that serves only chat answered every call 502. At start-up
the token-in engines, and the launch's upstream check, send one minimal token prompt the way real calls do; a
refusal names the URL, the route and the answer and says to use prompt_mode chat; an accepted one passes."""

from __future__ import annotations

import io
import json
import threading
from typing import Any

import httpx
import pytest
from rich.console import Console

from polar_gym.fleet.settings import InferenceSettings
from polar_gym.fleet.upstreams import UpstreamCheckFailed, ensure_upstreams
from polar_gym.proxy.cli import probe_token_upstreams
from polar_gym.proxy.engines.token_prompts import token_probe, token_probe_answer
from polar_gym.proxy.engines.tokenin import SGLangTokenInEngine, VLLMTokenInEngine
from polar_gym.proxy.errors import UpstreamUnavailable
from polar_gym.proxy.parsers.base import parser_for
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool
from tests._serving import free_port, json_server

URL = "http://engine:8000"
MODELS = {"object": "list", "data": [{"id": "served-model", "object": "model"}]}
NOT_FOUND = (404, {"detail": "Not Found"})
COMPLETION = {"id": "c", "object": "text_completion", "model": "served-model",
              "choices": [{"index": 0, "text": "!", "finish_reason": "length", "prompt_token_ids": [1, 2],
                           "token_ids": [0], "logprobs": {"token_logprobs": [-0.5]}}]}
GENERATED = {"text": "!", "output_ids": [0], "meta_info": {"output_token_logprobs": [[-0.5, 0, None]],
                                                            "finish_reason": {"type": "length"}}}


class Upstream:
    """An httpx transport playing an inference server: route -> (status, JSON body); records what was sent."""

    def __init__(self, routes: dict[str, tuple[int, Any]]) -> None:
        self.routes, self.sent = routes, list[tuple[str, str, Any]]()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.sent.append((request.method, request.url.path, body))
        status, answer = self.routes.get(request.url.path, NOT_FOUND)
        return httpx.Response(status, json=answer)


def engine_for(cls: type[VLLMTokenInEngine] | type[SGLangTokenInEngine], tok: HFChatTokenizer, upstream: Upstream,
               upstream_model: str | None = None) -> VLLMTokenInEngine | SGLangTokenInEngine:
    client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
    return cls(tok, parser_for("qwen3"), UpstreamPool([URL]), client=client, upstream_model=upstream_model)


async def test_a_chat_only_upstream_refuses_the_probe_with_a_message_naming_prompt_mode_chat(
        tok: HFChatTokenizer) -> None:
    upstream = Upstream({"/v1/models": (200, MODELS), "/v1/chat/completions": (200, {})})
    engine = engine_for(VLLMTokenInEngine, tok, upstream)
    message = await engine.probe_token_prompt(URL)
    assert message == (f"upstream {URL} refused a token prompt (POST {URL}/v1/completions answered HTTP 404: "
                       '{"detail":"Not Found"}); this upstream does not take token prompts: use prompt_mode chat '
                       "(--prompt-mode chat / inference.prompt_mode=chat)")
    await engine.aclose()


async def test_the_probe_is_one_token_of_a_real_calls_body_and_a_well_formed_answer_passes(
        tok: HFChatTokenizer) -> None:
    upstream = Upstream({"/v1/models": (200, MODELS), "/v1/completions": (200, COMPLETION)})
    engine = engine_for(VLLMTokenInEngine, tok, upstream)
    assert await engine.probe_token_prompt(URL) is None
    (_, models, _), (method, route, body) = upstream.sent
    assert models == "/v1/models" and (method, route) == ("POST", "/v1/completions")
    # vLLM refuses a model name it does not serve: the first it lists is sent
    assert body["model"] == "served-model" and body["max_tokens"] == 1 and body["return_token_ids"] is True
    assert body["prompt"] == tok.encode("Hi")[:4] and all(isinstance(t, int) for t in body["prompt"])
    assert body["stop_token_ids"] == tok.end_of_turn_ids
    named = Upstream({"/v1/completions": (200, COMPLETION)})
    engine = engine_for(VLLMTokenInEngine, tok, named, upstream_model="policy")
    assert await engine.probe_token_prompt(URL) is None
    assert [(m, r) for m, r, _ in named.sent] == [("POST", "/v1/completions")] and named.sent[0][2]["model"] == "policy"


async def test_sglang_is_probed_on_generate_with_input_ids(tok: HFChatTokenizer) -> None:
    upstream = Upstream({"/generate": (200, GENERATED)})
    engine = engine_for(SGLangTokenInEngine, tok, upstream)
    assert await engine.probe_token_prompt(URL) is None
    ((method, route, body),) = upstream.sent  # no model field: no /v1/models call
    assert (method, route) == ("POST", "/generate") and body["sampling_params"]["max_new_tokens"] == 1
    assert body["input_ids"] == tok.encode("Hi")[:4] and "model" not in body
    refusing = engine_for(SGLangTokenInEngine, tok, Upstream({}))
    message = await refusing.probe_token_prompt(URL)
    assert message is not None and f"POST {URL}/generate answered HTTP 404" in message
    assert message.endswith("use prompt_mode chat (--prompt-mode chat / inference.prompt_mode=chat)")


async def test_an_upstream_that_does_not_answer_is_a_warning_not_a_refusal(tok: HFChatTokenizer) -> None:
    def unreachable(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    engine = engine_for(VLLMTokenInEngine, tok, Upstream({}))
    client = httpx.AsyncClient(transport=httpx.MockTransport(unreachable))
    with pytest.raises(UpstreamUnavailable):
        await engine.probe_token_prompt(URL, client=client)
    refused, silent = await probe_token_upstreams(engine, [URL], client=client)
    assert refused == [] and len(silent) == 1 and URL in silent[0] and "may start later" in silent[0]
    busy = httpx.AsyncClient(transport=httpx.MockTransport(Upstream({"/v1/models": (200, MODELS),
                                                                     "/v1/completions": (503, {})})))
    refused, silent = await probe_token_upstreams(engine, [URL], client=busy)
    assert refused == [] and len(silent) == 1 and "is busy (503)" in silent[0]
    chat_only = httpx.AsyncClient(transport=httpx.MockTransport(Upstream({"/v1/models": (200, MODELS)})))
    refused, silent = await probe_token_upstreams(engine, [URL + "/"], client=chat_only)
    assert silent == [] and len(refused) == 1 and "prompt_mode chat" in refused[0]
    for http in (client, busy, chat_only):
        await http.aclose()
    await engine.aclose()


def test_the_launch_probe_is_the_real_calls_body_without_a_tokenizer() -> None:
    route, body = token_probe("vllm", [0, 1, 2, 3], "served-model")
    assert route == "/v1/completions" and body["prompt"] == [0, 1, 2, 3] and body["max_tokens"] == 1
    assert body["model"] == "served-model" and "model" not in token_probe("vllm", [0], None)[1]
    route, body = token_probe("sglang_generate", [0, 1], None)
    assert route == "/generate" and body["input_ids"] == [0, 1] and body["sampling_params"]["max_new_tokens"] == 1
    assert token_probe_answer(200, json.dumps(COMPLETION).encode()) is None
    assert token_probe_answer(404, b'{"detail":"Not Found"}') == 'HTTP 404: {"detail":"Not Found"}'
    assert token_probe_answer(200, b"<html>hi</html>") == "HTTP 200 but not a JSON object ('<html>hi</html>')"


def chat_only(method: str, path: str) -> tuple[int, Any]:
    return (200, MODELS) if path == "/v1/models" else NOT_FOUND


def token_server(method: str, path: str) -> tuple[int, Any]:
    return (200, MODELS) if path == "/v1/models" else (200, COMPLETION) if path == "/v1/completions" else NOT_FOUND


async def test_the_launch_check_stops_on_an_upstream_that_refuses_token_prompts() -> None:
    console = Console(record=True, file=io.StringIO(), width=400)
    with json_server(chat_only) as url:
        token_in = InferenceSettings(engine="vllm", upstreams=[url], prompt_mode="token_in")
        with pytest.raises(UpstreamCheckFailed) as err:
            await ensure_upstreams(token_in, [url], console)
        chat = await ensure_upstreams(InferenceSettings(engine="vllm", upstreams=[url]), [url], console)
    assert str(err.value).splitlines() == [
        "inference upstream check failed (engine vllm, prompt mode token_in); no session was started:",
        f"  {url}: refused a token prompt (POST {url}/v1/completions answered HTTP 404: {{\"detail\": \"Not Found\"}})",
        "this upstream does not take token prompts: use prompt_mode chat (--prompt-mode chat / "
        "inference.prompt_mode=chat)"]
    assert [c.ok for c in chat] == [True]  # chat mode: no token prompt is sent


async def test_the_launch_check_passes_an_upstream_that_takes_token_prompts() -> None:
    console = Console(record=True, file=io.StringIO(), width=400)
    dead = f"http://127.0.0.1:{free_port()}"
    with json_server(token_server) as url:
        settings = InferenceSettings(engine="vllm", upstreams=[url], tokenizer="/any/tokenizer")  # null: token_in
        (check,) = await ensure_upstreams(settings, [url], console)
    assert check.ok and check.answer == "serves ['served-model'], takes token prompts"
    assert "inference upstreams ok" in console.export_text()
    with pytest.raises(UpstreamCheckFailed, match="connection refused"):  # the /v1/models check comes first
        await ensure_upstreams(InferenceSettings(engine="sglang", upstreams=[dead], prompt_mode="token_in"), [dead],
                               console)


async def test_a_first_token_slower_than_a_probe_passes_within_the_token_probe_budget() -> None:
    """A just-started engine's first sampled token (its first forward pass, on a busy CPU node) took longer than
    the 10 s a GET /v1/models may take, and the launch stopped with exit code 3 on a healthy engine: the token
    prompt has its own budget, ``inference.preflight_token_timeout``, and its message names the one that ran out."""
    console = Console(record=True, file=io.StringIO(), width=400)
    released = threading.Event()

    def slow_first_token(method: str, path: str) -> tuple[int, Any]:
        if path == "/v1/completions":
            released.wait(0.5)  # longer than preflight_timeout below, well within preflight_token_timeout
        return token_server(method, path)

    with json_server(slow_first_token) as url:
        base = InferenceSettings(engine="vllm", upstreams=[url], prompt_mode="token_in", preflight_timeout=0.2)
        (check,) = await ensure_upstreams(base, [url], console)
        with pytest.raises(UpstreamCheckFailed, match=r"no answer within 0\.1 s"):
            await ensure_upstreams(base.model_copy(update={"preflight_token_timeout": 0.1}), [url], console)
        released.set()
    assert check.ok and check.answer.endswith("takes token prompts")
