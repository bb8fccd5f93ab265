"""The pass-through stream renderers driven piece by piece, without the proxy: ``start`` when the engine's first
chunk comes, ``delta`` with the reasoning and content the parser lets go, ``finish`` with the whole result. Whatever
the pieces, what a client assembles from the events must be exactly the non-streamed answer, in the provider's own
event grammar (names, order, indexes, usage, stop reasons; tool calls only at the end)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from polar_gym.proxy.chat import ChatMessage, ChatResult, FunctionCall, ToolCall, Usage
from polar_gym.proxy.passthrough import stream_renderer
from polar_gym.proxy.providers.anthropic import AnthropicProvider
from polar_gym.proxy.providers.anthropic.stream import MessagesStream
from polar_gym.proxy.providers.anthropic.translate import thinking_signature
from polar_gym.proxy.providers.base import Inbound, Provider, RenderContext, Route, SSEEvent
from polar_gym.proxy.providers.google import GoogleProvider
from polar_gym.proxy.providers.google.stream import GenerateContentStream
from polar_gym.proxy.providers.openai_chat import OpenAIChatProvider
from polar_gym.proxy.providers.openai_chat.stream import ChatStream
from polar_gym.proxy.providers.openai_responses import OpenAIResponsesProvider
from polar_gym.proxy.providers.openai_responses.stream import ResponsesStream
from polar_gym.proxy.providers.stream import StreamRenderer, SynthesizedStream, rest

CTX = RenderContext(response_id="resp_r1", created=1_700_000_000)
ANTHROPIC, CHAT, RESPONSES, GOOGLE = AnthropicProvider(), OpenAIChatProvider(), OpenAIResponsesProvider(), \
    GoogleProvider()
BY_NAME: dict[str, Provider[Any]] = {"anthropic": ANTHROPIC, "openai_chat": CHAT, "openai_responses": RESPONSES}
RESPONSES_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
SHELL = {"type": "object", "properties": {"command": {"type": "string"}}}

Deltas = list[tuple[str, str]]


def result(text: str | None = "", reasoning: str | None = None, calls: list[tuple[str, str]] | None = None,
           finish: str = "stop", **raw: Any) -> ChatResult:
    tool_calls = [ToolCall(id=f"call_{i}", function=FunctionCall(name=n, arguments=a))
                  for i, (n, a) in enumerate(calls or [])] or None
    return ChatResult(message=ChatMessage(role="assistant", content=text, reasoning_content=reasoning,
                                          tool_calls=tool_calls),
                      finish_reason=finish, usage=Usage(prompt_tokens=23, completion_tokens=9), raw=raw)  # type: ignore[arg-type]


RESULTS = {
    "text": result("Hello there, all done."),
    "reasoning and text": result("The file is there.", "look first, then answer"),
    "reasoning, text and calls": result("I will list the files.", "ls shows them",
                                        [("bash", '{"command": "ls"}'), ("apply_patch", '{"input": "*** Begin"}')],
                                        "tool_calls"),
    "reasoning and a call": result("", "just run it", [("bash", '{"command": "pwd"}')], "tool_calls"),
    "a call": result(None, None, [("bash", '{"command": "ls -la"}')], "tool_calls"),
    "nothing": result(""),
    "cut in the reasoning": result("", "cut short at max tok", finish="length"),
    "cut in the text": result("half an answ", "thought it through", finish="length"),
}


def pieces(text: str, n: int = 3) -> list[str]:
    """``text`` in ``n`` pieces (fewer when it is shorter), none empty."""
    size = max(1, -(-len(text) // n))
    return [text[i:i + size] for i in range(0, len(text), size)]


def schedules(res: ChatResult) -> dict[str, Deltas]:
    """Ways the parser may let an answer go before the end: content only once the reasoning is whole."""
    reasoning, text = res.message.reasoning_content or "", res.text
    return {
        "held to the end": [],
        "part of the reasoning": [(p, "") for p in pieces(reasoning[:len(reasoning) // 2])],
        "all of it in pieces": [("", "")] + [(p, "") for p in pieces(reasoning)] + [("", p) for p in pieces(text)],
        "the text's head with the reasoning": [(reasoning, text[:4])] if text else [(reasoning, "")],
        "the reasoning then the text's head": [(reasoning, ""), ("", text[:5]), ("", "")],
    }


CASES = [pytest.param(res, deltas, id=f"{name}/{how}")
         for name, res in RESULTS.items() for how, deltas in schedules(res).items()]


def drive(renderer: StreamRenderer, res: ChatResult, deltas: Deltas) -> list[SSEEvent]:
    return sent_early(renderer, res, deltas) + renderer.finish(res)


def sent_early(renderer: StreamRenderer, res: ChatResult, deltas: Deltas) -> list[SSEEvent]:
    """The events before ``finish``."""
    events = renderer.start(res.usage.prompt_tokens)
    for reasoning, content in deltas:
        events += renderer.delta(reasoning, content)
    return events


def joined(deltas: Deltas) -> tuple[str, str]:
    """The reasoning and the content the deltas gave."""
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas)


def data(event: SSEEvent) -> dict[str, Any]:
    assert isinstance(event.data, dict), event
    return event.data


# ------------------------------------------------------------------------------------------ what clients assemble


def messages_assembled(events: list[SSEEvent]) -> dict[str, Any]:
    """An Anthropic Message from its events, as the SDK accumulates it: blocks open one at a time, at the next
    index, and every delta goes to the open block."""
    names = [e.event for e in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"], names
    assert all(data(e)["type"] == e.event for e in events)
    message = copy.deepcopy(data(events[0])["message"])
    assert message["content"] == [] and message["stop_reason"] is None and message["usage"]["output_tokens"] == 0
    open_at: int | None = None
    partial_json = ""
    for event in events[2:-2]:
        body = data(event)
        if event.event == "content_block_start":
            assert open_at is None and body["index"] == len(message["content"]), body
            message["content"].append(copy.deepcopy(body["content_block"]))
            open_at, partial_json = body["index"], ""
            continue
        assert body["index"] == open_at, body
        block = message["content"][open_at]
        if event.event == "content_block_stop":
            if block["type"] == "tool_use":
                block["input"] = json.loads(partial_json)
            open_at = None
            continue
        assert event.event == "content_block_delta", event
        delta = body["delta"]
        kind = delta["type"]
        if kind == "text_delta":
            assert block["type"] == "text"
            block["text"] += delta["text"]
        elif kind == "thinking_delta":
            assert block["type"] == "thinking" and not block["signature"]
            block["thinking"] += delta["thinking"]
        elif kind == "signature_delta":
            assert block["type"] == "thinking"
            block["signature"] = delta["signature"]
        else:
            assert kind == "input_json_delta" and block["type"] == "tool_use"
            partial_json += delta["partial_json"]
    assert open_at is None
    end = data(events[-2])
    message.update(end["delta"])
    message["usage"].update(end["usage"])
    return message


def chat_assembled(events: list[SSEEvent], include_usage: bool) -> dict[str, Any]:
    """A chat completion from its chunks, as the SDK accumulates them (tool calls by index)."""
    assert events[-1].data == "[DONE]"
    chunks = [data(e) for e in events[:-1]]
    for chunk in chunks:
        assert (chunk["id"], chunk["object"], chunk["created"], chunk["model"]) == (
            CTX.response_id, "chat.completion.chunk", CTX.created, "policy")
        assert ("usage" in chunk) == include_usage
    usage = None
    if include_usage:
        assert chunks[-1]["choices"] == [] and all(c["usage"] is None for c in chunks[:-1])
        usage = chunks.pop()["usage"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["choices"][0]["delta"] == {}
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    calls: list[dict[str, Any]] = []
    for chunk in chunks[1:-1]:
        (choice,) = chunk["choices"]
        assert choice["index"] == 0 and choice["logprobs"] is None
        delta = choice["delta"]
        if "tool_calls" in delta:
            (piece,) = delta["tool_calls"]
            if "id" in piece:  # a new call opens at the next index
                assert piece["index"] == len(calls) and piece["function"]["arguments"] == ""
                calls.append({"id": piece["id"], "type": piece["type"], "function": dict(piece["function"])})
            else:
                assert piece["index"] == len(calls) - 1
                calls[-1]["function"]["arguments"] += piece["function"]["arguments"]
            continue
        assert not calls, "text after a tool call"
        for key in ("content", "reasoning_content"):
            if key in delta:
                assert delta[key], "an empty delta chunk"
                message[key] = message.get(key, "") + delta[key]
    if calls:
        message["tool_calls"] = calls
    return {"message": message, "finish_reason": chunks[-1]["choices"][0]["finish_reason"], "usage": usage}


def gemini_assembled(events: list[SSEEvent]) -> dict[str, Any]:
    """What a Gemini client reads from its chunks: the thought and answer texts, the calls, where the thought
    signature rides, and the last chunk's finishReason and usage."""
    chunks = [data(e) for e in events]
    assert chunks and all(e.event is None for e in events)
    parts: list[dict[str, Any]] = []
    for i, chunk in enumerate(chunks):
        (candidate,) = chunk["candidates"]
        assert candidate["index"] == 0 and candidate["content"]["role"] == "model"
        assert (chunk["modelVersion"], chunk["responseId"]) == ("policy", CTX.response_id)
        last = i == len(chunks) - 1
        assert ("finishReason" in candidate) == last and ("usageMetadata" in chunk) == last
        assert candidate["content"]["parts"], "a chunk without parts"
        parts += candidate["content"]["parts"]
    calls = [p["functionCall"] for p in parts if "functionCall" in p]
    signed = [("call", calls.index(p["functionCall"])) if "functionCall" in p else ("part", i == len(parts) - 1)
              for i, p in enumerate(parts) if "thoughtSignature" in p]
    return {"thought": "".join(p["text"] for p in parts if p.get("thought")),
            "text": "".join(p.get("text", "") for p in parts if not p.get("thought")),
            "calls": calls, "signed": signed, "signatures": [p["thoughtSignature"] for p in parts
                                                             if "thoughtSignature" in p],
            "finish": chunks[-1]["candidates"][0]["finishReason"], "usage": chunks[-1]["usageMetadata"]}


