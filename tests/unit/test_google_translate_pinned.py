"""The Gemini front end pinned where mutation testing found it loose: what a Gemini client sees (parts, usage,
stream chunks, whether calls carry ids), what the engine is sent (schemas, messages, sampling), the notes a harness
is shown, and malformed input as a 400 in Google's error shape."""

from __future__ import annotations

from typing import Any

import pytest

from polar_gym.proxy.chat import ChatMessage, ChatResult, FunctionCall, ToolCall, Usage
from polar_gym.proxy.errors import RequestError
from polar_gym.proxy.providers.base import RenderContext, Route
from polar_gym.proxy.providers.google import GoogleProvider
from polar_gym.proxy.providers.google.translate import lower_schema, usage_metadata
from tests.unit.test_google_translate import call, model, user

P = GoogleProvider()
CTX = RenderContext(response_id="r-9", created=0)
GEN = Route("/v1beta/models/gemini-2.5-pro:generateContent", model="gemini-2.5-pro", action="generateContent")
COUNT = Route("/v1beta/models/gemini-2.5-pro:countTokens", model="gemini-2.5-pro", action="countTokens")




def answer(name: str, response: dict[str, Any] | None = None, id: str | None = None) -> dict[str, Any]:
    fr: dict[str, Any] = {"name": name, "response": {"output": "ok"} if response is None else response}
    if id is not None:
        fr["id"] = id
    return {"functionResponse": fr}


def parse(body: dict[str, Any]):
    return P.parse(body, GEN)


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in parse(body).chat.messages]


def result(text: str = "", reasoning: str | None = None, calls: list[str] | None = None, completion: int = 5,
           **raw: Any) -> ChatResult:
    tool_calls = [ToolCall(id=f"c{i}", function=FunctionCall(name=n, arguments="{}")) for i, n in
                  enumerate(calls or [])]
    msg = ChatMessage(role="assistant", content=text, reasoning_content=reasoning, tool_calls=tool_calls or None)
    return ChatResult(message=msg, finish_reason="stop", raw=raw,
                      usage=Usage(prompt_tokens=10, completion_tokens=completion))


def rendered_call(body: dict[str, Any]) -> dict[str, Any]:
    """The function call part a client gets back for the request ``body``."""
    parts = P.render(result(calls=["f"]), parse(body), CTX)["candidates"][0]["content"]["parts"]
    return parts[-1]["functionCall"]


def bad(body: dict[str, Any], route: Route = GEN) -> tuple[str, dict[str, Any]]:
    """The message of the 400 a request gets, and the body a Gemini client is sent for it."""
    with pytest.raises(RequestError) as info:
        P.parse_count(body, route) if route is COUNT else P.parse(body, route)
    status, error = P.error_body(info.value)
    assert status == 400 and error["error"]["code"] == 400 and error["error"]["status"] == "INVALID_ARGUMENT"
    return info.value.message, error


# ---------------------------------------------------------------- schema lowering


def test_non_schema_values_inside_a_schema_are_kept():
    """A boolean sub-schema (JSON Schema's ``true``) is passed through, not dropped or turned into null."""
    assert lower_schema({"type": "OBJECT", "properties": {"any": True}, "anyOf": [False, {"type": "STRING"}]}) == {
        "type": "object", "properties": {"any": True}, "anyOf": [False, {"type": "string"}]}
    assert lower_schema(["not", "a", "schema"]) == ["not", "a", "schema"]


def test_only_schema_valued_keywords_are_lowered():
    """A ``default`` or ``const`` object is data, not a schema: its ``type``/``nullable`` keys stay as written."""
    data = {"type": "STRING", "nullable": True}
    assert lower_schema({"type": "OBJECT", "default": data, "const": data}) == {
        "type": "object", "default": data, "const": data}
    assert lower_schema({"not": {"type": "STRING"}, "additionalProperties": {"type": "INTEGER"}}) == {
        "not": {"type": "string"}, "additionalProperties": {"type": "integer"}}


