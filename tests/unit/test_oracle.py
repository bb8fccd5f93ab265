"""The oracle policy: finds each harness's shell tool, fills its schema, plays the script, renders real prompts."""

from __future__ import annotations

import json

import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.proxy.chat import ChatMessage, ChatRequest, FunctionCall, Tool, ToolCall
from polar_gym.proxy.engines.oracle import OracleEngine, find_shell_tool, shell_arguments
from polar_gym.schema import OracleScript
from tests._fakes import ByteTokenizer


def tool(name: str, props: dict, required: list[str]) -> Tool:
    return Tool(function={"name": name, "description": "", "parameters": {
        "type": "object", "properties": props, "required": required}})


# The shell tools the six harnesses offer (argument schemas as they send them, abridged).
HARNESS_SHELL_TOOLS = {
    "claude_code": tool("Bash", {"command": {"type": "string"}, "timeout": {"type": "number"},
                                 "description": {"type": "string"}, "run_in_background": {"type": "boolean"}},
                        ["command"]),
    "codex": tool("shell", {"command": {"type": "array", "items": {"type": "string"}},
                            "workdir": {"type": "string"}, "timeout_ms": {"type": "number"}}, ["command"]),
    "gemini_cli": tool("run_shell_command", {"command": {"type": "string"}, "description": {"type": "string"},
                                             "directory": {"type": "string"}}, ["command"]),
    "qwen_code": tool("run_shell_command", {"command": {"type": "string"}, "is_background": {"type": "boolean"},
                                            "description": {"type": "string"}}, ["command", "is_background"]),
    "opencode": tool("bash", {"command": {"type": "string"}, "timeout": {"type": "number"},
                              "description": {"type": "string"}}, ["command", "description"]),
    "pi": tool("bash", {"command": {"type": "string"}, "timeout": {"type": "number"}}, ["command"]),
}
DECOYS = [tool("Read", {"file_path": {"type": "string"}}, ["file_path"]),
          tool("Grep", {"pattern": {"type": "string"}}, ["pattern"])]


@pytest.mark.parametrize("harness", sorted(HARNESS_SHELL_TOOLS))
def test_finds_and_fills_each_harness_shell_tool(harness):
    shell = HARNESS_SHELL_TOOLS[harness]
    found = find_shell_tool([*DECOYS, shell])
    assert found is shell
    args = shell_arguments(shell, "make test")
    command = args.get("command")
    assert command == (["bash", "-lc", "make test"] if harness == "codex" else "make test")
    for name in shell.parameters["required"]:
        assert name in args
    assert args.get("is_background", False) is False


def test_a_tool_with_cmd_parameter_and_no_known_name():
    custom = tool("run_it", {"cmd": {"type": "string"}}, ["cmd"])
    assert find_shell_tool([*DECOYS, custom]) is custom
    assert shell_arguments(custom, "ls") == {"cmd": "ls"}
    assert find_shell_tool(DECOYS) is None


def request(messages: list[ChatMessage], tools: list[Tool] | None = None, **kw) -> ChatRequest:
    return ChatRequest(model="policy", messages=messages, tools=tools, **kw)


async def test_plays_the_script_then_answers():
    engine = OracleEngine(ByteTokenizer(), default_script=OracleScript(commands=["a", "b"], final_answer="finished"))
    shell = HARNESS_SHELL_TOOLS["pi"]
    msgs = [ChatMessage(role="user", content="go")]
    commands = []
    for _ in range(3):
        result = await engine.complete(request(msgs, [shell]), "s")
        msgs.append(result.message)
        for call in result.message.tool_calls or []:
            commands.append(json.loads(call.function.arguments)["command"])
            msgs.append(ChatMessage(role="tool", tool_call_id=call.id, content="ok"))
    assert commands == ["a", "b"]
    assert result.finish_reason == "stop" and result.text == "finished"
    assert result.response_ids[-1] == 257  # end of turn
    assert len(result.response_logprobs) == len(result.response_ids)
    assert all(lp <= 0 for lp in result.response_logprobs)