#: events whose text goes into a part the item added first
TEXT_IN_PARTS = {f"response.{kind}.{end}" for kind in ("output_text", "reasoning_text", "reasoning_summary_text")
                 for end in ("delta", "done")}


def streamed_pieces(item: dict[str, Any]) -> dict[tuple[str, int], Any]:
    """The ``done`` texts and parts an output item's events must carry, by event and index."""
    kind = item["type"]
    if kind == "message":
        return {**{("response.output_text", c): p["text"] for c, p in enumerate(item["content"])},
                **{("response.content_part", c): p for c, p in enumerate(item["content"])}}
    if kind == "reasoning":
        return {**{("response.reasoning_summary_text", s): p["text"] for s, p in enumerate(item["summary"])},
                **{("response.reasoning_summary_part", s): p for s, p in enumerate(item["summary"])},
                **{("response.reasoning_text", c): p["text"] for c, p in enumerate(item.get("content", []))},
                **{("response.content_part", c): p for c, p in enumerate(item.get("content", []))}}
    if kind == "function_call":
        return {("response.function_call_arguments", 0): item["arguments"]}
    if kind == "custom_tool_call":
        return {("response.custom_tool_call_input", 0): item["input"]}
    return {}


def responses_assembled(events: list[SSEEvent]) -> dict[str, Any]:
    """The final Response from its events, checked as a client reads them: sequence numbers from 0, items added
    at the next output index one at a time, every delta adding up to its ``done`` text, each ``done`` item the
    item the final response lists."""
    bodies = [data(e) for e in events]
    for event, body in zip(events, bodies, strict=True):
        assert body["type"] == event.event
        RESPONSES_EVENT.validate_python(body)  # the SDK's own event model accepts it
    assert [b["sequence_number"] for b in bodies] == list(range(len(bodies)))
    assert [b["type"] for b in bodies[:2]] == ["response.created", "response.in_progress"]
    for begun in bodies[:2]:
        assert begun["response"]["status"] == "in_progress" and begun["response"]["output"] == []
        assert begun["response"]["usage"] is None and begun["response"]["completed_at"] is None
    added: list[dict[str, Any]] = []
    done: list[dict[str, Any]] = []
    texts: dict[tuple[str, int], str] = {}     # deltas so far, by what they fill
    finished: dict[tuple[str, int], Any] = {}  # the open item's finished texts and parts
    parts: dict[tuple[str, int], Any] = {}     # the open item's parts added and not yet done
    for body in bodies[2:-1]:
        kind = body["type"]
        if kind == "response.output_item.added":
            assert len(done) == len(added) and body["output_index"] == len(added), "items overlap"
            added.append(body["item"])
            continue
        assert body["output_index"] == len(added) - 1 and len(done) == len(added) - 1, body
        if kind == "response.output_item.done":
            item = body["item"]
            assert (item["id"], item["type"]) == (added[-1]["id"], added[-1]["type"])
            assert finished == streamed_pieces(item), item["type"]  # every text of the item came in its events
            assert not parts, "a part left open"
            finished.clear()
            done.append(item)
            continue
        assert body["item_id"] == added[-1]["id"]
        where = kind.rsplit(".", 1)[0], body.get("content_index", body.get("summary_index", 0))
        part_at = ("summary" if "summary" in kind else "content", where[1])
        if kind.endswith("_part.added"):  # a part opens empty, before its text comes
            assert part_at not in parts and body["part"]["text"] == "", body
            parts[part_at] = body["part"]
            continue
        if kind in TEXT_IN_PARTS:
            assert part_at in parts, f"{kind} outside an added part"
        if kind.endswith("_part.done"):
            assert parts.pop(part_at) == {**body["part"], "text": ""}
        if kind.endswith(".delta"):
            assert body["delta"], "an empty delta"
            texts[where] = texts.get(where, "") + body["delta"]
        elif kind.endswith(".done") and kind.rsplit(".", 1)[0].endswith("_part"):
            finished[where] = body["part"]
        elif kind.endswith(".done"):
            finished[where] = body.get("text", body.get("arguments", body.get("input")))
            assert finished[where] == texts.pop(where, ""), kind
    assert not texts and not finished and len(done) == len(added)
    final = bodies[-1]
    assert final["type"] == {"completed": "response.completed", "incomplete": "response.incomplete"}[
        final["response"]["status"]]
    assert final["response"]["output"] == done
    return dict(final["response"])


