"""The Python harnesses' adapters (hermes, OpenHands) as pure renderers: golden config files, environment and argv,
the config keys each takes and what a bad config is refused with; hermes's exit-code wrapper and OpenHands' runner
script are run for real with stand-ins (the pinned installs run in tests/e2e/test_more_harnesses_e2e.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.harness.config import HermesConfig, OpenHandsConfig
from polar_gym.harness.hermes import AUX_TASKS
from polar_gym.harness.openhands import RUNNER
from polar_gym.harness.pyinstall import PY_PINS
from polar_gym.registry import HARNESSES

CTX = HarnessContext(session_id="sess-1", instruction="Fix the failing test.", model_name="policy",
                     gateway_url="http://127.0.0.1:18080", workdir="/polar/work", home="/polar/home")
GW = "http://127.0.0.1:18080"
NO_PHONE_HOME = {"DO_NOT_TRACK": "1", "NO_UPDATE_NOTIFIER": "1"}
HERMES_YAML = "/polar/home/.hermes/config.yaml"
USAGE = "/polar/home/hermes-usage.json"


def adapter(name: str) -> Harness:
    return HARNESSES.get(name)()


def with_config(**config: Any) -> HarnessContext:
    return replace(CTX, config=config)


def test_both_resolve_by_name_with_their_python_pins_and_config_models() -> None:
    for name, config_model in (("hermes", HermesConfig), ("openhands", OpenHandsConfig)):
        cls = HARNESSES.get(name)
        assert issubclass(cls, Harness) and cls.name == name == cls.pin and cls.pin in PY_PINS
        assert cls.config_model is config_model


# -- hermes -----------------------------------------------------------------------------------------------------------

def test_hermes() -> None:
    h = adapter("hermes")
    command = h.command(CTX)
    assert command[:3] == ["sh", "-c", command[2]] and "failed" in command[2]
    assert command[3:] == ["hermes", USAGE, "hermes", "--oneshot=Fix the failing test.", "-t", "terminal,file",
                           "--usage-file", USAGE]
    assert h.env(CTX) == {"HERMES_HOME": "/polar/home/.hermes", **NO_PHONE_HOME}
    files = h.files(CTX)
    assert list(files) == [HERMES_YAML]
    assert yaml.safe_load(files[HERMES_YAML]) == json.loads(files[HERMES_YAML]) == {
        "model": {"provider": "custom", "base_url": f"{GW}/v1", "api_key": "sess-1", "default": "policy",
                  "context_length": 131072},
        "auxiliary": {task: {"model": "policy-side"} for task in AUX_TASKS},
        "agent": {"max_turns": 90, "api_max_retries": 2},
        "terminal": {"backend": "local", "cwd": ".", "home_mode": "real"},
        "approvals": {"mode": "off"}, "security": {"tirith_enabled": False}, "model_catalog": {"enabled": False}}
    assert h.log_paths(CTX) == ["/polar/home/.hermes/state.db", "/polar/home/.hermes/logs", USAGE]
    assert h.provider_for(CTX) == "openai_chat" and h.side_models(CTX) == ["policy-side"]


def test_hermes_options_and_the_session_key() -> None:
    h = adapter("hermes")
    ctx = replace(with_config(toolsets=["terminal", "file", "todo"], max_turns=7, side_model="judge"),
                  api_key="secret-key", cli_path="/opt/hermes/bin/hermes")
    config = yaml.safe_load(h.files(ctx)[HERMES_YAML])
    assert config["model"]["api_key"] == "secret-key" and config["agent"]["max_turns"] == 7
    assert {task["model"] for task in config["auxiliary"].values()} == {"judge"} and h.side_models(ctx) == ["judge"]
    assert h.command(ctx)[5:] == ["/opt/hermes/bin/hermes", "--oneshot=Fix the failing test.", "-t",
                                  "terminal,file,todo", "--usage-file", USAGE]


def test_an_instruction_that_looks_like_an_option_stays_the_prompt() -> None:
    command = adapter("hermes").command(replace(CTX, instruction="--help me fix it"))
    assert "--oneshot=--help me fix it" in command


@pytest.mark.parametrize(("config", "error"), [
    ({"toolsets": []}, "at least 1 item"),
    ({"toolsets": ["terminal,web"]}, "should match pattern"),
    ({"max_turns": 0}, "greater than or equal to 1"),
    ({"tools": ["terminal"]}, "Extra inputs are not permitted"),
])
def test_hermes_refuses_a_bad_config(config: dict[str, Any], error: str) -> None:
    h = adapter("hermes")
    with pytest.raises(pydantic.ValidationError, match=error):
        h.validate_config(config)
    with pytest.raises(pydantic.ValidationError, match=error):
        h.files(with_config(**config))


def test_hermes_refuses_a_side_model_named_like_the_session_model() -> None:
    with pytest.raises(ValueError, match="side_model must differ"):
        adapter("hermes").files(with_config(side_model="policy"))


def _fake_hermes(tmp_path: Path, exit_code: int, failed: bool | None) -> Path:
    """A stand-in for hermes: writes the usage report as hermes does (or none), prints its argv, exits."""
    report = "" if failed is None else json.dumps({"completed": not failed, "failed": failed}, indent=2)
    script = tmp_path / "hermes"
    script.write_text("#!/bin/sh\n"
                      'for a; do case "$a" in --usage-file) next=1;; *) [ -n "$next" ] && usage="$a"; next=;; esac; '
                      "done\n"
                      f"[ -z '{report}' ] || printf '%s\\n' '{report}' > \"$usage\"\n"
                      'echo "ran $*"\n'
                      f"exit {exit_code}\n")
    script.chmod(0o755)
    return script


@pytest.mark.parametrize(("exit_code", "failed", "expected"), [
    (0, False, 0),  # a run that completed
    (0, True, 1),  # the model API failed: hermes exits 0, its report says failed
    (2, True, 2),  # hermes's own failure codes pass through
    (1, None, 1),
    (0, None, 0),  # no report (an older hermes): the exit code stands
])
def test_hermes_exit_code_follows_its_usage_report(tmp_path: Path, exit_code: int, failed: bool | None,
                                                   expected: int) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "hermes-usage.json").write_text('{"failed": true}\n')  # a stale report is never read
    ctx = replace(CTX, home=str(home), cli_path=str(_fake_hermes(tmp_path, exit_code, failed)))
    result = subprocess.run(adapter("hermes").command(ctx), capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == expected, result.stderr
    assert result.stdout.startswith("ran --oneshot=Fix the failing test. -t terminal,file --usage-file")
    assert ("usage report says the run failed" in result.stderr) == (exit_code == 0 and failed is True)


# -- OpenHands ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("api", "provider", "model", "base_url", "api_mode"), [
    ("openai-chat", "openai_chat", "openai/policy", f"{GW}/v1", "chat"),
    ("openai-responses", "openai_responses", "openai/policy", f"{GW}/v1", "responses"),
    ("anthropic", "anthropic", "anthropic/policy", GW, "chat"),
])
def test_openhands_per_api(api: str, provider: str, model: str, base_url: str, api_mode: str) -> None:
    h, ctx = adapter("openhands"), with_config(api=api)
    assert h.command(ctx) == ["openhands-python", "/polar/home/openhands_runner.py", "Fix the failing test."]
    assert h.env(ctx) == {
        "POLAR_OH_MODEL": model, "POLAR_OH_SIDE_MODEL": f"{model}-side", "POLAR_OH_BASE_URL": base_url,
        "POLAR_OH_API_KEY": "sess-1", "POLAR_OH_API_MODE": api_mode, "POLAR_OH_MAX_ITERATIONS": "100",
        "POLAR_OH_CONVERSATIONS": "/polar/home/openhands-conversations", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "OPENHANDS_SUPPRESS_BANNER": "1", **NO_PHONE_HOME}
    assert h.files(ctx) == {"/polar/home/openhands_runner.py": RUNNER}
    assert h.log_paths(ctx) == ["/polar/home/openhands-conversations"]
    assert h.provider_for(ctx) == provider and h.side_models(ctx) == ["policy-side"]


def test_openhands_defaults_to_chat_completions_and_takes_the_key_and_binary() -> None:
    h = adapter("openhands")
    ctx = replace(with_config(max_iterations=12), api_key="secret-key", cli_path="/opt/oh/venv/bin/python")
    assert h.provider_for(CTX) == h.provider == "openai_chat"
    env = h.env(ctx)
    assert env["POLAR_OH_API_KEY"] == "secret-key" and env["POLAR_OH_MAX_ITERATIONS"] == "12"
    assert h.command(ctx)[0] == "/opt/oh/venv/bin/python"
    assert "secret-key" not in json.dumps([h.command(ctx), h.files(ctx)])  # the key travels in the environment only


@pytest.mark.parametrize(("config", "error"), [
    ({"api": "openai-completions"}, "openai-chat"),
    ({"max_iterations": 0}, "greater than or equal to 1"),
    ({"max_iteration_per_run": 5}, "Extra inputs are not permitted"),
])
def test_openhands_refuses_a_bad_config(config: dict[str, Any], error: str) -> None:
    h = adapter("openhands")
    with pytest.raises(pydantic.ValidationError, match=error):
        h.validate_config(config)
    with pytest.raises(pydantic.ValidationError, match=error):
        h.env(with_config(**config))


def test_the_runner_is_the_shipped_script_and_reads_what_the_adapter_sets() -> None:
    shipped = Path(__file__).resolve().parents[2] / "polar_gym" / "harness" / "openhands_runner.py"
    assert RUNNER == shipped.read_text()
    compile(RUNNER, "openhands_runner.py", "exec")
    told = {name for name in adapter("openhands").env(CTX) if name.startswith("POLAR_OH_")}
    assert set(re.findall(r"POLAR_OH_[A-Z_]+", RUNNER)) == told


def test_the_runner_builds_the_agent_from_the_environment(tmp_path: Path) -> None:
    """The runner against a stand-in SDK: the LLMs, tools and conversation get what the environment says, and the
    exit code follows the conversation's end state."""
    sdk = tmp_path / "sdk"
    for module, text in _STAND_IN_SDK.items():
        path = sdk / module
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    runner = tmp_path / "openhands_runner.py"
    runner.write_text(RUNNER)
    env = {**os.environ, **adapter("openhands").env(replace(CTX, home=str(tmp_path))), "PYTHONPATH": str(sdk)}
    for status, code in (("finished", 0), ("stuck", 1)):
        result = subprocess.run([sys.executable, str(runner), "Fix it."], cwd=tmp_path, capture_output=True, text=True,
                                env={**env, "STAND_IN_STATUS": status}, timeout=60, check=False)
        assert result.returncode == code, result.stderr
        seen = json.loads(result.stdout)
        assert seen["llm"] == {"model": "openai/policy", "base_url": f"{GW}/v1", "api_key": "sess-1",
                               "api_mode": "chat", "usage_id": "agent", "num_retries": 2, "retry_min_wait": 1,
                               "retry_max_wait": 4}
        assert seen["condenser_llm"] == {**seen["llm"], "model": "openai/policy-side", "usage_id": "condenser"}
        assert seen["tools"] == [["terminal", {"terminal_type": "subprocess"}], ["file_editor", None],
                                 ["task_tracker", None]]
        assert seen["conversation"] == {"workspace": str(tmp_path), "visualizer": None, "max_iteration_per_run": 100,
                                        "persistence_dir": f"{tmp_path}/openhands-conversations"}
        assert seen["sent"] == "Fix it." and seen["closed"] is True
        assert f"the conversation ended {status}" in result.stderr