@pytest.mark.parametrize(("reasoning", "thought"), [("quote", "Step 1: run `sed -i s/-/+/ calc.py`."),
                                                     ("brief", "Step 1.")])
def test_a_brief_script_does_not_quote_its_command_in_the_reasoning(reasoning, thought):
    """A forked task's scripts think briefly, so the token a fork changes is in the tool call only."""
    script = OracleScript(commands=["sed -i s/-/+/ calc.py"], reasoning=reasoning)
    engine = OracleEngine(ByteTokenizer(), default_script=script)
    message = engine.next_message(request([ChatMessage(role="user", content="go")], [HARNESS_SHELL_TOOLS["pi"]]), "s")
    assert message.reasoning_content == thought and message.tool_calls


async def test_without_a_shell_tool_it_answers_in_text():
    engine = OracleEngine(ByteTokenizer(), default_script=OracleScript(commands=["a"], final_answer="text only"))
    result = await engine.complete(request([ChatMessage(role="user", content="title?")], DECOYS), "s")
    assert result.message.tool_calls is None and result.text == "text only"


async def test_per_session_scripts():
    engine = OracleEngine(ByteTokenizer(), default_script=OracleScript(commands=["default"]))
    engine.set_script("special", OracleScript(commands=["special-cmd"]))
    shell = HARNESS_SHELL_TOOLS["opencode"]
    msgs = [ChatMessage(role="user", content="go")]
    a = await engine.complete(request(msgs, [shell]), "special")
    b = await engine.complete(request(msgs, [shell]), "other")
    assert json.loads(a.message.tool_calls[0].function.arguments)["command"] == "special-cmd"
    assert json.loads(b.message.tool_calls[0].function.arguments)["command"] == "default"


async def test_max_tokens_stops_by_length():
    engine = OracleEngine(ByteTokenizer(), default_script=OracleScript(commands=[], final_answer="a long final answer"))
    result = await engine.complete(request([ChatMessage(role="user", content="x")], max_tokens=5), "s")
    assert result.finish_reason == "length" and len(result.response_ids) == 5
    assert 257 not in result.response_ids


@pytest.fixture(scope="module")
def qwen():
    from polar_gym.proxy.tokenizer import HFChatTokenizer

    if not (tokenizer_dir() / ".complete").exists():
        pytest.fail("the Qwen tokenizer asset is missing: run `bash scripts/setup.sh`")
    return HFChatTokenizer(tokenizer_dir())


async def test_real_qwen_rendering_and_drift(qwen):
    assert qwen.end_of_turn_ids[0] == 151645
    script = OracleScript(commands=["echo hello world > greeting.txt"])
    canonical = OracleEngine(qwen, default_script=script)
    drifting = OracleEngine(qwen, default_script=script, drift_every=1)
    shell = HARNESS_SHELL_TOOLS["claude_code"]
    req = request([ChatMessage(role="system", content="You are a coder."), ChatMessage(role="user", content="go")],
                  [shell])
    a = await canonical.complete(req, "s")
    b = await drifting.complete(req, "s")
    assert a.prompt_ids == b.prompt_ids
    text = qwen.decode(a.prompt_ids)
    assert text.startswith("<|im_start|>system\nYou are a coder.") and text.endswith("<|im_start|>assistant\n")
    assert '"name": "Bash"' in text  # the tool was rendered by the Qwen3 template
    assert a.response_ids != b.response_ids  # non-canonical on purpose...
    assert qwen.decode(a.response_ids) == qwen.decode(b.response_ids)  # ...for the very same text
    assert qwen.decode(a.response_ids).endswith("</tool_call><|im_end|>")
    assert b.raw["drift"] is True and a.raw["drift"] is False

    # The next turn's prompt starts with the previous prompt (append-only rendering of the Qwen3 template).
    call = a.message.tool_calls[0]
    nxt = request([*req.messages, a.message, ChatMessage(role="tool", tool_call_id=call.id, content="")], [shell])
    c = await canonical.complete(nxt, "s")
    assert c.prompt_ids[: len(a.prompt_ids)] == a.prompt_ids


