"""One registry mechanism for every pluggable kind (providers, engines, builders, runtimes, harnesses, evaluators).

Entries are lazy ``"module:attribute"`` strings, so naming a plug-in costs no import until it is used. A name that
is not registered may itself be a dotted path (``pkg.module:Class``), which is how users extend any kind without
touching this package. The same names appear in Hydra YAML, in TaskRequest JSON and here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

__all__ = [
    "BUILDERS",
    "ENGINES",
    "EVALUATORS",
    "HARNESSES",
    "PARSERS",
    "PROVIDERS",
    "RUNTIMES",
    "Registry",
    "RegistryError",
    "load_dotted",
]

T = TypeVar("T")
C = TypeVar("C")


class RegistryError(LookupError):
    pass


@overload
def load_dotted(path: str) -> Any: ...
@overload
def load_dotted(path: str, expected: type[C]) -> type[C]: ...
def load_dotted(path: str, expected: type[Any] | None = None) -> Any:
    """Import ``pkg.module:attr`` (or ``pkg.module.attr``). What a string names is known only at run time, so the
    plain form is untyped; with ``expected`` the object must be that class or a subclass of it, and is typed so."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise RegistryError(f"not a dotted path: {path!r} (expected 'package.module:Name')")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RegistryError(f"cannot import {module_name!r} for {path!r}: {exc}") from exc
    try:
        target = getattr(module, attr)
    except AttributeError as exc:
        raise RegistryError(f"{module_name!r} has no attribute {attr!r}") from exc
    if expected is not None and not (isinstance(target, type) and issubclass(target, expected)):
        raise RegistryError(f"{path!r} is not a subclass of {expected.__module__}.{expected.__qualname__}")
    return target


class Registry(Generic[T]):
    """Names to lazily imported plug-ins of one kind. ``load`` turns a dotted path into a ``T``: the default trusts
    the path (plug-ins of a kind need not share a base class, builders are plain functions); a registry of classes
    can check them with ``functools.partial(load_dotted, expected=Base)``."""

    def __init__(self, kind: str, entries: dict[str, str] | None = None,
                 load: Callable[[str], T] = load_dotted) -> None:
        self.kind = kind
        self._entries: dict[str, str | T] = dict(entries or {})
        self._load = load

    def register(self, name: str, target: str | T) -> None:
        self._entries[name] = target

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> T:
        target = self._entries.get(name)
        if target is None:
            if ":" in name:
                return self._load(name)
            raise RegistryError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        if isinstance(target, str):
            target = self._entries[name] = self._load(target)
        return target


PROVIDERS: Registry[Any] = Registry("provider", {
    "anthropic": "polar_gym.proxy.providers.anthropic:AnthropicProvider",
    "openai_chat": "polar_gym.proxy.providers.openai_chat:OpenAIChatProvider",
    "openai_responses": "polar_gym.proxy.providers.openai_responses:OpenAIResponsesProvider",
    "google": "polar_gym.proxy.providers.google:GoogleProvider",
})

ENGINES: Registry[Any] = Registry("engine", {
    "vllm": "polar_gym.proxy.engines.vllm:VLLMEngine",
    "sglang": "polar_gym.proxy.engines.sglang:SGLangEngine",
    "sglang_generate": "polar_gym.proxy.engines.tokenin:SGLangTokenInEngine",  # sglang, always token_in
    "openai": "polar_gym.proxy.engines.openai:OpenAIEngine",
    "oracle": "polar_gym.proxy.engines.oracle:OracleEngine",
})

#: sampled text -> reasoning, content, tool calls (token-in engines); see polar_gym.proxy.parsers.base
PARSERS: Registry[Any] = Registry("parser", {
    "qwen3": "polar_gym.proxy.parsers.qwen3:Qwen3Parser",
    "llama3_json": "polar_gym.proxy.parsers.llama3:Llama3JsonParser",
})

BUILDERS: Registry[Any] = Registry("builder", {
    "per_request": "polar_gym.merge.per_request:per_request",
    "prefix_merging": "polar_gym.merge.prefix_merging:prefix_merging",
})

RUNTIMES: Registry[Any] = Registry("runtime", {
    "local": "polar_gym.runtime.local:LocalRuntime",
    "docker": "polar_gym.runtime.docker:DockerRuntime",
    "apptainer": "polar_gym.apptainer.runtime:ApptainerRuntime",
})

HARNESSES: Registry[Any] = Registry("harness", {
    "claude_code": "polar_gym.harness.claude_code:ClaudeCode",
    "codex": "polar_gym.harness.codex:Codex",
    "qwen_code": "polar_gym.harness.qwen_code:QwenCode",
    "gemini_cli": "polar_gym.harness.gemini_cli:GeminiCli",
    "opencode": "polar_gym.harness.opencode:OpenCode",
    "pi": "polar_gym.harness.pi:Pi",
    "mini_swe_agent": "polar_gym.harness.mini_swe_agent:MiniSweAgent",
    "aider": "polar_gym.harness.aider:Aider",
    "hermes": "polar_gym.harness.hermes:Hermes",
    "openhands": "polar_gym.harness.openhands:OpenHands",
    "cline": "polar_gym.harness.cline:Cline",
    "openclaw": "polar_gym.harness.openclaw:OpenClaw",
    "crush": "polar_gym.harness.crush:Crush",
    "shell": "polar_gym.harness.shell:ShellHarness",
})

EVALUATORS: Registry[Any] = Registry("evaluator", {
    "session_completed": "polar_gym.evaluate.session_completed:SessionCompleted",
    "test_on_output": "polar_gym.evaluate.test_on_output:TestOnOutput",
    "rubric": "polar_gym.evaluate.rubric:Rubric",
    "swebench_harness": "polar_gym.evaluate.swebench_harness:SwebenchHarness",
    "harbor": "polar_gym.evaluate.harbor:HarborVerifier",
})