def test_nullable_type_lists_gain_null_once():
    assert lower_schema({"type": ["STRING", "INTEGER"], "nullable": True}) == {"type": ["string", "integer", "null"]}
    assert lower_schema({"type": ["STRING", "NULL"], "nullable": True}) == {"type": ["string", "null"]}
    assert lower_schema({"type": "NULL", "nullable": True}) == {"type": "null"}


# ---------------------------------------------------------------- contents


def test_file_data_without_a_mime_type_is_an_image_and_other_files_a_noted_placeholder():
    inbound = parse({"contents": [user({"fileData": {"fileUri": "gs://b/x"}},
                                       {"fileData": {"fileUri": "gs://b/a.mp3", "mimeType": "audio/mpeg"}})]})
    parts = inbound.chat.messages[0].content
    assert isinstance(parts, list)
    assert parts[0].image_url == {"url": "gs://b/x"}
    assert parts[1].type == "text" and parts[1].text == "[audio/mpeg file gs://b/a.mp3 omitted]"
    assert inbound.normalizations == [
        "contents.0.parts.1.fileData: audio/mpeg file gs://b/a.mp3 replaced by a placeholder (text-only model)"]


def test_code_parts_in_a_user_content_become_text_and_are_noted():
    inbound = parse({"contents": [user({"executableCode": {"language": "PYTHON", "code": "x = 1"}},
                                       {"codeExecutionResult": {"outcome": "OUTCOME_OK"}})]})
    assert inbound.chat.messages[0].content == "\n```python\nx = 1\n```\n\nCode execution result (OUTCOME_OK):\n\n"
    assert inbound.normalizations == [
        "contents.0.parts.0.executableCode: rendered as text (code execution is not offered)",
        "contents.0.parts.1.codeExecutionResult: rendered as text (code execution is not offered)"]


def test_function_response_contents():
    """An empty response is an empty tool message; other JSON keeps non-ASCII text as written (the engine sees
    the characters, not escapes); media parts are dropped with a note."""
    inbound = parse({"contents": [user(), model(call("f"), call("g"), call("h")), user(
        answer("f", {}), answer("g", {"error": "café ☕"}),
        {"functionResponse": {"name": "h", "response": {"output": "seen"},
                              "parts": [{"inlineData": {"mimeType": "image/png", "data": "AAAA"}}]}})]})
    tools = [m for m in inbound.chat.messages if m.role == "tool"]
    assert [m.content for m in tools] == ["", '{"error": "café ☕"}', "seen"]
    assert inbound.normalizations == ["contents.2.parts.2.functionResponse.parts: media in function responses dropped"]


def test_call_arguments_keep_non_ascii_text():
    """The arguments the engine re-reads are the characters the model wrote, not ``\\u`` escapes."""
    out = messages({"contents": [user(), model(call("write", {"text": "naïve – ok"}))]})
    assert out[1]["tool_calls"][0]["function"]["arguments"] == '{"text": "naïve – ok"}'


def test_a_response_matched_by_id_is_not_noted_as_an_orphan():
    inbound = parse({"contents": [user(), model(call("f", id="a"), call("f", id="b")),
                                  user(answer("f", id="b"), answer("f", id="a"))]})
    assert [m.tool_call_id for m in inbound.chat.messages if m.role == "tool"] == ["b", "a"]
    assert inbound.normalizations == []


def test_thoughts_in_a_later_model_content_join_the_turn():
    """A streamed turn replayed as several contents: thoughts that come after the text still belong to it."""
    out = messages({"contents": [user(), model({"text": "Hi"}), model({"text": "hmm", "thought": True}),
                                 model({"text": " more", "thought": True}, {"text": "!"})]})
    assert out[1:] == [{"role": "assistant", "content": "Hi!", "reasoning_content": "hmm more"}]


