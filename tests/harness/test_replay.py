"""Replays of real harness traffic (tests/data/harness, recorded by scripts/record_harness_traffic.py) through a live
proxy, in both stream modes: the answer is 200 and parses with the official SDK's types, the journal holds the
request exactly as sent, and the front end knows every field the real harness sent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import httpx
import orjson
import pytest

from polar_gym.proxy.detect import split_google_path
from polar_gym.proxy.providers.base import Inbound, Route
from polar_gym.registry import PROVIDERS, RegistryError

pytestmark = pytest.mark.harness

DATA = Path(__file__).resolve().parents[1] / "data" / "harness"
CASES = sorted(DATA.glob("*/[0-9][0-9].json"))
#: request headers not worth replaying (connection management, encodings the test client may not decode)
_SKIP_HEADERS = {"connection", "accept-encoding", "host", "content-length"}
_AUTH = {"anthropic": "x-api-key", "google": "x-goog-api-key"}


def _load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def _require_provider(name: str) -> None:
    """Skip, naming the module, while a provider's front end has not landed."""
    try:
        PROVIDERS.get(name)
    except (RegistryError, ImportError) as exc:
        pytest.skip(f"polar_gym.proxy.providers.{name} is not available yet: {exc}")


def _variant(case: dict[str, Any], stream: bool) -> tuple[str, dict[str, Any]]:
    """The recorded request in the wanted stream mode: Google flips the action, the others the body's flag."""
    path, body = case["path"], dict(case["body"])
    if case["provider"] == "google":
        base = path.split(":", 1)[0]
        return (base + ":streamGenerateContent?alt=sse" if stream else base + ":generateContent"), body
    body["stream"] = stream
    if not stream:
        body.pop("stream_options", None)  # only meaningful (and only accepted by OpenAI) with stream true
    return path, body


def _route(path: str) -> Route:
    bare, _, query = path.partition("?")
    split = split_google_path(bare)
    model, action = split if split is not None else (None, None)
    return Route(bare, model=model, action=action, query=dict(parse_qsl(query)))


def _parse(provider: str, path: str, body: dict[str, Any]) -> Inbound:
    return PROVIDERS.get(provider)().parse(body, _route(path))  # type: ignore[no-any-return]


def _sse(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) pairs of a server-sent event stream."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if data:
            events.append((name, "\n".join(data)))
    return events


def _sdk_stream(sdk: Any, cast_to: Any, resp: httpx.Response) -> list[Any]:
    """Decode a stream with the SDK's own ``Stream`` class (its SSE decoder, strict validation of each event)."""
    import httpx2  # the HTTP library the official SDKs are built on

    client = sdk.Client(api_key="replay", base_url="http://127.0.0.1:1", _strict_response_validation=True)
    response = httpx2.Response(resp.status_code, headers=dict(resp.headers), content=resp.content,
                               request=httpx2.Request("POST", str(resp.request.url)))
    return list(sdk.Stream(cast_to=cast_to, response=response, client=client))


def _check_openai_chat(resp: httpx.Response, stream: bool) -> None:
    import openai
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    if not stream:
        ChatCompletion.model_validate(resp.json())
        return
    assert _sse(resp.text)[-1][1] == "[DONE]"
    chunks = _sdk_stream(openai, ChatCompletionChunk, resp)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


def _check_anthropic(resp: httpx.Response, stream: bool) -> None:
    import anthropic
    from anthropic.types import Message, RawMessageStreamEvent

    if not stream:
        Message.model_validate(resp.json())
        return
    assert all(name == json.loads(data)["type"] for name, data in _sse(resp.text))
    events = _sdk_stream(anthropic, RawMessageStreamEvent, resp)
    assert events[0].type == "message_start" and events[-1].type == "message_stop"


def _check_openai_responses(resp: httpx.Response, stream: bool) -> None:
    import openai
    from openai.types.responses import Response, ResponseStreamEvent

    if not stream:
        assert Response.model_validate(resp.json()).status == "completed"
        return
    assert all(name is None or name == json.loads(data)["type"] for name, data in _sse(resp.text))
    events = _sdk_stream(openai, ResponseStreamEvent, resp)
    assert events[0].type == "response.created" and events[-1].type == "response.completed"


def _check_google(resp: httpx.Response, stream: bool) -> None:
    from google.genai import types

    if not stream:
        types.GenerateContentResponse.model_validate(resp.json())
        return
    chunks = [types.GenerateContentResponse.model_validate_json(data) for _, data in _sse(resp.text)]
    last = chunks[-1].candidates
    assert last and last[0].finish_reason is not None


_CHECKS = {"openai_chat": _check_openai_chat, "anthropic": _check_anthropic,
           "openai_responses": _check_openai_responses, "google": _check_google}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
@pytest.mark.parametrize("case_path", CASES, ids=[f"{p.parent.name}/{p.stem}" for p in CASES])
def test_replay(proxy_server: Any, case_path: Path, stream: bool) -> None:
    """``proxy_server`` (tests/conftest.py): the oracle engine with the byte tokenizer, a file journal."""
    case = _load(case_path)
    provider = case["provider"]
    _require_provider(provider)
    path, body = _variant(case, stream)
    key = f"replay-{case_path.parent.name}-{case_path.stem}-{'stream' if stream else 'plain'}"
    headers = {k: v for k, v in case.get("headers", {}).items() if k not in _SKIP_HEADERS}
    headers["content-type"] = "application/json"
    if provider in _AUTH:
        headers[_AUTH[provider]] = key
    else:
        headers["authorization"] = f"Bearer {key}"
    sent = orjson.dumps(body)
    resp = httpx.post(proxy_server.url + path, content=sent, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text[:2000]
    assert resp.headers["content-type"].startswith("text/event-stream" if stream else "application/json")
    _CHECKS[provider](resp, stream)

    records = proxy_server.completions(key)
    assert len(records) == 1
    assert orjson.dumps(records[0]["request"]) == sent  # exactly as sent, key order included
    assert records[0]["path"] == path
    assert records[0]["stream"] is stream


@pytest.mark.parametrize("case_path", CASES, ids=[f"{p.parent.name}/{p.stem}" for p in CASES])
def test_real_traffic_has_no_unknown_fields(case_path: Path) -> None:
    case = _load(case_path)
    _require_provider(case["provider"])
    inbound = _parse(case["provider"], case["path"], case["body"])
    assert inbound.ignored_fields == []


@pytest.mark.parametrize("case_path", sorted(DATA.glob("claude_code/[0-9][0-9].json")),
                         ids=lambda p: p.stem)
def test_claude_code_billing_header_is_normalized_away(case_path: Path) -> None:
    case = _load(case_path)
    _require_provider("anthropic")
    assert "x-anthropic-billing-header" in json.dumps(case["body"]["system"])  # the recording does carry it
    inbound = _parse("anthropic", case["path"], case["body"])
    assert inbound.normalizations
    assert "x-anthropic-billing-header" not in inbound.chat.model_dump_json()


def test_every_target_was_recorded() -> None:
    runs = json.loads((DATA / "runs.json").read_text())
    recorded = {p.parent.name for p in CASES}
    assert recorded == {name for name, run in runs.items() if "skipped" not in run}
    for name in recorded:
        assert {"harness", "cli_version", "path", "provider", "body"} <= set(_load(DATA / name / "00.json"))