async def test_drift_counts_the_calls_of_each_session_not_of_the_engine(qwen):
    """Six harnesses share one engine: with a global count, one whose calls alternate with another's never drifts."""
    engine = OracleEngine(qwen, default_script=OracleScript(commands=["echo hello world > greeting.txt"] * 4),
                          drift_every=2)
    shell = HARNESS_SHELL_TOOLS["pi"]
    req = request([ChatMessage(role="user", content="go")], [shell])
    drifted: dict[str, list[bool]] = {"a": [], "b": []}
    for _ in range(3):  # calls alternate a, b, a, b, ...
        for session in ("a", "b"):
            drifted[session].append((await engine.complete(req, session)).raw["drift"])
    assert drifted == {"a": [False, True, False], "b": [False, True, False]}
    engine.close_session("a")
    assert (await engine.complete(req, "a")).raw["drift"] is False  # a closed session counts afresh


def test_tool_call_message_shape():
    call = ToolCall(id="x", function=FunctionCall(name="bash", arguments='{"command": "ls"}'))
    text = OracleEngine(ByteTokenizer()).render_reply(ChatMessage(role="assistant", content="", tool_calls=[call]))
    assert text == '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'


def test_settings_make_the_oracle_token_in_unless_chat_is_asked(tmp_path):
    from polar_gym.proxy.settings import EngineSettings, build_engine, resolve_prompt_mode
    from polar_gym.settings import ConfigError

    assert resolve_prompt_mode(EngineSettings())[0::2] == ("token_in", "qwen3")
    default = build_engine(EngineSettings(drift_every=2))
    assert isinstance(default, OracleEngine) and default.prompt_mode == "token_in" and default.renderer is not None
    chat = build_engine(EngineSettings(prompt_mode="chat"))
    assert isinstance(chat, OracleEngine) and chat.prompt_mode == "chat" and chat.renderer is None
    with pytest.raises(ConfigError) as err:
        build_engine(EngineSettings(parser="no_such_parser"))
    assert err.value.problems[0][0] == "parser"


def test_token_in_needs_a_template_tokenizer():
    class Plain:
        end_of_turn_ids = [1]

        def render(self, messages, tools):
            return [0]

        def encode(self, text):
            return [0]

        def decode(self, ids):
            return ""

    with pytest.raises(TypeError, match="prompt_mode chat"):
        OracleEngine(Plain())
    assert OracleEngine(Plain(), prompt_mode="chat").renderer is None


async def test_token_in_extends_the_drifted_tokens_and_parses_the_sampled_text(qwen):
    """Every call drifts; each next prompt still starts with exactly the previous prompt + sampled tokens, and the
    reply the harness gets is what the qwen3 parser reads in the sampled text."""
    script = OracleScript(commands=["echo hello world > greeting.txt", "cat greeting.txt"], final_answer="All done.")
    engine = OracleEngine(qwen, default_script=script, drift_every=1)
    shell = HARNESS_SHELL_TOOLS["codex"]
    msgs = [ChatMessage(role="system", content="You are a coder."), ChatMessage(role="user", content="go")]
    previous = None
    for step in range(3):
        result = await engine.complete(request(msgs, [shell]), "s")
        assert result.raw["prompt_mode"] == "token_in" and result.raw["drift"] is True
        assert qwen.encode(qwen.decode(result.response_ids)) != result.response_ids  # non-canonical on purpose
        if previous is None:
            assert result.raw["new_chain"] == "new_context" and result.raw["reused_prompt_tokens"] == 0
        else:
            head = previous.prompt_ids + previous.response_ids
            assert result.prompt_ids[:len(head)] == head and "new_chain" not in result.raw
            assert result.raw["reused_prompt_tokens"] == len(head)
        assert "unparseable_tool_calls" not in result.raw
        msgs.append(result.message)
        if step < 2:
            (call,) = result.message.tool_calls
            assert result.finish_reason == "tool_calls" and call.id.startswith("call_")
            assert json.loads(call.function.arguments)["command"] == ["bash", "-lc", script.commands[step]]
            assert result.message.reasoning_content == f"Step {step + 1}: run `{script.commands[step]}`."
            msgs.append(ChatMessage(role="tool", tool_call_id=call.id, content="ok"))
        previous = result
    assert result.finish_reason == "stop" and result.text == "All done."
    assert await engine.count_tokens(request(msgs, [shell]), "s") > len(previous.prompt_ids)
    engine.close_session("s")
    assert engine.renderer.chain_count("s") == 0