def test_system_instruction_as_text_parts_or_a_string():
    assert parse({"contents": [user()], "systemInstruction": {"parts": [{"text": "a"}, {"text": "b"}]}}
                 ).normalizations == []
    plain = parse({"contents": [user()], "systemInstruction": "be brief"})
    assert plain.chat.messages[0].model_dump(exclude_none=True) == {"role": "system", "content": "be brief"}
    assert plain.normalizations == []
    mixed = parse({"contents": [user()], "systemInstruction": {"parts": [
        {"text": "a"}, {"inlineData": {"mimeType": "image/png", "data": "AAAA"}}]}})
    assert mixed.chat.messages[0].content == "a"
    assert mixed.normalizations == ["systemInstruction: non-text parts dropped"]


# ---------------------------------------------------------------- whether rendered calls carry ids


def test_a_conversation_without_calls_gets_ids_on_its_calls():
    assert parse({"contents": [user()]}).render_state.call_ids is True
    assert rendered_call({"contents": [user()]}) == {"name": "f", "args": {}, "id": "c0"}


def test_a_client_that_sent_an_idless_call_gets_idless_calls():
    """gemini-cli-like history: the call had no id (and no answer yet), so ours carry none either."""
    body = {"contents": [user(), model(call("f")), user({"text": "go on"})]}
    assert parse(body).render_state.call_ids is False
    assert rendered_call(body) == {"name": "f", "args": {}}


def test_an_idless_orphan_response_alone_means_idless_calls():
    body = {"contents": [user(answer("f"))]}
    assert parse(body).render_state.call_ids is False
    assert "id" not in rendered_call(body)


def test_an_id_on_either_side_of_a_call_means_ids_round_trip():
    """The client has carried an id (on the call or on its response), so it can carry ours."""
    id_on_call = {"contents": [user(), model(call("f", id="x")), user(answer("f"))]}
    id_on_response = {"contents": [user(), model(call("f")), user(answer("f", id="x"))]}
    assert parse(id_on_call).render_state.call_ids is True
    assert parse(id_on_response).render_state.call_ids is True
    assert rendered_call(id_on_response)["id"] == "c0"


# ---------------------------------------------------------------- tools and config


def test_allowed_function_names_not_enforced_are_noted():
    tools = [{"functionDeclarations": [{"name": "f"}, {"name": "g"}]}]
    many = parse({"contents": [user()], "tools": tools,
                  "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["f", "g"]}}})
    assert many.normalizations == [
        "toolConfig.functionCallingConfig.allowedFunctionNames: more than one name, not enforced"]
    auto = parse({"contents": [user()], "tools": tools,
                  "toolConfig": {"functionCallingConfig": {"mode": "auto", "allowedFunctionNames": ["f"]}}})
    assert auto.chat.tool_choice == "auto"
    assert auto.normalizations == ["toolConfig.functionCallingConfig.allowedFunctionNames: not enforced in mode AUTO"]


def test_response_json_schema_wins_over_response_schema():
    raw = {"type": "object", "properties": {"n": {"type": "integer"}}}
    chat = parse({"contents": [user()], "generationConfig": {
        "responseMimeType": "application/json", "responseJsonSchema": raw, "responseSchema": {"type": "STRING"}}}).chat
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "response", "schema": raw}}


def test_other_response_mime_types_are_noted_not_enforced():
    inbound = parse({"contents": [user()], "generationConfig": {"responseMimeType": "text/x.enum"}})
    assert inbound.chat.response_format is None
    assert inbound.normalizations == ["generationConfig.responseMimeType: text/x.enum not enforced"]


def test_thinking_config_notes_only_a_budget_or_level():
    def notes(thinking: dict[str, Any]) -> list[str]:
        return parse({"contents": [user()], "generationConfig": {"thinkingConfig": thinking}}).normalizations

    assert notes({"includeThoughts": True}) == []
    assert notes({"thinkingLevel": "LOW"}) == [
        "generationConfig.thinkingConfig: budget/level not forwarded (the template decides)"]


