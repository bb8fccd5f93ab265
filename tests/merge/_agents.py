"""Scripted harness-side agents over the official SDKs, and the ground truth they leave behind.

Each agent keeps its own history the way its harness family does: the assistant turn sent back WITHOUT its thinking
(Anthropic-style clients drop it; OpenAI clients never had it in content), tool calls renamed to the client's own IDs,
tool results appended; it asks the proxy with its SDK and records in a :class:`Ledger` which answered call (by the
response ID the SDK returned) belongs to which conversation, and which attempts it abandoned or saw fail. The model
on the other side (``tests._drifting_vllm``) decides what to answer; the driver only decides who calls when.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai
from google import genai
from google.genai import types

__all__ = ["Agent", "AnthropicAgent", "ChatAgent", "GoogleAgent", "Ledger", "ResponsesAgent", "tool_spec"]

Results = Callable[[str], str]


def tool_spec(name: str) -> dict[str, Any]:
    """A one-argument command tool (name, description, JSON schema)."""
    return {"name": name, "description": f"{name}: run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


@dataclass
class Ledger:
    """Ground truth from the driver: each conversation's answered calls (response IDs, in order), and how many
    attempts per conversation the client abandoned (timed out) or saw fail."""

    calls: dict[str, list[str]] = field(default_factory=dict)
    abandoned: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)

    def used(self, conversation: str, response_id: str) -> None:
        self.calls.setdefault(conversation, []).append(response_id)

    def conversation_of(self) -> dict[str, str]:
        return {rid: conv for conv, ids in self.calls.items() for rid in ids}

    @property
    def completions(self) -> int:
        return sum(len(ids) for ids in self.calls.values()) + sum(self.abandoned.values()) + sum(self.failed.values())


def _default_result(command: str) -> str:
    return f"ok: {command}\nfile_{len(command)}.txt"


class Agent:
    """One conversation: ``step`` asks the model once and appends its answer and the tool results to the history."""

    def __init__(self, label: str, ledger: Ledger, system: str, task: str, tool: dict[str, Any]) -> None:
        self.label, self.ledger, self.system, self.tool = label, ledger, system, tool
        self.max_tokens = 2048  # a test may lower it for one call (an answer cut at max_tokens)
        self.turns = 0
        self.done = False
        self.start(task)

    def start(self, task: str) -> None:
        raise NotImplementedError

    def say(self, text: str) -> None:
        """A new user turn (a follow-up task)."""
        raise NotImplementedError

    def ask(self, client: Any) -> tuple[str, str, list[tuple[str, str]]]:
        """One call: (response ID, text, [(tool name, JSON arguments)])."""
        raise NotImplementedError

    def append(self, text: str, calls: list[tuple[str, str, str]], outputs: list[str]) -> None:
        """The answer as the client sends it back (thinking dropped), calls as (client ID, name, arguments)."""
        raise NotImplementedError

    def step(self, client: Any, results: Results = _default_result) -> bool:
        response_id, text, calls = self.ask(client)
        self.ledger.used(self.label, response_id)
        named = [(f"toolu_{self.label.replace('-', '_')}_{self.turns}_{i}", name, args)
                 for i, (name, args) in enumerate(calls)]
        self.turns += 1
        outputs = [results(str(json.loads(args).get("command", ""))) for _, _, args in named]
        self.append(text, named, outputs)
        self.done = not calls
        return self.done

    def run(self, client: Any, results: Results = _default_result) -> str:
        """Step until the model answers without a tool call; that final text."""
        while not self.step(client, results):
            pass
        return self.final_text()

    def final_text(self) -> str:
        raise NotImplementedError


class ChatAgent(Agent):
    """OpenAI Chat Completions: a system message, assistant turns with ``tool_calls``, ``tool`` messages."""

    def start(self, task: str) -> None:
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": self.system},
                                               {"role": "user", "content": task}]

    def say(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def ask(self, client: openai.OpenAI) -> tuple[str, str, list[tuple[str, str]]]:
        resp = client.chat.completions.create(model="policy", messages=self.messages,  # type: ignore[arg-type]
                                              tools=[{"type": "function", "function": self.tool}],  # type: ignore[typeddict-item]
                                              max_tokens=self.max_tokens)
        msg = resp.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []  # type: ignore[union-attr]
                 ]
        return resp.id, msg.content or "", calls

    def append(self, text: str, calls: list[tuple[str, str, str]], outputs: list[str]) -> None:
        turn: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            turn["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                                  for cid, name, args in calls]
        self.messages.append(turn)
        self.messages += [{"role": "tool", "tool_call_id": cid, "content": out}
                          for (cid, _, _), out in zip(calls, outputs, strict=True)]

    def final_text(self) -> str:
        return str(self.messages[-1]["content"])


class AnthropicAgent(Agent):
    """Anthropic Messages with thinking on: every other call streamed; thinking blocks are not sent back (unless
    ``keep_thinking``: then they are, signature and all, as Claude Code does within a tool loop)."""

    keep_thinking = False

    def start(self, task: str) -> None:
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": task}]

    def say(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def ask(self, client: anthropic.Anthropic) -> tuple[str, str, list[tuple[str, str]]]:
        tool = {"name": self.tool["name"], "description": self.tool["description"],
                "input_schema": self.tool["parameters"]}
        kwargs: dict[str, Any] = {"model": "policy", "system": self.system, "tools": [tool],
                                  "messages": self.messages, "max_tokens": 4096,
                                  "thinking": {"type": "enabled", "budget_tokens": 2048}}
        if self.turns % 2:
            with client.messages.stream(**kwargs) as stream:
                msg = stream.get_final_message()
        else:
            msg = client.messages.create(**kwargs)
        assert [b.type for b in msg.content][:1] == ["thinking"]  # the model thought; the client drops it below
        self.thinking = [{"type": "thinking", "thinking": b.thinking, "signature": b.signature}
                         for b in msg.content if b.type == "thinking"]
        text = "".join(b.text for b in msg.content if b.type == "text")
        calls = [(b.name, json.dumps(b.input)) for b in msg.content if b.type == "tool_use"]
        return msg.id, text, calls

    def append(self, text: str, calls: list[tuple[str, str, str]], outputs: list[str]) -> None:
        blocks: list[dict[str, Any]] = list(self.thinking) if self.keep_thinking else []
        blocks += [{"type": "text", "text": text}] if text else []
        blocks += [{"type": "tool_use", "id": cid, "name": name, "input": json.loads(args)}
                   for cid, name, args in calls]
        self.messages.append({"role": "assistant", "content": blocks})
        if calls:
            self.messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": cid, "content": out}
                for (cid, _, _), out in zip(calls, outputs, strict=True)]})

    def final_text(self) -> str:
        return "".join(b["text"] for b in self.messages[-1]["content"] if b["type"] == "text")


class ResponsesAgent(Agent):
    """OpenAI Responses: ``instructions``, input items (assistant message, function_call, function_call_output);
    reasoning items are not sent back."""

    def start(self, task: str) -> None:
        self.items: list[dict[str, Any]] = [{"role": "user", "content": task}]

    def say(self, text: str) -> None:
        self.items.append({"role": "user", "content": text})

    def ask(self, client: openai.OpenAI) -> tuple[str, str, list[tuple[str, str]]]:
        resp = client.responses.create(model="policy", instructions=self.system, input=self.items,  # type: ignore[arg-type]
                                       tools=[{"type": "function", "strict": False, **self.tool}],  # type: ignore[list-item]
                                       max_output_tokens=2048)
        calls = [(o.name, o.arguments) for o in resp.output if o.type == "function_call"]
        return resp.id, resp.output_text, calls

    def append(self, text: str, calls: list[tuple[str, str, str]], outputs: list[str]) -> None:
        if text:
            self.items.append({"role": "assistant", "content": text})
        self.items += [{"type": "function_call", "call_id": cid, "name": name, "arguments": args}
                       for cid, name, args in calls]
        self.items += [{"type": "function_call_output", "call_id": cid, "output": out}
                       for (cid, _, _), out in zip(calls, outputs, strict=True)]

    def final_text(self) -> str:
        return str(self.items[-1]["content"])


class GoogleAgent(Agent):
    """google-genai ``generate_content`` as Gemini CLI uses it: ``contents`` with model turns sent back without
    their thought parts, function calls without IDs, results as ``function_response`` parts matched by name."""

    def start(self, task: str) -> None:
        self.contents: list[types.Content] = [types.Content(role="user", parts=[types.Part(text=task)])]

    def say(self, text: str) -> None:
        self.contents.append(types.Content(role="user", parts=[types.Part(text=text)]))

    def ask(self, client: genai.Client) -> tuple[str, str, list[tuple[str, str]]]:
        declaration = types.FunctionDeclaration(name=self.tool["name"], description=self.tool["description"],
                                                parameters_json_schema=self.tool["parameters"])
        config = types.GenerateContentConfig(
            system_instruction=self.system, tools=[types.Tool(function_declarations=[declaration])],
            automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True), max_output_tokens=2048,
            thinking_config=types.ThinkingConfig(include_thoughts=True))
        resp = client.models.generate_content(model="gemini-2.5-pro", contents=self.contents, config=config)
        parts = resp.candidates[0].content.parts if resp.candidates and resp.candidates[0].content else None
        assert parts and parts[0].thought  # the model thought; the client drops it below
        text = "".join(p.text or "" for p in parts if not p.thought and p.text)
        calls = [(p.function_call.name or "", json.dumps(p.function_call.args))
                 for p in parts if p.function_call is not None]
        return str(resp.response_id), text, calls

    def append(self, text: str, calls: list[tuple[str, str, str]], outputs: list[str]) -> None:
        parts = [types.Part(text=text)] if text else []
        parts += [types.Part(function_call=types.FunctionCall(name=name, args=json.loads(args)))
                  for _, name, args in calls]
        self.contents.append(types.Content(role="model", parts=parts))
        if calls:
            self.contents.append(types.Content(role="user", parts=[
                types.Part.from_function_response(name=name, response={"output": out})
                for (_, name, _), out in zip(calls, outputs, strict=True)]))

    def final_text(self) -> str:
        parts = self.contents[-1].parts or []
        return "".join(p.text or "" for p in parts)