_STAND_IN_SDK = {
    "openhands/__init__.py": "",
    "openhands/sdk/__init__.py": '''
import atexit, json
SEEN = {}
atexit.register(lambda: print(json.dumps(SEEN)))
class LLM:
    def __init__(self, **kw): self.kw = kw; SEEN.setdefault("llm", kw)
    def model_copy(self, update): return LLM(**{**self.kw, **update})
class Tool:
    def __init__(self, name, params=None): self.spec = [name, params]
class Agent:
    def __init__(self, llm, tools, system_prompt_kwargs, condenser):
        SEEN["tools"] = [t.spec for t in tools]; SEEN["condenser_llm"] = condenser.kw
        assert system_prompt_kwargs == {"cli_mode": True}
class _State:
    def __init__(self):
        import os
        from openhands.sdk.conversation.state import ConversationExecutionStatus
        self.execution_status = ConversationExecutionStatus(os.environ["STAND_IN_STATUS"])
class Conversation:
    def __init__(self, agent, **kw): SEEN["conversation"] = kw
    def send_message(self, text): SEEN["sent"] = text
    def run(self): self.state = _State()
    def close(self): SEEN["closed"] = True
''',
    "openhands/sdk/context/__init__.py": "",
    "openhands/sdk/context/condenser/__init__.py": "def default_condenser(llm):\n    return llm\n",
    "openhands/sdk/conversation/__init__.py": "",
    "openhands/sdk/conversation/state.py": ("import enum\nclass ConversationExecutionStatus(str, enum.Enum):\n"
                                            "    FINISHED = 'finished'\n    STUCK = 'stuck'\n"),
    "openhands/tools/__init__.py": "",
    "openhands/tools/file_editor/__init__.py": "class FileEditorTool:\n    name = 'file_editor'\n",
    "openhands/tools/task_tracker/__init__.py": "class TaskTrackerTool:\n    name = 'task_tracker'\n",
    "openhands/tools/terminal/__init__.py": "class TerminalTool:\n    name = 'terminal'\n",
}
