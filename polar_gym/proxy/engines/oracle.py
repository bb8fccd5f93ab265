"""The oracle: a deterministic, scripted policy for validating a pipeline without a GPU. It is not a model.

It plays the session's reference solution one command per call through whatever shell-like tool the harness
offers, filling that tool's own argument schema, and finally answers in text. Its "sampled" tokens are the
canonical encoding of a Qwen-style assistant turn, or, when ``drift_every`` is set, a deliberately non-canonical
encoding of the same text, so that retokenization drift downstream is exercised.

Prompts are built like a real engine's (``prompt_mode``): ``token_in`` (the default) plans them exactly as the
token-in engines do (a session chain's exact IDs plus the rendered new turns, :mod:`polar_gym.proxy.prefix`) and
turns the sampled text back into the protocol's message through the output parser, so the proxy's output-parsing
path runs in every front end; ``chat`` renders the whole prompt with the chat template every call, as an engine's
chat endpoint does (a drift then starts a new chain).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import pydantic

from polar_gym.proxy.chat import (
    ChatMessage,
    ChatRequest,
    ChatResult,
    FinishReason,
    FunctionCall,
    Tool,
    ToolCall,
    Usage,
    message_text,
)
from polar_gym.proxy.engines.base import Engine, WeightUpdateMode
from polar_gym.proxy.engines.tokenin import keep_token_in_result, parse_reply, plan_prompt
from polar_gym.proxy.errors import SessionMetadataError, validation_message
from polar_gym.proxy.parsers.base import OutputParser, parser_for
from polar_gym.proxy.prefix import PrefixRenderer, PromptPlan, TemplateTokenizer
from polar_gym.proxy.tokenizer import ChatTokenizer, template_messages
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.schema import OracleScript

__all__ = ["OracleEngine", "OracleTokenizer", "find_read_tool", "find_shell_tool", "oracle_script", "shell_arguments"]

OraclePromptMode = Literal["token_in", "chat"]
#: one scripted "sample": the reply, its sampled token IDs, the finish reason, whether it drifted
_Sample = tuple[ChatMessage, list[int], FinishReason, bool]

#: tool names harnesses give their shell tool, most specific first
SHELL_TOOL_NAMES = ("bash", "Bash", "shell", "run_shell_command", "exec_command", "shell_command", "local_shell",
                    "execute_command", "run_command", "run_commands", "terminal", "execute_bash", "exec", "cmd")
ORACLE_SERVER = "oracle://local"
_COMMAND_KEYS = ("command", "cmd", "script", "commands")
#: tool names harnesses give the tool that reads a file to the model (pi, opencode: read; Claude Code: Read; Gemini
#: CLI, Qwen Code: read_file; Codex: view_image), and the names of its path parameter
READ_TOOL_NAMES = ("read", "Read", "read_file", "view_image")
_PATH_KEYS = ("path", "file_path", "absolute_path", "filePath", "filename")


def oracle_script(metadata: Mapping[str, Any]) -> OracleScript | None:
    """The script in a session's metadata (``metadata["oracle"]``; None: it has none); SessionMetadataError, naming
    the bad field, when it is not one."""
    raw = metadata.get("oracle")
    if raw is None:
        return None
    try:
        return OracleScript.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise SessionMetadataError(f"invalid oracle script: {validation_message(exc)}") from exc


#: what a harness's instructions say that changes how a model must act (the oracle follows them as a model would):
#: the output line that ends mini-swe-agent's run, and aider's edit-block format, whose replies run ```bash blocks
SUBMIT_LINE = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
FENCED_SHELL_MARKERS = ("SEARCH/REPLACE",)
SHELL_FENCE = "```bash"


def harness_conventions(request: ChatRequest) -> tuple[list[str], bool]:
    """(commands to run after the script: the submit command the instructions ask for; whether shell commands go
    in a fenced block of the reply, for a harness that offers no shell tool), read from the instructions: the system
    messages and the user's (mini-swe-agent puts its rules in the first user message)."""
    text = "\n".join(message_text(m) for m in request.messages if m.role in ("system", "developer", "user"))
    submit = [f"echo {SUBMIT_LINE}"] if SUBMIT_LINE in text else []
    return submit, any(marker in text for marker in FENCED_SHELL_MARKERS)