def test_without_generation_config_thoughts_are_not_shown():
    inbound = parse({"contents": [user()]})
    assert inbound.render_state.include_thoughts is False
    parts = P.render(result("Hi", reasoning="hmm"), inbound, CTX)["candidates"][0]["content"]["parts"]
    assert [p.get("thought") for p in parts] == [None]


# ---------------------------------------------------------------- usage, stream, provider


@pytest.mark.parametrize(("reasoning_tokens", "candidates", "thoughts"), [
    (0, 5, None), (1, 4, 1), (5, 0, 5), (6, 5, None), (-1, 5, None), ("3", 5, None),
])
def test_thoughts_token_count_only_for_a_plausible_split(reasoning_tokens, candidates, thoughts):
    usage = usage_metadata(result("x", reasoning_tokens=reasoning_tokens))
    assert usage["candidatesTokenCount"] == candidates and usage["totalTokenCount"] == 15
    assert usage.get("thoughtsTokenCount") == thoughts


def test_every_stream_chunk_names_the_candidate_model_and_response():
    inbound = parse({"contents": [user()], "generationConfig": {"thinkingConfig": {"includeThoughts": True}}})
    chunks = [e.data for e in P.stream(result("Hi", reasoning="hmm", calls=["f"]), inbound, CTX)]
    assert len(chunks) == 3
    for chunk in chunks:
        assert isinstance(chunk, dict)
        assert chunk["candidates"][0]["index"] == 0
        assert (chunk["modelVersion"], chunk["responseId"]) == ("gemini-2.5-pro", "r-9")


def test_keepalive_is_a_blank_line_not_an_sse_comment():
    """The google-genai SDK bundled by Gemini CLI stops reading a stream that starts with a comment."""
    assert P.keepalive.strip() == b""


# ---------------------------------------------------------------- malformed input: a 400 in Google's shape


def test_errors_use_googles_shape():
    message, error = bad({"contents": [user()], "cachedContent": "cachedContents/1"})
    assert error == {"error": {"code": 400, "message": message, "status": "INVALID_ARGUMENT"}}


@pytest.mark.parametrize(("part", "field"), [
    ({"inlineData": {"mimeType": "image/png", "data": "AAAA"}}, "contents.1.parts.1"),
    ({"fileData": {"fileUri": "gs://b/cat.png", "mimeType": "image/png"}}, "contents.1.parts.1"),
])
def test_media_in_a_model_content_is_refused(part, field):
    message, _ = bad({"contents": [user(), model({"text": "see"}, part)]})
    assert message == f"{field}: media in a 'model' content is not supported (text-only model)"


@pytest.mark.parametrize("part", [{}, {"videoMetadata": {"startOffset": "1s"}}, {"thoughtSignature": "c2ln"}])
def test_a_user_part_without_data_is_refused(part):
    """Not an empty user turn sent on to the engine: the Gemini API refuses a part with no data as well."""
    message, _ = bad({"contents": [user({"text": "a"}, part)]})
    assert message.startswith("contents.0.parts.1: a part needs one of text, inlineData, fileData")


def test_a_json_schema_that_is_not_an_object_is_refused():
    message, _ = bad({"contents": [user()], "tools": [{"functionDeclarations": [
        {"name": "ok", "parametersJsonSchema": {"type": "object"}}, {"name": "f", "parametersJsonSchema": True}]}]})
    assert message == "tools.0.functionDeclarations.1.parametersJsonSchema: must be an object schema"


@pytest.mark.parametrize("inner", ["nope", ["contents"], 3])
def test_count_tokens_with_a_non_object_request_is_refused(inner):
    message, _ = bad({"generateContentRequest": inner}, COUNT)
    assert message == "generateContentRequest: must be an object"

