"""The Qwen3 output parser (hermes tool calls, think blocks), the parser registry, and a round trip through the
real Qwen chat template: what the template renders for an assistant turn parses back to the same message."""

from __future__ import annotations

import json

import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.proxy.chat import ChatMessage, ChatRequest, FunctionCall, Tool, ToolCall
from polar_gym.proxy.parsers.base import OutputParser, ParsedReply, parser_for
from polar_gym.proxy.parsers.qwen3 import Qwen3Parser
from polar_gym.registry import PARSERS, RegistryError

QWEN = Qwen3Parser()
SHELL = Tool(function={"name": "shell", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}})


def call_block(name: str, args: dict[str, object]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def calls(reply: ParsedReply) -> list[tuple[str, dict[str, object]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in reply.message.tool_calls or []]


def test_registry_names_both_families_and_refuses_unknown_names():
    assert {"qwen3", "llama3_json"} <= set(PARSERS.names())
    assert isinstance(parser_for("qwen3"), Qwen3Parser)
    assert parser_for("qwen3").name == "qwen3"
    with pytest.raises(RegistryError, match=r"unknown parser 'qwen4'.*known: .*qwen3"):
        parser_for("qwen4")
    with pytest.raises(RegistryError, match="not an OutputParser"):
        parser_for("polar_gym.proxy.chat:ChatMessage")
    assert isinstance(parser_for("polar_gym.proxy.parsers.qwen3:Qwen3Parser"), OutputParser)


def test_reasoning_text_and_several_calls():
    text = ("<think>\nI should list, then read.\n</think>\n\nLet me look.\n" + call_block("shell", {"cmd": "ls"})
            + "\nthen\n" + call_block("read", {"path": "a.txt", "n": 3}) + "<|im_end|>")
    reply = QWEN.parse(text, [SHELL])
    assert reply.message.role == "assistant"
    assert reply.message.reasoning_content == "I should list, then read."
    assert reply.message.content == "Let me look.\n\nthen"
    assert calls(reply) == [("shell", {"cmd": "ls"}), ("read", {"path": "a.txt", "n": 3})]
    assert reply.unparseable_tool_calls == 0
    ids = [c.id for c in reply.message.tool_calls or []]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert ids == [c.id for c in QWEN.parse(text, [SHELL]).message.tool_calls or []]  # stable for the same text
    other = QWEN.parse(text.replace("ls", "pwd"), [SHELL]).message.tool_calls or []
    assert other[0].id != ids[0]


def test_arguments_are_a_json_string_of_the_object():
    reply = QWEN.parse(call_block("shell", {"cmd": "echo é ✓", "nested": {"a": [1, None]}}), [SHELL])
    (call,) = reply.message.tool_calls or []
    assert isinstance(call.function.arguments, str)
    assert json.loads(call.function.arguments) == {"cmd": "echo é ✓", "nested": {"a": [1, None]}}


def test_think_opened_in_the_prompt_leaves_only_the_close_tag():
    reply = QWEN.parse("the user wants ls\n</think>\n\n" + call_block("shell", {"cmd": "ls"}) + "<|im_end|>", None)
    assert reply.message.reasoning_content == "the user wants ls"
    assert reply.message.content is None
    assert calls(reply) == [("shell", {"cmd": "ls"})]


def test_thinking_off_means_no_reasoning_even_with_a_stray_close_tag():
    reply = QWEN.parse("Hello</think> there<|im_end|>", None, thinking=False)
    assert reply.message.reasoning_content is None
    assert reply.message.content == "Hello</think> there"
    assert QWEN.parse("plain answer<|endoftext|>", None, thinking=False).message.content == "plain answer"


def test_no_tags_is_a_direct_answer_and_an_open_think_cut_short_is_all_reasoning():
    assert QWEN.parse("just text<|im_end|>", None).message.model_dump(exclude_none=True) == {
        "role": "assistant", "content": "just text"}
    cut = QWEN.parse("<think>\nstill thinking about <tool_call>", None)
    assert cut.message.reasoning_content == "still thinking about <tool_call>"
    assert cut.message.content is None and cut.message.tool_calls is None and cut.unparseable_tool_calls == 0


def test_empty_think_and_only_a_tool_call():
    reply = QWEN.parse("<think>\n\n</think>\n\n" + call_block("shell", {}) + "<|im_end|>", [SHELL])
    assert reply.message.reasoning_content is None
    assert reply.message.content is None
    assert calls(reply) == [("shell", {})]
    empty = QWEN.parse("<think></think><|im_end|>", None)
    assert empty.message.content is None and empty.message.reasoning_content is None


def test_end_tokens_are_trimmed_only_at_the_end():
    reply = QWEN.parse("a<|im_end|>b<|im_end|>\n<|endoftext|>", None, thinking=False)
    assert reply.message.content == "a<|im_end|>b"


def test_a_block_that_does_not_parse_stays_text_and_is_counted():
    good = call_block("shell", {"cmd": "ls"})
    bad_json = "<tool_call>\n{\"name\": \"shell\", \"arguments\": {\"cmd\": }\n</tool_call>"
    no_name = "<tool_call>\n{\"arguments\": {}}\n</tool_call>"
    garbage = "<tool_call>\n{\"name\": \"shell\", \"arguments\": {}} trailing\n</tool_call>"
    reply = QWEN.parse(f"{bad_json}\n{good}\n{no_name}\n{garbage}<|im_end|>", [SHELL])
    assert calls(reply) == [("shell", {"cmd": "ls"})]
    assert reply.unparseable_tool_calls == 3
    assert reply.message.content == f"{bad_json}\n\n{no_name}\n{garbage}"


def test_an_unterminated_block_at_max_tokens_is_counted():
    text = "<think>x</think>ok\n" + call_block("shell", {"cmd": "ls"}) + "\n<tool_call>\n{\"name\": \"shell\", \"argu"
    reply = QWEN.parse(text, [SHELL])
    assert calls(reply) == [("shell", {"cmd": "ls"})]
    assert reply.unparseable_tool_calls == 1
    assert reply.message.content == "ok\n\n<tool_call>\n{\"name\": \"shell\", \"argu"


def test_a_call_to_a_tool_not_offered_is_still_a_call():
    """The harness answers it (as with any hosted API); the parser only reads what the model wrote."""
    assert calls(QWEN.parse(call_block("rm_rf", {}), [SHELL])) == [("rm_rf", {})]


def test_double_encoded_arguments_are_accepted_and_non_objects_are_not():
    double = json.dumps({"name": "shell", "arguments": json.dumps({"cmd": "ls"})})
    as_string = f"<tool_call>\n{double}\n</tool_call>"
    assert calls(QWEN.parse(as_string, None)) == [("shell", {"cmd": "ls"})]
    as_list = "<tool_call>\n{\"name\": \"shell\", \"arguments\": [1]}\n</tool_call>"
    reply = QWEN.parse(as_list, None)
    assert reply.message.tool_calls is None and reply.unparseable_tool_calls == 1


# --- round trip through the real Qwen chat template -------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_tokenizer():
    from polar_gym.proxy.tokenizer import HFChatTokenizer

    if not (tokenizer_dir() / ".complete").exists():
        pytest.fail("the Qwen tokenizer asset is missing: run `bash scripts/setup.sh`")
    return HFChatTokenizer(tokenizer_dir())


def rendered_assistant_text(tok, message: ChatMessage) -> str:
    """The assistant turn as the template renders it (as vLLM would hand it over), then through tokens and back as
    an engine's detokenized sample is: everything after the last ``<|im_start|>assistant\\n``."""
    from polar_gym.proxy.tokenizer import template_messages

    request = ChatRequest(model="m", messages=[ChatMessage(role="user", content="do it"), message], tools=[SHELL])
    messages, tools = template_messages(request)
    text = tok._tok.apply_chat_template(messages, tools=tools, tokenize=False)
    turn = text.rsplit("<|im_start|>assistant\n", 1)[1]
    return str(tok.decode(tok.encode(turn)))


def fn(name: str, arguments: str) -> ToolCall:
    return ToolCall(id="x", function=FunctionCall(name=name, arguments=arguments))


ROUND_TRIPS = [
    ChatMessage(role="assistant", reasoning_content="think first", content="Here it is.",
                tool_calls=[fn("shell", '{"cmd": "ls -la"}')]),
    ChatMessage(role="assistant", reasoning_content="two steps\n\nwith a gap",
                tool_calls=[fn("shell", '{"cmd": "cat \\"x\\""}'), fn("read", '{"path": "ü.txt", "n": 2}')]),
    ChatMessage(role="assistant", reasoning_content="just answer", content="The answer is 42.\nDone."),
    ChatMessage(role="assistant", content="no reasoning at all"),
]


@pytest.mark.parametrize("message", ROUND_TRIPS, ids=["text+call", "two-calls", "text-only", "no-reasoning"])
def test_round_trip_through_the_real_qwen_template(qwen_tokenizer, message):
    text = rendered_assistant_text(qwen_tokenizer, message)
    assert text.endswith("<|im_end|>\n")
    reply = QWEN.parse(text, [SHELL])
    assert reply.unparseable_tool_calls == 0
    assert reply.message.reasoning_content == message.reasoning_content
    assert reply.message.content == message.content
    want = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    assert calls(reply) == want


@pytest.mark.parametrize("message", [m for m in ROUND_TRIPS if m.reasoning_content is None] + [
    ChatMessage(role="assistant", content="ok", tool_calls=[fn("shell", '{"cmd": "true"}')])], ids=["text", "call"])
def test_round_trip_with_thinking_off(qwen_tokenizer, message):
    """With thinking off the prompt ends in ``<think>\\n\\n</think>\\n\\n``: the sample is what the template renders
    after it."""
    text = rendered_assistant_text(qwen_tokenizer, message)
    head, sample = text.split("</think>\n\n", 1)
    assert head == "<think>\n\n"
    reply = QWEN.parse(sample, [SHELL], thinking=False)
    assert reply.message.reasoning_content is None
    assert reply.message.content == message.content
    want = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    assert calls(reply) == want and reply.unparseable_tool_calls == 0
