"""The harness adapters as pure renderers: golden argv, environment and config files per harness (pi per API), MCP
and skills rendering, side-model naming, the generic shell harness, registry lookup, and no I/O while rendering.
The live counterpart is test_live_clis.py, whose recorder builds every run from these adapters."""

from __future__ import annotations

import builtins
import importlib.util
import io
import json
import os
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from polar_gym.harness._common import McpServer, mcp_config, side_model
from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.harness.install import PINS
from polar_gym.harness.pi import API_PROVIDERS
from polar_gym.harness.pyinstall import PY_PINS
from polar_gym.registry import HARNESSES

CTX = HarnessContext(session_id="sess-1", instruction="Fix the failing test.", model_name="policy",
                     gateway_url="http://127.0.0.1:18080", workdir="/polar/work", home="/polar/home")
GW = "http://127.0.0.1:18080"
NO_PHONE_HOME = {"DO_NOT_TRACK": "1", "NO_UPDATE_NOTIFIER": "1"}
SERVER = {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/polar/work"],
          "env": {"LOG": "debug"}}
MCP = {"files": SERVER}


def adapter(name: str) -> Harness:
    return HARNESSES.get(name)()


def with_config(**config: Any) -> HarnessContext:
    return replace(CTX, config=config)


def parsed(files: dict[str, str]) -> dict[str, Any]:
    """Config files as data (JSON or TOML by extension), so the goldens read as the documents they are."""
    return {path: tomllib.loads(text) if path.endswith(".toml") else json.loads(text) if path.endswith(".json")
            else text for path, text in files.items()}


# -- registry ---------------------------------------------------------------------------------------------------------

#: the first six CLIs and the shell harness, whose shared config keys the tests below render (the harnesses added
#: since have their own tests: tests/harness/test_more_adapters.py, test_npm_adapters_more.py)
FIRST = ["claude_code", "codex", "gemini_cli", "opencode", "pi", "qwen_code", "shell"]
#: harnesses without a pinned install: the user's own command, and crush (its npm package downloads its binary)
UNPINNED = {"shell", "crush"}


def test_every_registered_harness_resolves_by_name() -> None:
    assert set(FIRST) < set(HARNESSES.names())
    for name in HARNESSES.names():
        cls = HARNESSES.get(name)
        assert issubclass(cls, Harness) and cls.name == name
        assert cls.pin == (None if name in UNPINNED else name)
        assert cls.pin is None or cls.pin in PINS or cls.pin in PY_PINS
        assert cls.provider in {"anthropic", "openai_chat", "openai_responses", "google"}


def test_cli_path_is_used_when_known_else_the_binary_name() -> None:
    for name in (n for n in FIRST if n in PINS):
        assert adapter(name).command(CTX)[0] == PINS[name].binary
        assert adapter(name).command(replace(CTX, cli_path="/opt/npm/.bin/x"))[0] == "/opt/npm/.bin/x"


# -- golden renderings ------------------------------------------------------------------------------------------------

