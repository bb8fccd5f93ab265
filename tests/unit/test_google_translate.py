"""Pure translation of the Gemini front end: request -> normalized chat, result -> response and stream chunks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import polar_gym.proxy.providers.google as google_pkg
from polar_gym.proxy.chat import ChatMessage, ChatResult, FunctionCall, ToolCall, Usage
from polar_gym.proxy.errors import RequestError, UnsupportedRoute
from polar_gym.proxy.providers.base import RenderContext, Route
from polar_gym.proxy.providers.google import GoogleProvider, protocol, translate
from polar_gym.proxy.providers.google.translate import GoogleRenderState, derived_call_id, lower_schema
from polar_gym.proxy.providers.reasoning import encode_signature

P = GoogleProvider()
CTX = RenderContext(response_id="r-1", created=0)
GEN = Route("/v1beta/models/gemini-2.5-pro:generateContent", model="gemini-2.5-pro", action="generateContent")
SSE = Route("/v1beta/models/gemini-2.5-pro:streamGenerateContent", model="gemini-2.5-pro",
            action="streamGenerateContent", query={"alt": "sse"})


def user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "parts": list(parts) or [{"text": "hi"}]}


def model(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "model", "parts": list(parts)}


def call(name: str, args: dict[str, Any] | None = None, id: str | None = None) -> dict[str, Any]:
    fc: dict[str, Any] = {"name": name, "args": args or {}}
    if id is not None:
        fc["id"] = id
    return {"functionCall": fc}


def answer(name: str, output: str, id: str | None = None) -> dict[str, Any]:
    fr: dict[str, Any] = {"name": name, "response": {"output": output}}
    if id is not None:
        fr["id"] = id
    return {"functionResponse": fr}


def parse(body: dict[str, Any], route: Route = GEN):
    return P.parse(body, route)


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in parse(body).chat.messages]


def result(text: str = "", reasoning: str | None = None, calls: list[tuple[str, str]] | None = None,
           finish: str = "stop", **raw: Any) -> ChatResult:
    tool_calls = [ToolCall(id=f"c{i}", function=FunctionCall(name=n, arguments=a)) for i, (n, a) in
                  enumerate(calls or [])]
    msg = ChatMessage(role="assistant", content=text, reasoning_content=reasoning, tool_calls=tool_calls or None)
    return ChatResult(message=msg, finish_reason=finish, usage=Usage(prompt_tokens=10, completion_tokens=5),  # type: ignore[arg-type]
                      raw=raw)


# ---------------------------------------------------------------- exports


def test_public_surface():
    assert google_pkg.__all__ == ["GoogleProvider"]
    for module in (translate, protocol):
        for name in module.__all__:
            assert hasattr(module, name), name
    assert P.name == "google" and P.conversation_field == "contents"


# ---------------------------------------------------------------- schema lowering


def test_lower_schema_types_nullable_bounds_and_examples():
    gemini = {"type": "OBJECT", "propertyOrdering": ["type", "tags"], "required": ["type"], "properties": {
        "type": {"type": "STRING", "enum": ["a", "b"], "nullable": True, "example": "a"},
        "tags": {"type": "ARRAY", "items": {"type": "INTEGER", "format": "int32"}, "maxItems": "3",
                 "min_items": "1"},
        "either": {"anyOf": [{"type": "NUMBER"}, {"type": "BOOLEAN"}], "nullable": True},
        "nullable": {"type": "TYPE_UNSPECIFIED", "description": "a property called nullable"},
    }}
    assert lower_schema(gemini) == {"type": "object", "required": ["type"], "properties": {
        "type": {"type": ["string", "null"], "enum": ["a", "b", None], "examples": ["a"]},
        "tags": {"type": "array", "items": {"type": "integer", "format": "int32"}, "maxItems": 3, "minItems": 1},
        "either": {"anyOf": [{"type": "number"}, {"type": "boolean"}, {"type": "null"}]},
        "nullable": {"description": "a property called nullable"},
    }}


_TYPES = st.sampled_from(["STRING", "INTEGER", "NUMBER", "BOOLEAN", "string", "Object"])
_NAMES = st.sampled_from(["type", "nullable", "items", "properties", "a", "B_c", "anyOf"])


def _schemas() -> st.SearchStrategy[dict[str, Any]]:
    leaf = st.fixed_dictionaries({"type": _TYPES}, optional={"nullable": st.booleans(), "description": st.text(
        max_size=5), "maxLength": st.integers(0, 9).map(str)})
    return st.recursive(leaf, lambda inner: st.one_of(
        st.fixed_dictionaries({"type": st.just("OBJECT"), "properties": st.dictionaries(_NAMES, inner, max_size=3)},
                              optional={"nullable": st.booleans()}),
        st.fixed_dictionaries({"type": st.just("ARRAY"), "items": inner}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=3)},
                              optional={"nullable": st.booleans()}),
    ), max_leaves=8)


def _walk(schema: Any) -> list[dict[str, Any]]:
    """Every schema node (not property-name maps) of a lowered schema."""
    if not isinstance(schema, dict):
        return []
    nodes = [schema]
    for sub in (schema.get("properties") or {}).values():
        nodes += _walk(sub)
    nodes += _walk(schema.get("items"))
    for sub in schema.get("anyOf") or []:
        nodes += _walk(sub)
    return nodes


@given(_schemas())
def test_lowered_schemas_are_json_schema(schema):
    lowered = lower_schema(schema)
    for node in _walk(lowered):
        kinds = node.get("type", [])
        kinds = [kinds] if isinstance(kinds, str) else kinds
        assert all(k == k.lower() for k in kinds)
        assert "nullable" not in node
        assert isinstance(node.get("maxLength", 0), int)
    assert lower_schema(lowered) == lowered  # idempotent
    if isinstance(schema.get("properties"), dict):
        assert list(lowered["properties"]) == list(schema["properties"])  # names untouched
    if schema.get("nullable") and "type" in schema:
        assert "null" in lowered["type"]


# ---------------------------------------------------------------- contents


def test_camel_and_snake_case_parse_alike():
    camel = {"contents": [user({"text": "look"}, {"inlineData": {"mimeType": "image/png", "data": "AAAA"}})],
             "systemInstruction": {"parts": [{"text": "sys"}]},
             "generationConfig": {"maxOutputTokens": 7, "topK": 3.0, "stopSequences": ["X"],
                                  "thinkingConfig": {"includeThoughts": True}},
             "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["f"]}},
             "tools": [{"functionDeclarations": [{"name": "f", "parametersJsonSchema": {"type": "object"}}]}]}
    snake = {"contents": [user({"text": "look"}, {"inline_data": {"mime_type": "image/png", "data": "AAAA"}})],
             "system_instruction": {"parts": [{"text": "sys"}]},
             "generation_config": {"max_output_tokens": 7, "top_k": 3, "stop_sequences": ["X"],
                                   "thinking_config": {"include_thoughts": True}},
             "tool_config": {"function_calling_config": {"mode": "ANY", "allowed_function_names": ["f"]}},
             "tools": [{"function_declarations": [{"name": "f", "parameters_json_schema": {"type": "object"}}]}]}
    a, b = parse(camel), parse(snake)
    assert a.chat == b.chat and a.render_state == b.render_state and a.render_state.include_thoughts is True
    assert a.chat.max_tokens == 7 and a.chat.top_k == 3 and a.chat.stop == ["X"]
    assert a.chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert a.chat.messages[0].content == "sys"
    parts = a.chat.messages[1].content
    assert isinstance(parts, list) and parts[1].image_url == {"url": "data:image/png;base64,AAAA"}


def test_text_parts_join_without_separator_and_thoughts_become_reasoning():
    body = {"contents": [user({"text": "a"}, {"text": "b"}),
                         model({"text": "plan ", "thought": True}, {"text": "more", "thought": True,
                                                                    "thoughtSignature": "c2ln"},
                               {"text": "Hel"}, {"text": "lo"}, {"thoughtSignature": "c2ln"})]}
    assert messages(body) == [{"role": "user", "content": "ab"},
                              {"role": "assistant", "content": "Hello", "reasoning_content": "plan more"}]


def test_consecutive_model_contents_fold_into_one_turn():
    body = {"contents": [user(), model({"text": "think", "thought": True}), model({"text": "x"}, call("f"))]}
    out = messages(body)
    assert len(out) == 2 and out[1]["content"] == "x" and out[1]["reasoning_content"] == "think"
    assert [c["function"]["name"] for c in out[1]["tool_calls"]] == ["f"]


def test_media_and_code_parts():
    body = {"contents": [
        user({"inlineData": {"mimeType": "text/plain", "data": "aGVsbG8="}},
             {"inlineData": {"mimeType": "application/pdf", "data": "JVBERg=="}},
             {"fileData": {"fileUri": "gs://b/cat.png", "mimeType": "image/png"}}),
        model({"executableCode": {"language": "PYTHON", "code": "print(1)"}}),
        user({"codeExecutionResult": {"outcome": "OUTCOME_OK", "output": "1"}}),
    ]}
    inbound = parse(body)
    first = inbound.chat.messages[0].content
    assert isinstance(first, list)
    assert [p.text for p in first[:2]] == ["hello", "[application/pdf attachment omitted]"]
    assert first[2].image_url == {"url": "gs://b/cat.png"}
    assert "```python\nprint(1)\n```" in str(inbound.chat.messages[1].content)
    assert "Code execution result (OUTCOME_OK):\n1" in str(inbound.chat.messages[2].content)
    assert any("application/pdf" in n for n in inbound.normalizations)
    assert any("executableCode" in n for n in inbound.normalizations)


# ---------------------------------------------------------------- function call ids


def test_idless_calls_get_positional_ids_and_responses_match_by_name_and_order():
    body = {"contents": [user(), model(call("read", {"p": "a"}), call("shell", {"c": "ls"}), call("read")),
                         user(answer("read", "A"), answer("read", "B"), answer("shell", "S"))]}
    out = messages(body)
    ids = [c["id"] for c in out[1]["tool_calls"]]
    assert ids == [derived_call_id("read", 1, 0), derived_call_id("shell", 1, 1), derived_call_id("read", 1, 2)]
    assert [(m["tool_call_id"], m["content"]) for m in out[2:]] == [(ids[0], "A"), (ids[2], "B"), (ids[1], "S")]
    assert json.loads(out[1]["tool_calls"][0]["function"]["arguments"]) == {"p": "a"}
    assert parse(body).render_state.call_ids is False  # this client does not round-trip ids


def test_responses_match_by_id_in_any_order():
    body = {"contents": [user(), model(call("f", id="x1"), call("f", id="x2")),
                         user(answer("f", "second", id="x2"), answer("f", "first", id="x1"))]}
    out = messages(body)
    assert [(m["tool_call_id"], m["content"]) for m in out[2:]] == [("x2", "second"), ("x1", "first")]
    assert parse(body).render_state.call_ids is True


def test_unknown_response_id_falls_back_to_name_and_orphans_are_noted():
    body = {"contents": [user(), model(call("f")), user(answer("f", "ok", id="client-made"), answer("g", "?"))]}
    inbound = parse(body)
    out = [m.model_dump(exclude_none=True) for m in inbound.chat.messages]
    assert out[2]["tool_call_id"] == derived_call_id("f", 1, 0)
    assert out[3]["tool_call_id"] == derived_call_id("g", 2, 1)
    assert any("no earlier call to 'g'" in n for n in inbound.normalizations)


def test_function_response_text_and_trailing_user_text():
    body = {"contents": [user(), model(call("f"), call("g")),
                         user({"functionResponse": {"name": "f", "response": {"error": "boom"}}},
                              {"functionResponse": {"name": "g", "response": {"result": "fine"}}},
                              {"text": "and also"})]}
    out = messages(body)
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "tool", "user"]
    assert json.loads(out[2]["content"]) == {"error": "boom"} and out[3]["content"] == "fine"
    assert out[4]["content"] == "and also"


@given(st.lists(st.sampled_from(["f", "g", "h"]), min_size=1, max_size=6), st.booleans(), st.randoms())
def test_derived_ids_are_stable_as_history_grows(names, with_ids, rnd):
    """Each turn's request is the previous one extended: earlier messages (ids included) never change, and every
    response, sent in any order, is matched to a distinct call of its own name."""
    contents: list[dict[str, Any]] = [user()]
    previous: list[dict[str, Any]] = []
    for turn, name in enumerate(names):
        ids = [f"id{turn}_{k}" if with_ids else None for k in range(3)]
        contents.append(model(call(name, {"k": 0}, ids[0]), call("z", {"k": 1}, ids[1]), call(name, {}, ids[2])))
        answers = [answer(name, name, ids[0]), answer("z", "z", ids[1]), answer(name, name, ids[2])]
        rnd.shuffle(answers)
        contents.append(user(*answers))
        out = messages({"contents": contents})
        assert out[: len(previous)] == previous
        calls = {c["id"]: c["function"]["name"] for m in out if m["role"] == "assistant" for c in m["tool_calls"]}
        answered = [m for m in out if m["role"] == "tool"]
        assert all(calls[m["tool_call_id"]] == m["content"] for m in answered)
        assert len({m["tool_call_id"] for m in answered}) == len(answered) == len(calls) == 3 * (turn + 1)
        previous = out


RECORDED = sorted(Path(__file__).parents[1].glob("data/harness/*/*.json"))
RECORDED_GOOGLE = [p for p in RECORDED if json.loads(p.read_text()).get("provider") == "google"]


@pytest.mark.parametrize("path", RECORDED_GOOGLE, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_recorded_harness_bodies(path):
    """Real gemini-cli and pi bodies: JSON-Schema tools pass through, every response answers a real call."""
    case = json.loads(path.read_text())
    inbound = P.parse(case["body"], SSE)
    assert inbound.stream and not inbound.ignored_fields and inbound.chat.tools
    assert all(t.parameters.get("type") == "object" for t in inbound.chat.tools)
    call_ids = {c.id for m in inbound.chat.messages for c in m.tool_calls or []}
    assert all(m.tool_call_id in call_ids for m in inbound.chat.messages if m.role == "tool")


# ---------------------------------------------------------------- tools and config


def test_tools_lowered_builtins_skipped():
    body = {"contents": [user()], "tools": [
        {"functionDeclarations": [{"name": "run_shell_command", "description": "d", "parameters": {
            "type": "OBJECT", "properties": {"command": {"type": "STRING"}}, "required": ["command"]}},
            {"name": "noargs"}]},
        {"googleSearch": {}}, {"codeExecution": {}}]}
    inbound = parse(body)
    assert [t.model_dump() for t in inbound.chat.tools or []] == [
        {"type": "function", "function": {"name": "run_shell_command", "description": "d", "parameters": {
            "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
        {"type": "function", "function": {"name": "noargs", "parameters": {"type": "object", "properties": {}}}}]
    assert [n for n in inbound.normalizations if "built-in" in n] == [
        "tools.1.googleSearch: built-in tool not offered to the model",
        "tools.2.codeExecution: built-in tool not offered to the model"]


@pytest.mark.parametrize(("config", "choice"), [
    ({"mode": "AUTO"}, "auto"),
    ({"mode": "VALIDATED"}, "auto"),
    ({"mode": "NONE"}, "none"),
    ({"mode": "ANY"}, "required"),
    ({"mode": "ANY", "allowedFunctionNames": ["f"]}, {"type": "function", "function": {"name": "f"}}),
    ({"mode": "ANY", "allowedFunctionNames": ["f", "g"]}, "required"),
    ({}, "auto"),
])
def test_tool_choice(config, choice):
    body = {"contents": [user()], "tools": [{"functionDeclarations": [{"name": "f"}, {"name": "g"}]}],
            "toolConfig": {"functionCallingConfig": config}}
    assert parse(body).chat.tool_choice == choice


def test_generation_config_and_response_format():
    gen = {"temperature": 0.2, "topP": 0.9, "topK": 40, "maxOutputTokens": 64, "stopSequences": ["END"],
           "seed": 7, "candidateCount": 1, "presencePenalty": 0.5, "responseMimeType": "application/json",
           "responseSchema": {"type": "OBJECT", "properties": {"a": {"type": "STRING", "nullable": True}}},
           "thinkingConfig": {"thinkingBudget": 0}}
    inbound = parse({"contents": [user()], "generationConfig": gen})
    chat = inbound.chat
    assert (chat.temperature, chat.top_p, chat.top_k, chat.max_tokens, chat.stop, chat.seed) == (
        0.2, 0.9, 40, 64, ["END"], 7)
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "response", "schema": {
        "type": "object", "properties": {"a": {"type": ["string", "null"]}}}}}
    assert "generationConfig.presence_penalty: not forwarded" in inbound.normalizations
    assert any("thinkingConfig" in n for n in inbound.normalizations)
    assert inbound.render_state.include_thoughts is False
    plain_json = parse({"contents": [user()], "generationConfig": {"responseMimeType": "application/json"}})
    assert plain_json.chat.response_format == {"type": "json_object"}
    raw_schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    json_schema = parse({"contents": [user()], "generationConfig": {"responseMimeType": "application/json",
                                                                    "responseJsonSchema": raw_schema}})
    assert json_schema.chat.response_format["json_schema"]["schema"] == raw_schema  # type: ignore[index]


def test_ignored_and_accepted_fields():
    body = {"contents": [user()], "safetySettings": [{"category": "X", "threshold": "BLOCK_NONE"}],
            "labels": {"a": "b"}, "serviceTier": "standard", "mystery": 1,
            "generationConfig": {"strangeKnob": True}}
    assert parse(body).ignored_fields == ["mystery", "generationConfig.strangeKnob"]


def test_model_and_stream_modes():
    body = {"contents": [user()]}
    assert (parse(body).stream, parse(body).model) == (False, "gemini-2.5-pro")
    sse = P.parse(body, SSE)
    assert sse.stream and not sse.stream_json_array
    array = P.parse(body, Route("/v1/models/x:streamGenerateContent", model="x", action="streamGenerateContent"))
    assert array.stream and array.stream_json_array is True
    prefixed = P.parse(body, Route("/v1beta/models/models/gem:generateContent", model="models/gem",
                                   action="generateContent"))
    assert prefixed.model == prefixed.chat.model == "gem"
    from_body = P.parse({**body, "model": "models/b"}, Route("/x", action="generateContent"))
    assert from_body.model == "b"


@pytest.mark.parametrize(("body", "route", "words"), [
    ({"contents": []}, GEN, "contents"),
    ({"contents": [{"role": "system", "parts": [{"text": "x"}]}]}, GEN, "contents.0.role"),
    ({"contents": [user(call("f"))]}, GEN, "contents.0.parts.0.functionCall"),
    ({"contents": [model(answer("f", "x"))]}, GEN, "contents.0.parts.0.functionResponse"),
    ({"contents": [user()], "generationConfig": {"candidateCount": 3}}, GEN, "candidateCount"),
    ({"contents": [user()], "generationConfig": {"temperature": 9}}, GEN, "temperature"),
    ({"contents": [user()], "cachedContent": "cachedContents/1"}, GEN, "cachedContent"),
    ({"contents": [{"parts": [{"text": 5}]}]}, GEN, "contents.0.parts.0.text"),
    ({"contents": [user({"inlineData": {"mimeType": "text/plain", "data": "%%%"}})]}, GEN, "inlineData.data"),
    ({"contents": [user()], "toolConfig": {"functionCallingConfig": {"mode": "SOMETIMES"}}}, GEN, "mode"),
    ({"contents": [user()], "generationConfig": {"responseSchema": {"type": "OBJECT"}}}, GEN, "responseMimeType"),
    ({"contents": [user()]}, Route("/v1beta/models", action="generateContent"), "no model"),
])
def test_bad_requests_name_the_field(body, route, words):
    with pytest.raises(RequestError) as info:
        P.parse(body, route)
    assert info.value.status == 400 and words in info.value.message


def test_unknown_action_is_not_found():
    with pytest.raises(UnsupportedRoute) as info:
        P.parse({"contents": [user()]}, Route("/v1beta/models/m:embedContent", model="m", action="embedContent"))
    assert info.value.status == 404 and "embedContent" in info.value.message
    with pytest.raises(UnsupportedRoute, match="expected a path like"):
        P.parse({"contents": [user()]}, Route("/somewhere"))  # detected by body shape, no method in the path


def test_count_tokens_bodies():
    plain = P.parse_count({"contents": [user()]}, GEN)
    wrapped = P.parse_count({"generateContentRequest": {"model": "models/m", "contents": [user()],
                                                        "systemInstruction": {"parts": [{"text": "s"}]}}},
                            Route("/v1beta/models/m:countTokens", model="m", action="countTokens"))
    assert [m.role for m in plain.chat.messages] == ["user"]
    assert [m.role for m in wrapped.chat.messages] == ["system", "user"] and not wrapped.stream
    assert P.render_count(12) == {"totalTokens": 12}
    with pytest.raises(RequestError):
        P.parse_count({"generateContentRequest": "nope"}, GEN)


# ---------------------------------------------------------------- render and stream


def _inbound(include_thoughts: bool = False, call_ids: bool = True):
    inbound = parse({"contents": [user()]})
    inbound.render_state = GoogleRenderState(include_thoughts=include_thoughts, call_ids=call_ids)
    return inbound


def test_render_text_thoughts_calls_and_usage():
    res = result("Hi", reasoning="hmm", calls=[("f", '{"a": 1}')], finish="tool_calls")
    body = P.render(res, _inbound(include_thoughts=True), CTX)
    cand = body["candidates"][0]
    sig = encode_signature("hmm")  # the reasoning rides back on the first call's thought signature
    assert cand["content"] == {"role": "model", "parts": [
        {"text": "hmm", "thought": True}, {"text": "Hi"}, {"functionCall": {"name": "f", "args": {"a": 1},
                                                                            "id": "c0"}, "thoughtSignature": sig}]}
    assert cand["finishReason"] == "STOP" and cand["index"] == 0
    assert body["usageMetadata"] == {"promptTokenCount": 10, "candidatesTokenCount": 5, "totalTokenCount": 15}
    assert (body["modelVersion"], body["responseId"]) == ("gemini-2.5-pro", "r-1")
    hidden = P.render(res, _inbound(call_ids=False), CTX)["candidates"][0]["content"]["parts"]
    assert hidden == [{"text": "Hi"}, {"functionCall": {"name": "f", "args": {"a": 1}}, "thoughtSignature": sig}]


def test_render_edge_cases():
    empty = P.render(result("", finish="length"), _inbound(), CTX)["candidates"][0]
    assert empty["content"]["parts"] == [{"text": ""}] and empty["finishReason"] == "MAX_TOKENS"
    odd = P.render(result(calls=[("f", "not json"), ("g", "[1]")]), _inbound(call_ids=False), CTX)
    assert [p["functionCall"]["args"] for p in odd["candidates"][0]["content"]["parts"]] == [
        {"arguments": "not json"}, {"arguments": [1]}]
    split = P.render(result("x", reasoning_tokens=2), _inbound(), CTX)["usageMetadata"]
    assert split == {"promptTokenCount": 10, "candidatesTokenCount": 3, "thoughtsTokenCount": 2,
                     "totalTokenCount": 15}


def test_thought_signature_brings_dropped_thoughts_back():
    """A client that does not echo thought parts still returns the signature: the reasoning is restored."""
    sig = encode_signature("step 1: look around")
    model = {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {}}, "thoughtSignature": sig}]}
    inbound = parse({"contents": [user(), model, user({"functionResponse": {"name": "f", "response": {}}})]})
    assistant = next(m for m in inbound.chat.messages if m.role == "assistant")
    assert assistant.reasoning_content == "step 1: look around"
    foreign = {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {}},
                                           "thoughtSignature": "skip_thought_signature_validator"}]}
    inbound = parse({"contents": [user(), foreign, user({"functionResponse": {"name": "f", "response": {}}})]})
    assert next(m for m in inbound.chat.messages if m.role == "assistant").reasoning_content is None


def test_stream_chunk_sequence():
    res = result("Hi", reasoning="hmm", calls=[("f", "{}"), ("g", "{}")], finish="tool_calls")
    chunks = [e.data for e in P.stream(res, _inbound(include_thoughts=True), CTX)]
    assert all(isinstance(c, dict) for c in chunks)
    assert [c["candidates"][0]["content"]["parts"] for c in chunks] == [  # type: ignore[index]
        [{"text": "hmm", "thought": True}], [{"text": "Hi"}],
        [{"functionCall": {"name": "f", "args": {}, "id": "c0"}, "thoughtSignature": encode_signature("hmm")},
         {"functionCall": {"name": "g", "args": {}, "id": "c1"}}]]
    assert [c["candidates"][0].get("finishReason") for c in chunks] == [None, None, "STOP"]  # type: ignore[index]
    assert ["usageMetadata" in c for c in chunks] == [False, False, True]  # type: ignore[operator]
    assert all(e.event is None for e in P.stream(res, _inbound(), CTX))


@given(text=st.text(max_size=8), reasoning=st.none() | st.text(min_size=1, max_size=8),
       calls=st.lists(st.tuples(st.sampled_from(["f", "g"]), st.dictionaries(st.text(max_size=3), st.integers())),
                      max_size=3),
       finish=st.sampled_from(["stop", "length", "tool_calls", "content_filter"]),
       include_thoughts=st.booleans())
def test_stream_carries_exactly_the_rendered_answer(text, reasoning, calls, finish, include_thoughts):
    res = result(text, reasoning=reasoning, calls=[(n, json.dumps(a)) for n, a in calls], finish=finish)
    inbound = _inbound(include_thoughts=include_thoughts)
    whole = P.render(res, inbound, CTX)
    chunks = [e.data for e in P.stream(res, inbound, CTX)]
    streamed = [p for c in chunks for p in c["candidates"][0]["content"]["parts"]]  # type: ignore[index]
    assert streamed == whole["candidates"][0]["content"]["parts"]
    finishes = [c["candidates"][0].get("finishReason") for c in chunks]  # type: ignore[index]
    assert finishes[-1] == whole["candidates"][0]["finishReason"] and not any(finishes[:-1])
    assert chunks[-1]["usageMetadata"] == whole["usageMetadata"]  # type: ignore[index]
    assert all(c["candidates"][0]["content"]["parts"] for c in chunks)  # type: ignore[index]
