"""Small pure helpers the adapters share: JSON and TOML text, the CLI binary, the side model name, MCP entries.

Kept apart from ``base.py`` so the interface stays readable and each adapter stays about a screen long.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from polar_gym.harness.base import HarnessContext
from polar_gym.harness.install import PINS
from polar_gym.harness.pyinstall import PY_PINS

__all__ = [
    "NO_PHONE_HOME",
    "SIDE_SUFFIX",
    "McpServer",
    "binary",
    "dump_json",
    "mcp_config",
    "side_model",
    "skill_files",
    "toml_table",
]

#: appended to the session's model name for side calls, unless AgentSpec.config["side_model"] names one
SIDE_SUFFIX = "-side"

#: opt-outs every npm CLI honours (telemetry conventions and npm's update notifier)
NO_PHONE_HOME = {"DO_NOT_TRACK": "1", "NO_UPDATE_NOTIFIER": "1"}


def dump_json(doc: Any) -> str:
    """Config file text: indented, with a final newline (the same text for the same doc)."""
    return json.dumps(doc, indent=2) + "\n"


def binary(ctx: HarnessContext, pin: str) -> str:
    """The CLI to run: the pinned install's path when the gateway knows it, else the binary's name on PATH."""
    return ctx.cli_path or (PINS[pin].binary if pin in PINS else PY_PINS[pin].on_path)


def side_model(ctx: HarnessContext) -> str:
    """The model name a harness is told to use for its side calls; never equal to the session's model name."""
    name = str(ctx.config.get("side_model") or f"{ctx.model_name}{SIDE_SUFFIX}")
    if name == ctx.model_name:
        raise ValueError(f"side_model must differ from the session's model name {ctx.model_name!r}")
    return name


def skill_files(root: str, skills: dict[str, str]) -> dict[str, str]:
    """``{root}/<name>/SKILL.md`` per skill; a name must be one plain directory name (no path tricks)."""
    for name in skills:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"skill name {name!r} must be a plain directory name")
    return {f"{root}/{name}/SKILL.md": text for name, text in skills.items()}


@dataclass(frozen=True)
class McpServer:
    """One stdio MCP server as users give it: ``{command, args, env}``."""

    command: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def mcp_config(servers: dict[str, Any] | None) -> dict[str, McpServer]:
    """Validate ``{name: {command, args, env}}`` (or McpServer values) early, so a typo fails before the run."""
    out: dict[str, McpServer] = {}
    for name, spec in (servers or {}).items():
        if isinstance(spec, McpServer):
            out[name] = spec
            continue
        if not isinstance(spec, dict) or not isinstance(spec.get("command"), str):
            raise ValueError(f"MCP server {name!r} needs a 'command' string, got {spec!r}")
        unknown = set(spec) - {"command", "args", "env"}
        if unknown:
            raise ValueError(f"MCP server {name!r} has unknown keys {sorted(unknown)} (known: command, args, env)")
        if not isinstance(spec.get("args") or [], list) or not isinstance(spec.get("env") or {}, dict):
            raise ValueError(f"MCP server {name!r}: 'args' must be a list and 'env' a mapping")
        out[name] = McpServer(spec["command"], [str(a) for a in spec.get("args") or []],
                              {str(k): str(v) for k, v in (spec.get("env") or {}).items()})
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def _toml_key(key: str) -> str:
    bare = key.replace("_", "").replace("-", "").isalnum() and key.isascii()
    return key if bare else json.dumps(key)


def toml_table(path: tuple[str, ...], values: dict[str, Any]) -> list[str]:
    """Lines of one TOML table (``path`` names it, ``()`` is the top level), then a blank line."""
    lines = [f"[{'.'.join(_toml_key(p) for p in path)}]"] if path else []
    return [*lines, *(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in values.items()), ""]
