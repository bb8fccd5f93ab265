"""The cline, OpenClaw and Crush adapters as pure renderers: golden config files, environment and argv per protocol,
the config keys each takes and what a bad config is refused with, the session key only in files under HOME, and no
I/O while rendering. The pinned cline and openclaw run in tests/e2e/test_more_harnesses_e2e.py and in their docs
pages' snippets; Crush, which no package registry here can install, is never run."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pydantic
import pytest

from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.harness.config import ClineConfig, CrushConfig, OpenClawConfig
from polar_gym.harness.install import PINS
from polar_gym.registry import HARNESSES

CTX = HarnessContext(session_id="sess-1", instruction="Fix the failing test.", model_name="policy",
                     gateway_url="http://127.0.0.1:18080", workdir="/polar/work", home="/polar/home")
GW = "http://127.0.0.1:18080"
NO_PHONE_HOME = {"DO_NOT_TRACK": "1", "NO_UPDATE_NOTIFIER": "1"}
CLINE_DATA = "/polar/home/.cline/data"
OPENCLAW_JSON = "/polar/home/.openclaw/openclaw.json"
CRUSH_JSON = "/polar/home/.config/crush/crush.json"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "harnesses"


def adapter(name: str) -> Harness:
    cls: type[Harness] = HARNESSES.get(name)
    return cls()


def with_config(**config: Any) -> HarnessContext:
    return replace(CTX, config=config)


def test_all_three_resolve_by_name_with_their_pins_and_config_models() -> None:
    for name, pin, config_model in (("cline", "cline", ClineConfig), ("openclaw", "openclaw", OpenClawConfig),
                                    ("crush", None, CrushConfig)):
        cls = HARNESSES.get(name)
        assert issubclass(cls, Harness) and cls.name == name and cls.pin == pin
        assert cls.config_model is config_model
    assert (PINS["cline"].package, PINS["cline"].version, PINS["cline"].binary) == ("cline", "3.0.65", "cline")
    assert (PINS["openclaw"].version, PINS["openclaw"].node_major) == ("2026.9.6", 24)
    assert "crush" not in PINS  # its npm package downloads the binary from GitHub at install time


# -- cline ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("api", "provider"), [("openai-compatible", "openai_chat"),
                                               ("openai-native", "openai_responses"), ("anthropic", "anthropic")])
def test_cline_per_api(api: str, provider: str) -> None:
    h, ctx = adapter("cline"), with_config(api=api)
    assert h.command(ctx) == ["cline", "--data-dir", CLINE_DATA, "--json", "-P", api, "-m", "policy", "--",
                              "Fix the failing test."]
    assert "--yolo" not in h.command(ctx)  # it refuses every text-only turn: see the module docstring
    files = {path: json.loads(text) for path, text in h.files(ctx).items()}
    assert files == {
        f"{CLINE_DATA}/settings/providers.json": {
            "version": 1, "lastUsedProvider": api, "modes": {},
            "providers": {api: {"settings": {"provider": api, "apiKey": "sess-1", "model": "policy",
                                             "baseUrl": f"{GW}/v1"},
                                "updatedAt": "2026-01-01T00:00:00.000Z", "tokenSource": "manual"}}},
        f"{CLINE_DATA}/settings/global-settings.json": {"telemetryOptOut": True, "autoUpdateEnabled": False}}
    assert h.env(ctx) == {"CLINE_NO_AUTO_UPDATE": "1", **NO_PHONE_HOME}
    assert h.log_paths(ctx) == [f"{CLINE_DATA}/sessions", f"{CLINE_DATA}/logs"]
    assert h.provider_for(ctx) == provider and h.side_models(ctx) == []


def test_cline_defaults_to_chat_completions_and_takes_the_key_and_binary() -> None:
    h = adapter("cline")
    assert h.provider_for(CTX) == h.provider == "openai_chat"
    ctx = replace(CTX, api_key="secret-key", cli_path="/opt/npm/node_modules/.bin/cline")
    settings = json.loads(h.files(ctx)[f"{CLINE_DATA}/settings/providers.json"])
    assert settings["providers"]["openai-compatible"]["settings"]["apiKey"] == "secret-key"
    assert h.command(ctx)[0] == "/opt/npm/node_modules/.bin/cline"
    assert "secret-key" not in json.dumps([h.command(ctx), h.env(ctx)])


# -- OpenClaw ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("api", "provider", "base_url"), [("openai-completions", "openai_chat", f"{GW}/v1"),
                                                           ("openai-responses", "openai_responses", f"{GW}/v1"),
                                                           ("anthropic-messages", "anthropic", GW)])
def test_openclaw_per_api(api: str, provider: str, base_url: str) -> None:
    h, ctx = adapter("openclaw"), with_config(api=api)
    assert h.command(ctx) == ["openclaw", "agent", "exec", "--json", "--model", "polar/policy",
                              "--state-dir", "/polar/home/.openclaw", "--timeout", "0", "--", "Fix the failing test."]
    files = {path: json.loads(text) for path, text in h.files(ctx).items()}
    assert files == {OPENCLAW_JSON: {
        "update": {"checkOnStart": False}, "telemetry": {"enabled": False},
        "models": {"mode": "replace", "providers": {"polar": {
            "baseUrl": base_url, "apiKey": "sess-1", "api": api,
            "models": [{"id": "policy", "name": "policy", "reasoning": True, "input": ["text"],
                        "contextWindow": 131072, "maxTokens": 32768}]}}},
        "agents": {"defaults": {"model": {"primary": "polar/policy"}}}}}
    assert h.env(ctx) == {"OPENCLAW_NO_AUTO_UPDATE": "1", "OPENCLAW_OFFLINE": "1", "OPENCLAW_BASH_YIELD_MS": "120000",
                          **NO_PHONE_HOME}
    assert h.log_paths(ctx) == ["/polar/home/.openclaw/agents", "/tmp/openclaw"]
    assert h.provider_for(ctx) == provider and h.side_models(ctx) == []


def test_openclaw_keeps_its_state_where_its_config_is() -> None:
    """--state-dir must exist before the run, and the gateway creates it by writing the config file into it; the
    config holding the key is not among the artifacts."""
    h = adapter("openclaw")
    state_dir = h.command(CTX)[h.command(CTX).index("--state-dir") + 1]
    assert [str(Path(path).parent) for path in h.files(CTX)] == [state_dir]
    assert not any(OPENCLAW_JSON.startswith(path) for path in h.log_paths(CTX))


def test_openclaw_takes_the_key_and_binary() -> None:
    h = adapter("openclaw")
    ctx = replace(with_config(api="anthropic-messages"), api_key="secret-key", cli_path="/opt/npm/bin/openclaw")
    config = json.loads(h.files(ctx)[OPENCLAW_JSON])
    assert config["models"]["providers"]["polar"]["apiKey"] == "secret-key"
    assert h.command(ctx)[0] == "/opt/npm/bin/openclaw"
    assert "secret-key" not in json.dumps([h.command(ctx), h.env(ctx)])


# -- Crush ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("api", "provider"), [("openai-compat", "openai_chat"), ("anthropic", "anthropic")])
def test_crush_per_api(api: str, provider: str) -> None:
    h, ctx = adapter("crush"), with_config(api=api)
    assert h.command(ctx) == ["crush", "run", "--data-dir", "/polar/home/.crush", "-q", "-m", "polar/policy",
                              "--small-model", "polar/policy-side", "--", "Fix the failing test."]
    models = [{"id": m, "name": m, "context_window": 131072, "default_max_tokens": 32768}
              for m in ("policy", "policy-side")]
    assert {path: json.loads(text) for path, text in h.files(ctx).items()} == {CRUSH_JSON: {
        "$schema": "https://charm.land/crush.json",
        "providers": {"polar": {"type": api, "base_url": f"{GW}/v1", "api_key": "sess-1", "models": models}},
        "models": {"large": {"provider": "polar", "model": "policy"},
                   "small": {"provider": "polar", "model": "policy-side"}},
        "options": {"disable_provider_auto_update": True, "disable_metrics": True,
                    "disable_default_providers": True}}}
    assert h.env(ctx) == {"CRUSH_GLOBAL_CONFIG": "/polar/home/.config/crush",
                          "CRUSH_GLOBAL_DATA": "/polar/home/.local/share/crush", "CRUSH_DISABLE_METRICS": "1",
                          "CRUSH_DISABLE_PROVIDER_AUTO_UPDATE": "1", "CRUSH_DISABLE_DEFAULT_PROVIDERS": "1",
                          **NO_PHONE_HOME}
    assert h.log_paths(ctx) == ["/polar/home/.crush"]
    assert h.provider_for(ctx) == provider and h.side_models(ctx) == ["policy-side"]


def test_crush_runs_the_given_binary_and_side_model() -> None:
    h = adapter("crush")
    ctx = replace(with_config(cli_path="/opt/crush/crush", side_model="titles"), api_key="secret-key")
    command = h.command(ctx)
    assert command[0] == "/opt/crush/crush" and command[command.index("--small-model") + 1] == "polar/titles"
    config = json.loads(h.files(ctx)[CRUSH_JSON])
    assert config["providers"]["polar"]["api_key"] == "secret-key" and config["models"]["small"]["model"] == "titles"
    assert h.side_models(ctx) == ["titles"]
    with pytest.raises(ValueError, match="side_model must differ"):
        h.files(with_config(side_model="policy"))


def test_the_crush_page_says_why_it_is_not_installed_and_has_no_snippet_to_run() -> None:
    page = (DOCS / "crush.md").read_text()
    assert "run: harness=" not in page
    assert "github.com" in page and "+harness.config.cli_path=" in page


# -- all three --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "config", "error"), [
    ("cline", {"api": "openai-chat"}, "openai-compatible"),
    ("cline", {"yolo": True}, "Extra inputs are not permitted"),
    ("cline", {"side_model": "x"}, "Extra inputs are not permitted"),
    ("openclaw", {"api": "google-generative-ai"}, "openai-completions"),
    ("openclaw", {"timeout": 5}, "Extra inputs are not permitted"),
    ("crush", {"api": "openai"}, "openai-compat"),
    ("crush", {"yolo": True}, "Extra inputs are not permitted"),
])
def test_a_bad_config_is_refused(name: str, config: dict[str, Any], error: str) -> None:
    h = adapter(name)
    with pytest.raises(pydantic.ValidationError, match=error):
        h.validate_config(config)
    with pytest.raises(pydantic.ValidationError, match=error):
        h.files(with_config(**config))


@pytest.mark.parametrize("name", ["cline", "openclaw", "crush"])
def test_an_instruction_that_looks_like_an_option_stays_the_prompt(name: str) -> None:
    command = adapter(name).command(replace(CTX, instruction="--help me fix it"))
    assert command[-2:] == ["--", "--help me fix it"]


@pytest.mark.parametrize("name", ["cline", "openclaw", "crush"])
def test_the_key_is_only_in_files_under_home(name: str) -> None:
    secret = "k" * 43
    h, ctx = adapter(name), replace(CTX, api_key=secret)
    holders = [path for path, text in h.files(ctx).items() if secret in text]
    assert holders and all(path.startswith(ctx.home + "/") for path in holders)
    assert secret not in json.dumps([h.command(ctx), h.env(ctx), h.log_paths(ctx)])
    assert not any(path.startswith(ctx.workdir) for path in [*h.files(ctx), *h.log_paths(ctx)])
