"""The official google-genai SDK against a running proxy: generateContent plain and streamed (SSE), a
function-calling round trip played by the oracle, thoughts, countTokens, both API versions and errors; plus raw
HTTP for what the SDK never sends (streamGenerateContent as a JSON array, ``?key=`` auth)."""

from __future__ import annotations

import itertools

import httpx
import pytest
from google import genai
from google.genai import errors, types

from tests.sdk._sdk_kit import closing

pytestmark = pytest.mark.sdk

SHELL = types.FunctionDeclaration(
    name="run_shell_command", description="Run a shell command",
    parameters=types.Schema(type="OBJECT", properties={"command": types.Schema(type="STRING"),
                                                       "timeout": types.Schema(type="INTEGER", nullable=True)},
                            required=["command"]))
NO_AFC = types.AutomaticFunctionCallingConfig(disable=True)
FINAL = "All done: out.txt holds hello."


def client(proxy, key: str, api_version: str = "v1beta") -> genai.Client:
    """Keep the returned client referenced while using it: a collected Client closes its HTTP client."""
    options = types.HttpOptions(base_url=proxy.url, api_version=api_version,
                                retry_options=types.HttpRetryOptions(attempts=1))
    return closing(genai.Client(api_key=key, http_options=options))


def tool_config(**kwargs: object) -> types.GenerateContentConfig:
    return types.GenerateContentConfig(tools=[types.Tool(function_declarations=[SHELL])],
                                       automatic_function_calling=NO_AFC, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("version", ["v1beta", "v1"])
def test_generate_content_plain(proxy_server, version):
    key = f"google-plain-{version}"
    c = client(proxy_server, key, version)
    resp = c.models.generate_content(model="gemini-2.5-pro", contents="Say hello",
                                     config=types.GenerateContentConfig(system_instruction="Be brief"))
    assert resp.text == FINAL
    assert resp.candidates[0].finish_reason == types.FinishReason.STOP
    assert resp.model_version == "gemini-2.5-pro"
    records = proxy_server.completions(key)
    assert len(records) == 1 and records[0]["path"] == f"/{version}/models/gemini-2.5-pro:generateContent"
    assert resp.usage_metadata.prompt_token_count == len(records[0]["prompt_ids"])
    assert resp.usage_metadata.candidates_token_count == len(records[0]["response_ids"])
    assert resp.usage_metadata.total_token_count == (len(records[0]["prompt_ids"])
                                                     + len(records[0]["response_ids"]))
    assert records[0]["normalized_request"]["messages"][0] == {"role": "system", "content": "Be brief"}
    # thoughts are not shown unless asked for
    assert not any(p.thought for p in resp.candidates[0].content.parts)


def test_generate_content_stream_text(proxy_server):
    c = client(proxy_server, "google-stream")
    chunks = list(c.models.generate_content_stream(model="gemini-2.5-flash", contents="Say hello"))
    assert "".join(c.text or "" for c in chunks) == FINAL
    assert [c.candidates[0].finish_reason for c in chunks][-1] == types.FinishReason.STOP
    assert all(c.candidates[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].usage_metadata.total_token_count > 0
    record = proxy_server.completions("google-stream")[0]
    assert record["stream"] is True and record["path"].endswith(":streamGenerateContent?alt=sse")


def test_function_calling_round_trip_extends_the_prompt(proxy_server):
    key = "google-tools"
    c = client(proxy_server, key)
    models = c.models
    contents: list[types.Content] = [types.Content(role="user", parts=[types.Part(text="Make out.txt")])]
    first = models.generate_content(model="gemini-2.5-pro", contents=contents, config=tool_config())
    calls = first.function_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].name == "run_shell_command" and calls[0].args == {"command": "echo hello > out.txt"}
    assert calls[0].id  # a client that never sent ids gets them, and may echo them back
    assert first.candidates[0].finish_reason == types.FinishReason.STOP

    contents.append(first.candidates[0].content)
    contents.append(types.Content(role="user", parts=[types.Part.from_function_response(
        name="run_shell_command", response={"output": ""})]))  # no id: matched by name and order
    second = models.generate_content(model="gemini-2.5-pro", contents=contents, config=tool_config())
    assert second.function_calls[0].args == {"command": "cat out.txt"}

    contents += [second.candidates[0].content, types.Content(role="user", parts=[types.Part(
        function_response=types.FunctionResponse(id=second.function_calls[0].id, name="run_shell_command",
                                                 response={"output": "hello"}))])]
    third = models.generate_content(model="gemini-2.5-pro", contents=contents, config=tool_config())
    assert third.text == FINAL and not third.function_calls

    records = proxy_server.completions(key)
    assert [r["index"] for r in records] == [0, 1, 2]
    for earlier, later in itertools.pairwise(records):
        assert later["prompt_ids"][: len(earlier["prompt_ids"])] == earlier["prompt_ids"]
        assert len(later["prompt_ids"]) > len(earlier["prompt_ids"])
    tools = [m for m in records[2]["normalized_request"]["messages"] if m["role"] == "tool"]
    calls_made = [c["id"] for m in records[2]["normalized_request"]["messages"] for c in m.get("tool_calls", [])]
    assert [m["tool_call_id"] for m in tools] == calls_made and [m["content"] for m in tools] == ["", "hello"]
    params = records[0]["normalized_request"]["tools"][0]["function"]["parameters"]
    assert params["type"] == "object" and params["properties"]["timeout"]["type"] == ["integer", "null"]


def test_function_calling_mode_none_answers_in_text(proxy_server):
    config = tool_config(tool_config=types.ToolConfig(
        function_calling_config=types.FunctionCallingConfig(mode="NONE")))
    c = client(proxy_server, "google-none")
    resp = c.models.generate_content(model="gemini-2.5-pro", contents="Make out.txt", config=config)
    assert resp.text == FINAL and not resp.function_calls


def test_streamed_function_call(proxy_server):
    c = client(proxy_server, "google-stream-tools")
    chunks = list(c.models.generate_content_stream(model="gemini-2.5-pro", contents="Make out.txt",
                                                   config=tool_config()))
    calls = [fc for c in chunks for fc in c.function_calls or []]
    assert [fc.args["command"] for fc in calls] == ["echo hello > out.txt"]
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP


@pytest.mark.parametrize("stream", [False, True])
def test_thoughts_when_asked(proxy_server, stream):
    config = types.GenerateContentConfig(thinking_config=types.ThinkingConfig(include_thoughts=True,
                                                                              thinking_budget=1024))
    c = client(proxy_server, f"google-think-{stream}")
    models = c.models
    if stream:
        chunks = list(models.generate_content_stream(model="gemini-2.5-pro", contents="hi", config=config))
        parts = [p for c in chunks for p in c.candidates[0].content.parts]
        text = "".join(c.text or "" for c in chunks)
        assert chunks[0].candidates[0].content.parts[0].thought is True
    else:
        resp = models.generate_content(model="gemini-2.5-pro", contents="hi", config=config)
        parts, text = resp.candidates[0].content.parts, resp.text
    thoughts = [p.text for p in parts if p.thought]
    assert thoughts == ["The reference solution is complete."]
    assert text == FINAL  # the SDK keeps thoughts out of .text


@pytest.mark.parametrize("version", ["v1beta", "v1"])
def test_count_tokens(proxy_server, version):
    c = client(proxy_server, f"google-count-{version}", version)
    counted = c.models.count_tokens(model="gemini-2.5-pro", contents="Say hello")
    resp = c.models.generate_content(model="gemini-2.5-pro", contents="Say hello")
    assert counted.total_tokens == resp.usage_metadata.prompt_token_count > 0


def test_bad_request_is_a_readable_client_error(proxy_server):
    c = client(proxy_server, "google-bad")
    with pytest.raises(errors.ClientError) as info:
        c.models.generate_content(model="gemini-2.5-pro", contents="hi",
                                  config=types.GenerateContentConfig(candidate_count=2))
    assert info.value.code == 400 and info.value.status == "INVALID_ARGUMENT"
    assert "candidateCount" in info.value.message and "only 1" in info.value.message
    with pytest.raises(errors.ClientError) as info:
        c.models.generate_content(model="gemini-2.5-pro", contents="hi",
                                  config=types.GenerateContentConfig(cached_content="cachedContents/abc"))
    assert "cachedContent" in info.value.message
    assert proxy_server.completions("google-bad") == []


def test_stream_without_sse_is_one_json_array_and_key_in_query(proxy_server):
    body = {"contents": [{"role": "user", "parts": [{"text": "Make out.txt"}]}],
            "tools": [{"functionDeclarations": [{"name": "run_shell_command", "parameters": {
                "type": "OBJECT", "properties": {"command": {"type": "STRING"}}, "required": ["command"]}}]}],
            "generationConfig": {"thinkingConfig": {"includeThoughts": True}}}
    url = f"{proxy_server.url}/v1beta/models/gemini-2.5-pro:streamGenerateContent"
    resp = httpx.post(url, params={"key": "google-raw"}, json=body)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/json")
    chunks = resp.json()
    assert isinstance(chunks, list) and len(chunks) == 2
    assert chunks[0]["candidates"][0]["content"]["parts"][0]["thought"] is True
    call = chunks[1]["candidates"][0]["content"]["parts"][0]["functionCall"]
    assert call["name"] == "run_shell_command" and call["args"] == {"command": "echo hello > out.txt"}
    assert chunks[1]["candidates"][0]["finishReason"] == "STOP" and "usageMetadata" in chunks[1]
    assert "usageMetadata" not in chunks[0]
    assert len({c["responseId"] for c in chunks}) == 1
    assert [r["stream"] for r in proxy_server.completions("google-raw")] == [True]


def test_missing_key_is_a_google_shaped_401(proxy_server):
    resp = httpx.post(f"{proxy_server.url}/v1beta/models/gemini-2.5-pro:generateContent",
                      json={"contents": [{"parts": [{"text": "hi"}]}]})
    assert resp.status_code == 401 and resp.json()["error"]["status"] == "UNAUTHENTICATED"


def test_unsupported_method_is_a_404(proxy_server):
    resp = httpx.post(f"{proxy_server.url}/v1beta/models/gemini-2.5-pro:embedContent",
                      headers={"x-goog-api-key": "google-embed"}, json={"content": {"parts": [{"text": "hi"}]}})
    assert resp.status_code == 404 and resp.json()["error"]["status"] == "NOT_FOUND"
    assert "embedContent" in resp.json()["error"]["message"]