def test_claude_code() -> None:
    h = adapter("claude_code")
    assert h.command(CTX) == ["claude", "-p", "Fix the failing test.", "--model", "policy",
                              "--dangerously-skip-permissions"]
    assert h.env(CTX) == {
        "ANTHROPIC_BASE_URL": GW, "ANTHROPIC_API_KEY": "sess-1",
        "ANTHROPIC_SMALL_FAST_MODEL": "policy-side", "ANTHROPIC_DEFAULT_HAIKU_MODEL": "policy-side",
        "IS_SANDBOX": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", **NO_PHONE_HOME}
    assert parsed(h.files(CTX)) == {"/polar/home/.claude.json": {"hasCompletedOnboarding": True}}
    assert h.log_paths(CTX) == ["/polar/home/.claude/projects"]
    assert h.provider_for(CTX) == "anthropic" and h.side_models(CTX) == ["policy-side"]


def test_codex() -> None:
    h = adapter("codex")
    assert h.command(CTX) == ["codex", "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                              "Fix the failing test."]
    assert h.env(CTX) == {"CODEX_HOME": "/polar/home/.codex", "POLAR_API_KEY": "sess-1", **NO_PHONE_HOME}
    assert parsed(h.files(CTX)) == {"/polar/home/.codex/config.toml": {
        "model": "policy", "model_provider": "polar", "approval_policy": "never",
        "sandbox_mode": "danger-full-access", "check_for_update_on_startup": False,
        "model_providers": {"polar": {"name": "polar_gym", "base_url": f"{GW}/v1", "env_key": "POLAR_API_KEY",
                                      "wire_api": "responses", "request_max_retries": 0, "stream_max_retries": 0}},
        "analytics": {"enabled": False}}}
    assert h.log_paths(CTX) == ["/polar/home/.codex/sessions"]
    assert h.provider_for(CTX) == "openai_responses" and h.side_models(CTX) == []


def test_qwen_code() -> None:
    h = adapter("qwen_code")
    assert h.command(CTX) == ["qwen", "--approval-mode", "yolo", "--model", "policy", "Fix the failing test."]
    assert h.env(CTX) == {"OPENAI_BASE_URL": f"{GW}/v1", "OPENAI_API_KEY": "sess-1", "OPENAI_MODEL": "policy",
                          **NO_PHONE_HOME}
    assert parsed(h.files(CTX)) == {"/polar/home/.qwen/settings.json": {
        "security": {"auth": {"selectedType": "openai"}}, "model": {"name": "policy"},
        "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True}}}
    assert h.log_paths(CTX) == ["/polar/home/.qwen/projects", "/polar/home/.qwen/debug"]
    assert h.provider_for(CTX) == "openai_chat" and h.side_models(CTX) == []


def test_qwen_code_fast_model_opt_in_names_the_side_model() -> None:
    h, ctx = adapter("qwen_code"), with_config(fast_model=True)
    settings = parsed(h.files(ctx))["/polar/home/.qwen/settings.json"]
    assert settings["fastModel"] == "policy-side"
    provider = {"baseUrl": f"{GW}/v1", "envKey": "OPENAI_API_KEY"}
    assert settings["modelProviders"] == {"openai": [{"id": "policy", "name": "policy", **provider},
                                                     {"id": "policy-side", "name": "policy-side", **provider}]}
    assert h.side_models(ctx) == ["policy-side"]


def test_gemini_cli() -> None:
    h = adapter("gemini_cli")
    assert h.command(CTX) == ["gemini", "--approval-mode", "yolo", "--model", "policy", "-p",
                              "Fix the failing test."]
    assert h.env(CTX) == {"GEMINI_API_KEY": "sess-1", "GOOGLE_GEMINI_BASE_URL": GW,
                          "GEMINI_CLI_TRUST_WORKSPACE": "true", **NO_PHONE_HOME}
    assert parsed(h.files(CTX)) == {"/polar/home/.gemini/settings.json": {
        "security": {"auth": {"selectedType": "gemini-api-key"}},
        "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True}}}
    assert h.log_paths(CTX) == ["/polar/home/.gemini/tmp"]
    assert h.provider_for(CTX) == "google" and h.side_models(CTX) == []


def test_opencode() -> None:
    h = adapter("opencode")
    assert h.command(CTX) == ["opencode", "run", "--model", "polar/policy", "Fix the failing test."]
    assert h.env(CTX) == {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
                          "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
                          **NO_PHONE_HOME}
    assert parsed(h.files(CTX)) == {"/polar/home/.config/opencode/opencode.json": {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"polar": {"npm": "@ai-sdk/openai-compatible", "name": "polar_gym",
                               "options": {"baseURL": f"{GW}/v1", "apiKey": "sess-1"},
                               "models": {"policy": {"name": "policy"}, "policy-side": {"name": "policy-side"}}}},
        "model": "polar/policy", "small_model": "polar/policy-side", "autoupdate": False, "share": "disabled",
        "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny", "external_directory": "allow"}}}
    assert h.log_paths(CTX) == ["/polar/home/.local/share/opencode"]
    assert h.provider_for(CTX) == "openai_chat" and h.side_models(CTX) == ["policy-side"]


@pytest.mark.parametrize(("api", "provider", "base_url"), [
    ("openai-completions", "openai_chat", f"{GW}/v1"),
    ("openai-responses", "openai_responses", f"{GW}/v1"),
    ("anthropic-messages", "anthropic", GW),
    ("google-generative-ai", "google", f"{GW}/v1beta"),
])
def test_pi_per_api(api: str, provider: str, base_url: str) -> None:
    h, ctx = adapter("pi"), with_config(api=api)
    assert h.command(ctx) == ["pi", "--no-session", "--offline", "-p", "--provider", "polar", "--model", "policy",
                              "Fix the failing test."]
    assert h.env(ctx) == {"PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1", "PI_TELEMETRY": "0", **NO_PHONE_HOME}
    assert parsed(h.files(ctx)) == {
        "/polar/home/.pi/agent/models.json": {"providers": {"polar": {
            "baseUrl": base_url, "api": api, "apiKey": "sess-1",
            "models": [{"id": "policy", "reasoning": True, "input": ["text", "image"]}]}}},
        "/polar/home/.pi/agent/settings.json": {"enableInstallTelemetry": False}}
    assert h.provider_for(ctx) == provider == API_PROVIDERS[api]
    assert h.log_paths(ctx) == [] and h.side_models(ctx) == [] and h.mcp_servers(ctx, MCP) == {}


def test_pi_defaults_to_openai_completions_and_rejects_unknown_apis() -> None:
    h = adapter("pi")
    assert h.provider_for(CTX) == "openai_chat" == h.provider
    assert '"api": "openai-completions"' in h.files(CTX)["/polar/home/.pi/agent/models.json"]
    with pytest.raises(ValueError, match="openai-chat"):
        h.files(with_config(api="openai-chat"))


# -- MCP servers and skills ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "path", "key", "entry"), [
    ("claude_code", "/polar/home/.claude.json", "mcpServers", {"type": "stdio", **SERVER}),
    ("gemini_cli", "/polar/home/.gemini/settings.json", "mcpServers", SERVER),
    ("qwen_code", "/polar/home/.qwen/settings.json", "mcpServers", SERVER),
    ("opencode", "/polar/home/.config/opencode/opencode.json", "mcp",
     {"type": "local", "command": ["npx", "-y", "@modelcontextprotocol/server-filesystem", "/polar/work"],
      "environment": {"LOG": "debug"}, "enabled": True}),
    ("codex", "/polar/home/.codex/config.toml", "mcp_servers", SERVER),
])
def test_mcp_servers_render_into_the_harness_settings(name: str, path: str, key: str, entry: dict[str, Any]) -> None:
    h = adapter(name)
    rendered = parsed(h.mcp_servers(CTX, MCP))
    assert list(rendered) == [path] and rendered[path][key] == {"files": entry}
    # the settings stay complete: the file replaces the one files() renders, and differs only by the servers
    base = parsed(h.files(CTX))[path]
    assert {k: v for k, v in rendered[path].items() if k != key} == base
    # the same servers given as AgentSpec.config come out of files() directly
    assert parsed(h.files(with_config(mcp_servers=MCP)))[path] == rendered[path]


def test_codex_mcp_table_quotes_odd_names_and_omits_empty_env() -> None:
    text = adapter("codex").mcp_servers(CTX, {"my server": {"command": "srv"}})["/polar/home/.codex/config.toml"]
    assert '[mcp_servers."my server"]' in text
    assert tomllib.loads(text)["mcp_servers"] == {"my server": {"command": "srv", "args": []}}


def test_bad_mcp_specs_fail_before_the_run() -> None:
    with pytest.raises(ValueError, match="needs a 'command'"):
        mcp_config({"x": {"args": ["a"]}})
    with pytest.raises(ValueError, match="unknown keys"):
        mcp_config({"x": {"command": "a", "cwd": "/"}})
    with pytest.raises(ValueError, match="must be a list"):
        mcp_config({"x": {"command": "a", "args": "-y srv"}})
    assert mcp_config({"x": McpServer("a")}) == {"x": McpServer("a")}


def test_skills_for_claude_code_and_codex() -> None:
    skills = {"pytest-fixer": "---\nname: pytest-fixer\ndescription: fix tests\n---\nRun pytest -x first.\n"}
    ctx = with_config(skills=skills)
    claude = adapter("claude_code").files(ctx)
    assert claude["/polar/home/.claude/skills/pytest-fixer/SKILL.md"] == skills["pytest-fixer"]
    assert "/polar/home/.claude.json" in claude
    codex = adapter("codex").files(ctx)
    assert codex["/polar/home/.codex/skills/pytest-fixer/SKILL.md"] == skills["pytest-fixer"]
    for bad in ["../escape", "a/b", ".hidden", ""]:
        with pytest.raises(ValueError, match="plain directory name"):
            adapter("claude_code").skills(CTX, {bad: "x"})
    assert adapter("gemini_cli").skills(CTX, skills) == {}


# -- side models ------------------------------------------------------------------------------------------------------

def test_side_model_defaults_to_a_suffix_and_can_be_named() -> None:
    assert side_model(CTX) == "policy-side"
    ctx = with_config(side_model="aux")
    assert adapter("claude_code").env(ctx)["ANTHROPIC_SMALL_FAST_MODEL"] == "aux"
    assert json.loads(adapter("opencode").files(ctx)["/polar/home/.config/opencode/opencode.json"])[
        "small_model"] == "polar/aux"
    with pytest.raises(ValueError, match="must differ"):
        side_model(with_config(side_model="policy"))


def test_no_adapter_lists_the_main_model_as_a_side_model() -> None:
    for name in FIRST:
        ctx = with_config(command="true", fast_model=True, side_models=["policy", "judge"])
        assert "policy" not in adapter(name).side_models(ctx)


# -- the shell harness ------------------------------------------------------------------------------------------------

def test_shell_string_command_gets_the_instruction_as_dollar_one_and_in_env() -> None:
    h = adapter("shell")
    ctx = with_config(command='python agent.py "$1"', files={"agent.py": "print(1)\n", "/polar/home/x": "y"},
                      env={"EXTRA": 1}, log_paths=["agent.log"], provider="anthropic", side_models=["judge"])
    assert h.command(ctx) == ["sh", "-c", 'python agent.py "$1"', "polar-shell", "Fix the failing test."]
    assert h.env(ctx) == {
        "POLAR_INSTRUCTION": "Fix the failing test.", "POLAR_MODEL": "policy", "POLAR_GATEWAY_URL": GW,
        "POLAR_API_KEY": "sess-1", "POLAR_SESSION_ID": "sess-1",
        "OPENAI_BASE_URL": f"{GW}/v1", "OPENAI_API_KEY": "sess-1", "ANTHROPIC_BASE_URL": GW,
        "ANTHROPIC_API_KEY": "sess-1", "GEMINI_API_KEY": "sess-1", "GOOGLE_GEMINI_BASE_URL": GW, "EXTRA": "1"}
    assert h.files(ctx) == {"/polar/work/agent.py": "print(1)\n", "/polar/home/x": "y"}
    assert h.log_paths(ctx) == ["/polar/work/agent.log"]
    assert h.provider_for(ctx) == "anthropic" and h.side_models(ctx) == ["judge"]


def test_shell_argv_command_runs_as_given_and_a_missing_command_fails() -> None:
    h = adapter("shell")
    assert h.command(with_config(command=["python", "-m", "my_agent"])) == ["python", "-m", "my_agent"]
    assert h.provider_for(CTX) == "openai_chat" and h.files(CTX) == {} and h.side_models(CTX) == []
    for bad in [None, "", "  ", [], ["ok", 3]]:
        with pytest.raises(ValueError, match="config\\['command'\\]"):
            h.command(with_config(command=bad))


def test_shell_command_really_runs_with_what_it_is_told(tmp_path: Path) -> None:
    """The rendered argv and env really run: a stand-in "agent" echoes what it was told."""
    h = adapter("shell")
    ctx = replace(with_config(command='printf "%s|%s|%s" "$1" "$POLAR_MODEL" "$OPENAI_BASE_URL"'),
                  workdir=str(tmp_path))
    out = subprocess.run(h.command(ctx), env={"PATH": os.environ["PATH"], **h.env(ctx)}, cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert out == f"Fix the failing test.|policy|{GW}/v1"


# -- purity -----------------------------------------------------------------------------------------------------------

@contextmanager
def no_io() -> Iterator[None]:
    """Make file, process, socket and environment access raise while adapters render."""
    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("an adapter did I/O")

    class Env(dict[str, str]):
        def __getitem__(self, key: str) -> str:
            raise AssertionError(f"an adapter read os.environ[{key!r}]")

        get = refuse  # type: ignore[assignment]

    patches = [(builtins, "open"), (io, "open"), (os, "open"), (os, "stat"), (os, "listdir"), (os, "scandir"),
               (os, "getcwd"), (subprocess, "Popen"), (socket, "socket"), (os, "environ"), (os, "getenv")]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr in patches]
    try:
        for obj, attr in patches:
            setattr(obj, attr, Env() if attr == "environ" else refuse)
        yield
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)


#: a config per harness added since the first six, using its own keys
LATER_CONFIGS: dict[str, dict[str, Any]] = {
    "mini_swe_agent": {"api": "anthropic", "step_limit": 3}, "aider": {"files": ["calc.py"], "side_model": "s"},
    "hermes": {"toolsets": ["terminal"], "max_turns": 3, "side_model": "s"},
    "openhands": {"api": "anthropic", "max_iterations": 3, "side_model": "s"},
    "cline": {"api": "anthropic"}, "openclaw": {"api": "openai-responses"},
    "crush": {"api": "anthropic", "side_model": "s", "cli_path": "/x/crush"},
}


def test_the_later_adapters_render_without_io_deterministically_and_keep_out_of_the_workdir() -> None:
    assert set(LATER_CONFIGS) == set(HARNESSES.names()) - set(FIRST)
    contexts = [(adapter(name), with_config(**config)) for name, config in LATER_CONFIGS.items()]

    def render() -> list[Any]:
        return [(h.command(ctx), h.env(ctx), h.files(ctx), h.log_paths(ctx), h.side_models(ctx), h.provider_for(ctx))
                for h, ctx in contexts]

    with no_io():
        rendered = render()
    assert rendered == render()
    for h, ctx in contexts:
        assert not any(path.startswith(ctx.workdir) for path in [*h.files(ctx), *h.log_paths(ctx)]), h.name


def test_adapters_do_no_io() -> None:
    instances = [adapter(name) for name in FIRST]  # imports happen here, outside the guard
    contexts = [with_config(mcp_servers=MCP, skills={"s": "x"}, command="true", api=api, fast_model=True)
                for api in API_PROVIDERS]
    with no_io():
        rendered = [(h.command(ctx), h.env(ctx), h.files(ctx), h.log_paths(ctx), h.mcp_servers(ctx, MCP),
                     h.skills(ctx, {"s": "x"}), h.side_models(ctx), h.provider_for(ctx))
                    for h in instances for ctx in contexts]
    # and rendering is deterministic: the same context gives the same text
    again = [(h.command(ctx), h.env(ctx), h.files(ctx), h.log_paths(ctx), h.mcp_servers(ctx, MCP),
              h.skills(ctx, {"s": "x"}), h.side_models(ctx), h.provider_for(ctx))
             for h in instances for ctx in contexts]
    assert rendered == again


# -- the recorder builds its runs from the adapters -------------------------------------------------------------------

def _recorder() -> Any:
    path = Path(__file__).resolve().parents[2] / "scripts" / "record_harness_traffic.py"
    spec = importlib.util.spec_from_file_location("record_harness_traffic", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("record_harness_traffic", module)
    spec.loader.exec_module(module)
    return module


def test_recorder_launches_come_from_the_adapters() -> None:
    rec = _recorder()
    for target in rec.TARGETS.values():
        launch = rec.launch_for(target, "/bin/cli", GW, "rec-x", "/tmp/h", "/tmp/w")
        h = adapter(target.harness)
        ctx = rec.context_for(target, "/bin/cli", GW, "rec-x", "/tmp/h", "/tmp/w")
        assert (launch.argv, launch.env, launch.files, launch.side_models) == (
            h.command(ctx), h.env(ctx), h.files(ctx), h.side_models(ctx))
        assert h.provider_for(ctx) == target.provider
        assert launch.argv[0] == "/bin/cli" and rec.INSTRUCTION in launch.argv
        assert all(path.startswith("/tmp/h/") for path in launch.files)


@pytest.mark.parametrize("name", sorted(HARNESSES.names()))
def test_the_api_key_is_the_session_secret_and_only_files_under_home_hold_it(name: str) -> None:
    """Fault 4: a harness is configured with its session's secret key, never with the session id, and a config file
    that holds the key lives under HOME (the session's own directory), not in the workdir or a shared place."""
    secret = "k" * 43
    ctx = replace(CTX, api_key=secret, config={"command": "true"} if name == "shell" else {})
    harness = adapter(name)
    files, env = harness.files(ctx), harness.env(ctx)
    holders = [path for path, text in files.items() if secret in text]
    assert all(path.startswith(ctx.home + "/") for path in holders), holders
    assert holders or secret in env.values()  # the key reaches the CLI one way or the other
    assert ctx.session_id not in {v for k, v in env.items() if "KEY" in k}
    assert not any(ctx.session_id in text for text in files.values() if "apiKey" in text or "api_key" in text)
    assert secret not in repr(ctx)