def _command_key(tool: Tool) -> str | None:
    props = tool.parameters.get("properties") or {}
    for key in _COMMAND_KEYS:
        if key in props:
            return key
    return None


def find_shell_tool(tools: list[Tool] | None) -> Tool | None:
    """The harness's shell tool: by a known name first, else any tool with a ``command``-like parameter."""
    tools = tools or []
    by_name = {t.name: t for t in tools}
    for name in SHELL_TOOL_NAMES:
        tool = by_name.get(name)
        if tool is not None and _command_key(tool):
            return tool
    for tool in tools:
        if _command_key(tool):
            return tool
    return None


def find_read_tool(tools: list[Tool] | None) -> tuple[Tool, str] | None:
    """The harness's file-reading tool and its path parameter, by a known name (None: it has none)."""
    by_name = {t.name: t for t in tools or []}
    for name in READ_TOOL_NAMES:
        tool = by_name.get(name)
        props = tool.parameters.get("properties") or {} if tool is not None else {}
        key = next((k for k in _PATH_KEYS if k in props), None)
        if tool is not None and key is not None:
            return tool, key
    return None


def _with_required(tool: Tool, args: dict[str, Any]) -> dict[str, Any]:
    """``args`` and every other required parameter of ``tool``, filled with its default."""
    props: dict[str, Any] = tool.parameters.get("properties") or {}
    for name in tool.parameters.get("required") or []:
        if name not in args:
            args[name] = _default_for(name, props.get(name) or {})
    return args


def _default_for(name: str, schema: dict[str, Any]) -> Any:
    if "default" in schema:
        return schema["default"]
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind == "boolean":
        return False
    if kind in ("integer", "number"):
        return 120000 if "timeout" in name.lower() else schema.get("minimum", 1)
    if kind == "array":
        return []
    if kind == "object":
        return {}
    return "Run a step of the reference solution" if "desc" in name.lower() else "."


def shell_arguments(tool: Tool, command: str) -> dict[str, Any]:
    """Arguments for ``tool`` that run ``command``, matching its schema (a string, an argv array, or a list of
    command lines; other required parameters filled with their defaults)."""
    params = tool.parameters
    props: dict[str, Any] = params.get("properties") or {}
    key = _command_key(tool) or "command"
    schema = props.get(key) or {}
    kind = schema.get("type")
    # an array is an argv (codex's ``command``), except a list of command lines (cline's ``commands``)
    value: Any = command if kind != "array" else [command] if key == "commands" else ["bash", "-lc", command]
    return _with_required(tool, {key: value})


def _logprob(seed: str, i: int) -> float:
    digest = hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=4).digest()
    return -(int.from_bytes(digest, "little") % 2000) / 1000.0


@runtime_checkable
class OracleTokenizer(ChatTokenizer, TemplateTokenizer, Protocol):
    """What token_in needs of the oracle's tokenizer: the chat template's text and its end-of-turn marker too."""