async def test_token_in_without_thinking_writes_no_reasoning(qwen):
    engine = OracleEngine(qwen, default_script=OracleScript(commands=[], final_answer="Plain."))
    req = request([ChatMessage(role="user", content="hi")], extra={"chat_template_kwargs": {"enable_thinking": False}})
    result = await engine.complete(req, "s")
    assert result.message.reasoning_content is None and result.text == "Plain."
    assert "<think>" not in qwen.decode(result.response_ids)


#: the file-reading tools of the harnesses that have one (schemas abridged as they send them)
HARNESS_READ_TOOLS = {
    "pi": (tool("read", {"path": {"type": "string"}, "offset": {"type": "number"}}, ["path"]), "path"),
    "claude_code": (tool("Read", {"file_path": {"type": "string"}, "limit": {"type": "number"}}, ["file_path"]),
                    "file_path"),
    "gemini_cli": (tool("read_file", {"absolute_path": {"type": "string"}}, ["absolute_path"]), "absolute_path"),
    "opencode": (tool("read", {"filePath": {"type": "string"}}, ["filePath"]), "filePath"),
    "codex": (tool("view_image", {"path": {"type": "string"}}, ["path"]), "path"),
}


@pytest.mark.parametrize("harness", sorted(HARNESS_READ_TOOLS))
async def test_a_script_reads_its_files_through_the_harness_read_tool_then_runs_its_commands(harness):
    """A task whose answer is in an image: the oracle looks at it as a model would (the harness then sends the image),
    then runs its commands through the shell tool, numbering its steps across both."""
    reader, key = HARNESS_READ_TOOLS[harness]
    engine = OracleEngine(ByteTokenizer(), default_script=OracleScript(reads=["card.png"], commands=["echo blue"]))
    msgs, calls, thoughts = [ChatMessage(role="user", content="go")], [], []
    for _ in range(3):
        result = await engine.complete(request(msgs, [HARNESS_SHELL_TOOLS["pi"], reader]), "s")
        msgs.append(result.message)
        thoughts.append(result.message.reasoning_content)
        for call in result.message.tool_calls or []:
            calls.append((call.function.name, json.loads(call.function.arguments)))
            msgs.append(ChatMessage(role="tool", tool_call_id=call.id, content="ok"))
    assert calls == [(reader.name, {key: "card.png"}), ("bash", {"command": "echo blue"})]
    assert thoughts[:2] == ["Step 1: read `card.png`.", "Step 2: run `echo blue`."]
    assert result.finish_reason == "stop"


async def test_without_a_read_tool_the_reads_are_skipped():
    engine = OracleEngine(ByteTokenizer(), default_script=OracleScript(reads=["card.png"], commands=["echo blue"]))
    result = await engine.complete(request([ChatMessage(role="user", content="go")], [HARNESS_SHELL_TOOLS["pi"]]), "s")
    (call,) = result.message.tool_calls or []
    assert json.loads(call.function.arguments) == {"command": "echo blue"}


def test_the_colour_card_task_ships_a_real_png_and_reads_it_first():
    import io

    from PIL import Image

    from polar_gym.tasks import demo_task, demo_tasks

    task = demo_task("demo-colour-card")
    assert task not in demo_tasks()  # kept out of the set every harness's oracle tests run
    with Image.open(io.BytesIO(task.binary_files["card.png"])) as image:
        assert image.size == (96, 64) and image.convert("RGB").getpixel((5, 5)) == (30, 60, 220)
    script = task.oracle_script()
    assert script.reads == ["card.png"] and script.commands[0] == "echo blue > colour.txt"
    (write,) = [a for a in task.prepare_actions() if a.type == "exec" and "card.png" in str(a.command)]
    assert "base64.b64decode" in str(write.command)
