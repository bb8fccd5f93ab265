"""The tokenizer seam: render a chat with the model's own chat template, encode, decode.

``HFChatTokenizer`` wraps a transformers tokenizer saved in a directory (the test set-up builds one from the Qwen2
vocabulary and the Qwen3 chat template). Tests of pure logic use the round-tripping fake in ``tests/_fakes.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from polar_gym.merge.exports import template_tool
from polar_gym.proxy.chat import ChatMessage, ChatRequest, message_text
from polar_gym.proxy.images import IMAGE_PLACEHOLDERS

__all__ = ["ChatTokenizer", "HFChatTokenizer", "load_tokenizer", "template_messages"]


@runtime_checkable
class ChatTokenizer(Protocol):
    end_of_turn_ids: list[int]

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """Prompt token IDs for ``messages`` with the generation prompt appended."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def template_messages(request: ChatRequest, *, images: bool = False,
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages and tools exactly as vLLM hands them to the chat template, so a prompt we render equals the
    engine's: text content, ``developer`` folded into ``system``, tool-call arguments parsed into objects (anything
    that is not a JSON object becomes ``{}``), and each tool as ``{type, function: {name, description,
    parameters}}`` in that order with missing fields null. ``images``: a message with images keeps its parts, each
    image as ``{"type": "image"}`` (a vision model's template renders its placeholder; a text model drops them)."""
    out = [_template_message(msg, images) for msg in request.messages]
    tools = None
    if request.tools:
        tools = [template_tool(t.function) for t in request.tools]
    return out, tools


def _arguments(raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _template_message(msg: ChatMessage, images: bool = False) -> dict[str, Any]:
    role = "system" if msg.role == "developer" else msg.role
    content: Any = message_text(msg)
    if images and isinstance(msg.content, list) and any(part.type == "image_url" for part in msg.content):
        content = [{"type": "image"} if part.type == "image_url" else {"type": "text", "text": part.text or ""}
                   for part in msg.content]
    item: dict[str, Any] = {"role": role, "content": content}
    if msg.reasoning_content:
        item["reasoning_content"] = msg.reasoning_content
    if msg.tool_calls:
        item["tool_calls"] = [{"id": c.id, "type": "function",
                               "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                              for c in msg.tool_calls]
    if msg.tool_call_id:
        item["tool_call_id"] = msg.tool_call_id
    return item


def load_tokenizer(path: Path) -> Any:
    """The tokenizer AutoTokenizer loads from ``path``, without AutoTokenizer's import of torch (through the model
    configs' module: 1.6 s of CPU at the start of every proxy, gateway and launch) where its choice is plain: a
    tokenizer-only directory (no config.json) whose tokenizer_config.json names a tokenizer class transformers has
    and no remote code. Everything else (a model's directory, a Llama class, whose ByteLevel files AutoTokenizer
    reroutes) goes through AutoTokenizer. tests/unit/test_tokenizer_loading.py pins that both give the same one."""
    import transformers

    named = _named_class(path)
    if named is not None:
        return named.from_pretrained(str(path), local_files_only=True)
    return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _named_class(path: Path) -> Any:
    """The tokenizer class tokenizer_config.json names when AutoTokenizer would take it as it is; else None."""
    import transformers

    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    if not isinstance(name, str) or "auto_map" in config or (path / "config.json").exists():
        return None
    name = name.removesuffix("Fast")
    if name.startswith("Llama") or not name.isidentifier():
        return None
    found = getattr(transformers, name, None) or getattr(transformers, name + "Fast", None)
    # any other attribute of transformers a config might name (a model, a pipeline) is not ours to load
    return found if isinstance(found, type) and issubclass(found, transformers.PreTrainedTokenizerBase) else None


class HFChatTokenizer:
    """A transformers tokenizer plus its chat template, loaded from a local directory (never from a hub)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._tok = load_tokenizer(self.path)
        ends = [self._tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
        self.end_of_turn_ids = [int(t) for t in ends if isinstance(t, int) and t >= 0]
        if self._tok.eos_token_id is not None and self._tok.eos_token_id not in self.end_of_turn_ids:
            self.end_of_turn_ids.append(int(self._tok.eos_token_id))
        #: the Rust tokenizer behind a fast one, called directly: transformers' ``encode`` goes through
        #: ``encode_batch``, whose thread pool wakes per call (0.2 ms idle, over a millisecond on a loaded machine,
        #: on every call's critical path); the same pipeline, so the same IDs (truncation and padding off, as
        #: transformers sets them for an ``encode`` without limits)
        self._backend = getattr(self._tok, "_tokenizer", None) if getattr(self._tok, "is_fast", False) else None
        if self._backend is not None:
            self._backend.no_truncation()
            self._backend.no_padding()

    @property
    def end_of_turn_text(self) -> str:
        """The text of the token that ends a turn in the chat template (``<|im_end|>`` for Qwen)."""
        return str(self._tok.convert_ids_to_tokens(self.end_of_turn_ids[0]))

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        return self.encode(self.render_text(messages, tools))

    def render_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
                    add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> str:
        """The chat template's text for ``messages`` (``template_kwargs``: the request's chat_template_kwargs)."""
        schemas: list[dict[Any, Any] | Callable[..., Any]] | None = list(tools) if tools is not None else None
        text = self._tok.apply_chat_template(messages, tools=schemas, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **(template_kwargs or {}))
        if not isinstance(text, str):  # tokenize=False renders text; anything else is a transformers change
            raise TypeError(f"the chat template rendered {type(text).__name__}, not text")
        return text

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=False))


def image_token_id_in(directory: str | Path) -> int | None:
    """The id of the model's image placeholder token (:data:`polar_gym.proxy.images.IMAGE_PLACEHOLDERS`) among the
    added tokens of the tokenizer in ``directory``; None for a text model's tokenizer or one without
    ``tokenizer.json`` (read without loading the tokenizer: a chat-mode proxy need not load one)."""
    try:
        added = json.loads((Path(directory) / "tokenizer.json").read_text()).get("added_tokens") or []
    except (OSError, ValueError):
        return None
    ids: dict[str, int] = {entry["content"]: entry["id"] for entry in added if isinstance(entry, dict)
                           and isinstance(entry.get("id"), int) and isinstance(entry.get("content"), str)}
    return next((ids[name] for name in IMAGE_PLACEHOLDERS if name in ids), None)