# ------------------------------------------------------------------------- every provider: the non-streamed answer


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize(("res", "deltas"), CASES)
def test_a_messages_stream_assembles_to_the_non_streamed_message(res: ChatResult, deltas: Deltas,
                                                                  thinking: bool) -> None:
    fields: dict[str, Any] = {"thinking": {"type": "enabled", "budget_tokens": 1024}} if thinking else {}
    inbound = ANTHROPIC.parse({"model": "policy", "max_tokens": 256, "stream": True,
                               "messages": [{"role": "user", "content": "hi"}], **fields}, Route("/v1/messages"))
    renderer = MessagesStream(inbound, CTX)
    early = sent_early(renderer, res, deltas)
    assert messages_assembled(early + renderer.finish(res)) == ANTHROPIC.render(res, inbound, CTX)
    early_deltas = [data(e)["delta"] for e in early if e.event == "content_block_delta"]
    reasoning, content = joined(deltas)
    assert "".join(d.get("thinking", "") for d in early_deltas) == (reasoning if thinking else "")
    assert "".join(d.get("text", "") for d in early_deltas) == content  # streamed as it came, not at the end


@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize(("res", "deltas"), CASES)
def test_a_chat_stream_assembles_to_the_non_streamed_completion(res: ChatResult, deltas: Deltas,
                                                                 include_usage: bool) -> None:
    body: dict[str, Any] = {"model": "policy", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    inbound = CHAT.parse(body, Route("/v1/chat/completions"))
    renderer = ChatStream(inbound, CTX)
    early_events = sent_early(renderer, res, deltas)
    early = [data(e)["choices"][0]["delta"] for e in early_events]
    assert ("".join(d.get("reasoning_content", "") for d in early), "".join(d.get("content", "") for d in early)) \
        == joined(deltas)  # streamed as it came, not at the end
    assembled = chat_assembled(early_events + renderer.finish(res), include_usage)
    plain = CHAT.render(res, inbound, CTX)
    (choice,) = plain["choices"]
    assert assembled["message"] == {**choice["message"], "content": choice["message"]["content"] or ""}
    assert assembled["finish_reason"] == choice["finish_reason"]
    assert assembled["usage"] == (plain["usage"] if include_usage else None)


@pytest.mark.parametrize("include_thoughts", [True, False])
@pytest.mark.parametrize(("res", "deltas"), CASES)
def test_a_gemini_stream_assembles_to_the_non_streamed_answer(res: ChatResult, deltas: Deltas,
                                                              include_thoughts: bool) -> None:
    body: dict[str, Any] = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    if include_thoughts:
        body["generationConfig"] = {"thinkingConfig": {"includeThoughts": True}}
    route = Route("/v1beta/models/policy:streamGenerateContent", model="policy", action="streamGenerateContent",
                  query={"alt": "sse"})
    inbound = GOOGLE.parse(body, route)
    renderer = GenerateContentStream(inbound, CTX)
    early_events = sent_early(renderer, res, deltas)
    early = [p for e in early_events for p in data(e)["candidates"][0]["content"]["parts"]]
    reasoning, content = joined(deltas)
    assert "".join(p["text"] for p in early if p.get("thought")) == (reasoning if include_thoughts else "")
    assert "".join(p["text"] for p in early if not p.get("thought")) == content
    assembled = gemini_assembled(early_events + renderer.finish(res))
    assert assembled == gemini_assembled([SSEEvent(GOOGLE.render(res, inbound, CTX))])
    assert bool(assembled["signatures"]) == bool(res.message.reasoning_content)


@pytest.mark.parametrize(("summary", "encrypted"), [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize(("res", "deltas"), CASES)
def test_a_responses_stream_assembles_to_the_non_streamed_response(res: ChatResult, deltas: Deltas, summary: bool,
                                                                   encrypted: bool) -> None:
    body: dict[str, Any] = {"model": "policy", "stream": True, "input": "hi", "tools": [
        {"type": "function", "name": "bash", "parameters": SHELL},
        {"type": "custom", "name": "apply_patch", "description": "Edit files"}, {"type": "local_shell"}]}
    if summary:
        body["reasoning"] = {"effort": "low", "summary": "auto"}
    if encrypted:
        body["include"] = ["reasoning.encrypted_content"]
    inbound = RESPONSES.parse(body, Route("/v1/responses"))
    renderer = ResponsesStream(inbound, CTX)
    early = sent_early(renderer, res, deltas)
    events = early + renderer.finish(res)
    content = joined(deltas)[1]
    assert "".join(data(e)["delta"] for e in early if e.event == "response.output_text.delta") == content
    # the reasoning item goes out whole just before the message starts
    assert [data(e)["item"]["type"] for e in early if e.event == "response.output_item.added"] == (
        ["reasoning"] * bool(res.message.reasoning_content) + ["message"] if content else [])
    assert responses_assembled(events) == RESPONSES.render(res, inbound, CTX)
    text = "".join(data(e)["delta"] for e in events if e.event == "response.output_text.delta")
    assert text == res.text


@pytest.mark.parametrize("res", [*RESULTS.values(), result("", None, [
    ("local_shell", '{"command": ["ls", "-la"], "timeout_ms": 500}'), ("apply_patch", '{"patch": "*** End"}'),
    ("apply_patch", ""), ("bash", "")], "tool_calls")], ids=[*RESULTS, "every kind of call"])
def test_the_synthesized_responses_stream_assembles_to_the_response(res: ChatResult) -> None:
    """The stream a non-passed-through call gets (and the end of every passed-through one) is built from the final
    items: every kind of item, empty arguments and inputs included."""
    inbound = RESPONSES.parse({"model": "policy", "stream": True, "input": "hi", "reasoning": {"summary": "auto"},
                               "tools": [{"type": "function", "name": "bash", "parameters": SHELL},
                                         {"type": "custom", "name": "apply_patch"}, {"type": "local_shell"}]},
                              Route("/v1/responses"))
    events = list(RESPONSES.stream(res, inbound, CTX))
    assert responses_assembled(events) == RESPONSES.render(res, inbound, CTX)


# ------------------------------------------------------------------------------------------- the shared pieces


def test_rest_is_what_the_final_text_adds_to_what_was_sent() -> None:
    assert rest("Hello there", "Hello") == " there"
    assert rest("Hello", "Hello") == ""
    assert rest(None, "") == ""
    assert rest("Goodbye", "Hello") == "Goodbye"  # a parser that broke its contract: the whole text, not a slice


def inbounds() -> dict[str, Inbound[Any]]:
    user = [{"role": "user", "content": "hi"}]
    return {
        "anthropic": ANTHROPIC.parse({"model": "policy", "max_tokens": 64, "stream": True, "messages": user},
                                     Route("/v1/messages")),
        "openai_chat": CHAT.parse({"model": "policy", "stream": True, "messages": user,
                                   "stream_options": {"include_usage": True}}, Route("/v1/chat/completions")),
        "openai_responses": RESPONSES.parse({"model": "policy", "stream": True, "input": "hi"}, Route("/v1/responses")),
    }


@pytest.mark.parametrize("name", ["anthropic", "openai_chat", "openai_responses"])
@pytest.mark.parametrize("res", [RESULTS["reasoning, text and calls"], RESULTS["text"], RESULTS["nothing"]],
                         ids=["calls", "text", "nothing"])
def test_held_to_the_end_a_passed_through_stream_is_the_synthesized_stream(name: str, res: ChatResult) -> None:
    """When the parser lets nothing go early, the client gets what a non-passed-through stream sends (Anthropic's
    closing usage aside: the pass-through one repeats the input tokens)."""
    inbound = inbounds()[name]
    provider = BY_NAME[name]
    passed = drive(stream_renderer(provider, inbound, CTX), res, [])
    synthesized = list(provider.stream(res, inbound, CTX))
    if name == "anthropic":
        assert data(passed[-2])["usage"] == {**data(synthesized[-2])["usage"], "input_tokens": 23,
                                             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        passed, synthesized = passed[:-2] + passed[-1:], synthesized[:-2] + synthesized[-1:]
    assert passed == synthesized


def test_a_provider_without_a_renderer_gets_its_synthesized_stream_at_the_end() -> None:
    class Plain(OpenAIChatProvider):
        name = "plain"

    inbound = inbounds()["openai_chat"]
    res = RESULTS["reasoning and text"]
    renderer = stream_renderer(Plain(), inbound, CTX)
    assert isinstance(renderer, SynthesizedStream) and not renderer.needs_prompt_tokens
    assert renderer.start(23) == [] and renderer.delta("look", "The") == []
    assert renderer.finish(res) == list(CHAT.stream(res, inbound, CTX))


def test_each_provider_streams_through_its_own_renderer() -> None:
    for name, kind in [("anthropic", MessagesStream), ("openai_chat", ChatStream),
                       ("openai_responses", ResponsesStream)]:
        provider = BY_NAME[name]
        assert type(stream_renderer(provider, inbounds()[name], CTX)) is kind
    # only Anthropic's opening says how long the prompt is, so only it waits for the prompt's IDs
    assert MessagesStream.needs_prompt_tokens
    assert not any(k.needs_prompt_tokens for k in (ChatStream, ResponsesStream, GenerateContentStream))


# -------------------------------------------------------------------------------------------- per provider


def test_a_messages_stream_opens_with_the_prompt_length_and_closes_thinking_with_its_signature() -> None:
    inbound = ANTHROPIC.parse({"model": "policy", "max_tokens": 64, "stream": True, "thinking": {
        "type": "enabled", "budget_tokens": 1024}, "messages": [{"role": "user", "content": "hi"}]},
        Route("/v1/messages"))
    renderer = MessagesStream(inbound, CTX)
    opening = renderer.start(41)
    assert data(opening[0])["message"]["usage"] == {"input_tokens": 41, "output_tokens": 0,
                                                    "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    assert data(opening[0])["message"]["id"] == CTX.response_id and data(opening[0])["message"]["model"] == "policy"
    first = renderer.delta("look ", "")
    assert [(e.event, data(e).get("index")) for e in first] == [("content_block_start", 0), ("content_block_delta", 0)]
    assert renderer.delta("first", "") == [SSEEvent(event="content_block_delta", data={
        "type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "first"}})]
    text = renderer.delta("", "Done")
    assert [(e.event, data(e).get("index"), data(e).get("delta", {}).get("type")) for e in text] == [
        ("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, None), ("content_block_delta", 1, "text_delta")]
    assert data(text[0])["delta"]["signature"] == thinking_signature("look first")
    end = renderer.finish(result("Done.", "look first", [("bash", "{}")], "tool_calls"))
    assert [(e.event, data(e).get("index")) for e in end] == [
        ("content_block_delta", 1), ("content_block_stop", 1), ("content_block_start", 2),
        ("content_block_delta", 2), ("content_block_stop", 2), ("message_delta", None), ("message_stop", None)]
    assert data(end[-2])["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert data(end[-2])["usage"]["output_tokens"] == 9


def test_a_chat_stream_sends_reasoning_before_content_and_calls_whole_at_the_end() -> None:
    inbound = inbounds()["openai_chat"]
    renderer = ChatStream(inbound, CTX)
    res = RESULTS["reasoning, text and calls"]
    events = drive(renderer, res, [("ls shows", ""), (" them", "I will")])
    deltas = [data(e)["choices"][0]["delta"] for e in events[:-2]]
    kinds = [next(iter(d)) for d in deltas[1:-1]]
    assert kinds == ["reasoning_content", "reasoning_content", "content", "content", "tool_calls", "tool_calls",
                     "tool_calls", "tool_calls"]
    assert [d["tool_calls"][0]["index"] for d in deltas[1:-1] if "tool_calls" in d] == [0, 0, 1, 1]
    assert data(events[-3])["choices"][0]["finish_reason"] == "tool_calls"
    assert data(events[-2])["usage"] == {"prompt_tokens": 23, "completion_tokens": 9, "total_tokens": 32}


def test_a_gemini_stream_signs_the_first_call_else_the_last_part() -> None:
    inbound = GOOGLE.parse({"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
                           Route("/v1beta/models/policy:streamGenerateContent", model="policy",
                                 action="streamGenerateContent", query={"alt": "sse"}))
    renderer = GenerateContentStream(inbound, CTX)
    assert renderer.start(23) == [] and renderer.delta("quiet thoughts", "") == []
    (last,) = renderer.finish(RESULTS["reasoning, text and calls"])
    parts = data(last)["candidates"][0]["content"]["parts"]
    assert [sorted(p) for p in parts] == [["text"], ["functionCall", "thoughtSignature"], ["functionCall"]]
    assert data(last)["candidates"][0]["finishReason"] == "STOP"
    assert data(last)["usageMetadata"] == {"promptTokenCount": 23, "candidatesTokenCount": 9, "totalTokenCount": 32}
    renderer = GenerateContentStream(inbound, CTX)
    streamed = renderer.delta("all of it", "The file is there.")
    (last,) = renderer.finish(result("The file is there.", "all of it", finish="length", reasoning_tokens=4))
    assert data(streamed[0])["candidates"][0]["content"]["parts"] == [{"text": "The file is there."}]
    assert data(last)["candidates"][0]["content"]["parts"][0].keys() == {"text", "thoughtSignature"}
    assert data(last)["candidates"][0]["finishReason"] == "MAX_TOKENS"
    assert data(last)["usageMetadata"]["thoughtsTokenCount"] == 4


def test_a_responses_stream_counts_every_event_and_ends_incomplete_when_cut() -> None:
    inbound = inbounds()["openai_responses"]
    renderer = ResponsesStream(inbound, CTX)
    res = RESULTS["cut in the text"]
    events = drive(renderer, res, [("thought it", ""), (" through", "half ")])
    assert [data(e)["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1].event == "response.incomplete"
    final = data(events[-1])["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"} and final["status"] == "incomplete"
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["status"] == "incomplete"
    assert [data(e)["delta"] for e in events if e.event == "response.output_text.delta"] == ["half ", "an answ"]