class OracleEngine(Engine):
    name = "oracle"
    #: the oracle has no weights: a weight update only stamps its policy version on later answers, so a training
    #: loop runs end to end against it (its logprobs do not change)
    weight_updates: ClassVar[WeightUpdateMode | None] = "stamp"

    def __init__(self, tokenizer: ChatTokenizer, pool: UpstreamPool | None = None, *,
                 default_script: OracleScript | None = None, drift_every: int = 0, think: bool = True,
                 prompt_mode: OraclePromptMode = "token_in", parser: OutputParser | None = None) -> None:
        super().__init__(pool)
        if not self.pool.servers():
            self.pool.add(ORACLE_SERVER)
        self.tokenizer = tokenizer
        self.scripts: dict[str, OracleScript] = {}
        self.default_script = default_script or OracleScript()
        self.drift_every = drift_every
        self.think = think
        self.prompt_mode = prompt_mode
        self.parser = parser if parser is not None else parser_for("qwen3")
        self.renderer: PrefixRenderer | None = None
        if prompt_mode == "token_in":
            if not isinstance(tokenizer, OracleTokenizer):
                raise TypeError(f"prompt_mode token_in renders chat-template text: {type(tokenizer).__name__} has no "
                                "render_text / end_of_turn_text (use prompt_mode chat)")
            self.renderer = PrefixRenderer(tokenizer)
        self._calls: dict[str, int] = {}  # per session: which of its calls drift does not hang on other sessions

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.end_of_turn_ids)

    def open_session(self, session_id: str, metadata: Mapping[str, Any]) -> None:
        """Play the session's own script (``metadata["oracle"]``), else the default one."""
        script = oracle_script(metadata)
        if script is None:
            self.scripts.pop(session_id, None)
        else:
            self.scripts[session_id] = script

    def close_session(self, session_id: str) -> None:
        self.scripts.pop(session_id, None)
        self._calls.pop(session_id, None)
        if self.renderer is not None:
            self.renderer.forget(session_id)

    def set_script(self, session_id: str, script: OracleScript) -> None:
        self.scripts[session_id] = script

    def next_message(self, request: ChatRequest, session_id: str, *, think: bool = True) -> ChatMessage:
        """The scripted reply: the next unplayed command through the shell tool, else the final answer (with its
        reasoning unless the oracle or, ``think`` False, the prompt turned thinking off). It follows the harness's
        instructions as a model would (:func:`harness_conventions`): a submit command that ends the run, or, with
        no shell tool, the commands in one fenced shell block."""
        script = self.scripts.get(session_id, self.default_script)
        submit, fenced = harness_conventions(request)
        reader = find_read_tool(request.tools) if script.reads else None
        reads = list(script.reads) if reader is not None else []
        commands = [*script.commands, *submit]
        done = sum(1 for m in request.messages if m.role == "tool")
        tool = find_shell_tool(request.tools)
        step = done + 1
        think = think and self.think
        if reader is not None and done < len(reads) and request.tool_choice != "none":
            read_tool, key = reader
            path = reads[done]
            call = ToolCall(id=f"call_oracle_{step}_{hashlib.sha1(path.encode()).hexdigest()[:8]}",
                            function=FunctionCall(name=read_tool.name,
                                                  arguments=json.dumps(_with_required(read_tool, {key: path}))))
            quoted = f"Step {step}: read `{path}`." if script.reasoning == "quote" else f"Step {step}."
            return ChatMessage(role="assistant", content="", reasoning_content=quoted if think else None,
                               tool_calls=[call])
        done -= len(reads)
        if not request.tools and fenced and script.commands and not any(
                m.role == "assistant" and SHELL_FENCE in message_text(m) for m in request.messages):
            block = f"{SHELL_FENCE}\n" + "\n".join(script.commands) + "\n```"
            return ChatMessage(role="assistant", content=f"I will run these commands.\n\n{block}",
                               reasoning_content="The reference solution, in one shell block." if think else None)
        if tool is not None and done < len(commands) and request.tool_choice != "none":
            command = commands[done]
            call = ToolCall(id=f"call_oracle_{step}_{hashlib.sha1(command.encode()).hexdigest()[:8]}",
                            function=FunctionCall(name=tool.name,
                                                  arguments=json.dumps(shell_arguments(tool, command))))
            quoted = f"Step {step}: run `{command}`." if script.reasoning == "quote" else f"Step {step}."
            reasoning = quoted if think else None
            return ChatMessage(role="assistant", content="", reasoning_content=reasoning, tool_calls=[call])
        reasoning = "The reference solution is complete." if think else None
        return ChatMessage(role="assistant", content=script.final_answer, reasoning_content=reasoning)

    def render_reply(self, message: ChatMessage) -> str:
        """The assistant turn as a Qwen-style model writes it (without the end-of-turn token)."""
        text = ""
        if message.reasoning_content is not None:
            text += f"<think>\n{message.reasoning_content}\n</think>\n\n"
        text += message.content if isinstance(message.content, str) else ""
        for call in message.tool_calls or []:
            payload = {"name": call.function.name, "arguments": json.loads(call.function.arguments)}
            text += ("\n" if text and not text.endswith("\n") else "") + "<tool_call>\n"
            text += json.dumps(payload, ensure_ascii=False) + "\n</tool_call>"
        return text

    def encode_reply(self, text: str, drift: bool) -> list[int]:
        canonical = self.tokenizer.encode(text)
        if not drift:
            return canonical
        # Split one multi-character token near the middle into smaller ones: the same text, other tokens.
        order = sorted(range(len(canonical)), key=lambda i: abs(i - len(canonical) // 2))
        for i in order:
            piece = self.tokenizer.decode([canonical[i]])
            if len(piece) < 2 or piece.startswith("<|"):
                continue
            split = self.tokenizer.encode(piece[:1]) + self.tokenizer.encode(piece[1:])
            ids = canonical[:i] + split + canonical[i + 1:]
            if ids != canonical and self.tokenizer.decode(ids) == text:
                return ids
        return canonical

    def sample(self, request: ChatRequest, session_id: str, *, think: bool = True) -> _Sample:
        """(scripted reply, its "sampled" token IDs with the end of turn, finish reason, drifted?): cut to the
        request's max_tokens, the reply is then what those tokens say, finish ``length``."""
        calls = self._calls[session_id] = self._calls.get(session_id, 0) + 1
        message = self.next_message(request, session_id, think=think)
        drift = bool(self.drift_every) and calls % self.drift_every == 0
        response_ids = self.encode_reply(self.render_reply(message), drift) + self.tokenizer.end_of_turn_ids[:1]
        finish: FinishReason = "tool_calls" if message.tool_calls else "stop"
        if request.max_tokens is not None and len(response_ids) > request.max_tokens:
            response_ids = response_ids[: request.max_tokens]
            message = ChatMessage(role="assistant", content=self.tokenizer.decode(response_ids))
            finish = "length"
        return message, response_ids, finish, drift

    def result(self, session_id: str, message: ChatMessage, finish: FinishReason, prompt_ids: list[int],
               response_ids: list[int], drift: bool) -> ChatResult:
        seed = f"{session_id}:{len(prompt_ids)}"
        return ChatResult(
            message=message,
            finish_reason=finish,
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_logprobs=[_logprob(seed, i) for i in range(len(response_ids))],
            usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(response_ids)),
            engine=self.name,
            policy_version=self.pool.policy_version,
            raw={"drift": drift, "prompt_mode": self.prompt_mode},
        )

    async def complete(self, request: ChatRequest, session_id: str) -> ChatResult:
        if self.renderer is not None:
            return await self.complete_token_in(self.renderer, request, session_id)
        async with self.pool.lease(session_id) as server:
            # Chat-template rendering is CPU work: keep it off the event loop.
            result = await asyncio.to_thread(self.complete_sync, request, session_id)
            result.server = server.url
            return result

    def complete_sync(self, request: ChatRequest, session_id: str) -> ChatResult:
        """A chat-mode call: the whole prompt rendered by the chat template, the scripted message as it is."""
        messages, tools = template_messages(request)
        prompt_ids = self.tokenizer.render(messages, tools)
        message, response_ids, finish, drift = self.sample(request, session_id)
        return self.result(session_id, message, finish, prompt_ids, response_ids, drift)

    async def complete_token_in(self, renderer: PrefixRenderer, request: ChatRequest, session_id: str) -> ChatResult:
        """A token-in call: the prompt planned on the session's chains, the sampled text read back by the parser."""
        plan: PromptPlan = await plan_prompt(renderer, request, session_id)
        async with self.pool.lease(session_id) as server:
            _, response_ids, finish, drift = self.sample(request, session_id, think=plan.thinking)
            parsed = parse_reply(self.parser, self.tokenizer.decode(response_ids), request, plan)
            if parsed.message.tool_calls and finish == "stop":
                finish = "tool_calls"
            result = self.result(session_id, parsed.message, finish, plan.prompt_ids, response_ids, drift)
            result.server = server.url
        keep_token_in_result(renderer, session_id, plan, parsed, result, self.tokenizer.decode)
        return result

    async def count_tokens(self, request: ChatRequest, session_id: str) -> int:
        if self.renderer is not None:
            plan = await asyncio.to_thread(self.renderer.plan, request, session_id)
            return len(plan.prompt_ids)
        messages, tools = template_messages(request)
        return len(self.tokenizer.render(messages, tools))

