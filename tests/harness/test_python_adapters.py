"""The mini-swe-agent and aider adapters: what they point at the gateway, the opt-outs every run needs, and argv
that keeps an instruction or a file named like an option what it is (checked against the real CLIs' parsers)."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from polar_gym.harness.base import HarnessContext
from polar_gym.harness.pyinstall import installed_cli
from polar_gym.registry import HARNESSES

CTX = HarnessContext(session_id="s", instruction="--help me fix calc.py", model_name="policy",
                     gateway_url="http://10.0.2.2:8080", workdir="/workspace", home="/polar/home", api_key="KEY")


def test_mini_swe_agent_points_litellm_at_the_gateway_with_every_opt_out() -> None:
    mini = HARNESSES.get("mini_swe_agent")()
    env = mini.env(CTX)
    assert env["OPENAI_API_BASE"] == "http://10.0.2.2:8080/v1" and env["OPENAI_API_KEY"] == "KEY"
    assert {env[k] for k in ("MSWEA_CONFIGURED", "MSWEA_COST_TRACKING", "LITELLM_LOCAL_MODEL_COST_MAP")} == {
        "true", "ignore_errors", "True"}
    argv = mini.command(CTX)
    assert argv[argv.index("-m") + 1] == "openai/policy" and "--task=--help me fix calc.py" in argv
    assert mini.log_paths(CTX) == ["/polar/home/mini.traj.json"]
    anthropic = replace(CTX, config={"api": "anthropic"})
    assert mini.provider_for(anthropic) == "anthropic"
    assert mini.env(anthropic)["ANTHROPIC_API_BASE"] == "http://10.0.2.2:8080"
    assert "--model-class" in mini.command(replace(CTX, config={"api": "openai-responses"}))
    with pytest.raises(ValueError, match="step_limit"):
        mini.command(replace(CTX, config={"step_limit": 0}))


def test_aider_answers_no_question_with_an_opt_in_and_keeps_its_logs_out_of_the_task() -> None:
    aider = HARNESSES.get("aider")()
    argv = aider.command(replace(CTX, config={"files": ["-x.py", "calc.py"]}))
    for flag in ("--no-git", "--no-analytics", "--no-check-update", "--no-show-release-notes", "--no-detect-urls",
                 "--disable-playwright"):
        assert flag in argv
    assert "--yes-always" not in argv  # it answers "no" to running the reply's shell blocks
    assert "--message=--help me fix calc.py" in argv and argv[-3:] == ["--", "-x.py", "calc.py"]
    assert all(a.startswith("/polar/home/") for a in (argv[argv.index(f) + 1] for f in (
        "--chat-history-file", "--input-history-file", "--llm-history-file")))
    models = json.loads(aider.files(CTX)["/polar/home/.aider.model.metadata.json"])
    assert set(models) == {"openai/policy", "openai/policy-side"}
    assert aider.side_models(CTX) == ["policy-side"]


class Refusing(BaseHTTPRequestHandler):
    """A gateway that refuses every key (401): a CLI gets its answer at once, with nothing to retry."""

    def do_POST(self) -> None:
        body = b'{"error": {"message": "invalid key", "type": "invalid_request_error"}}'
        self.send_response(401)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def refusing_gateway() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mini_swe_agent", "aider"])
def test_the_real_cli_reads_the_instruction_as_the_task_not_an_option(name: str, refusing_gateway: str,
                                                                      tmp_path: Path) -> None:
    """The pinned CLI's own parser, run up to its first model call: an instruction starting with '--' is not taken
    for an option; the call it then makes is refused (401)."""
    cli = installed_cli(name)
    if cli is None:
        pytest.fail(f"{name} is not installed: run `bash scripts/setup.sh`")
    harness = HARNESSES.get(name)()
    ctx = replace(CTX, gateway_url=refusing_gateway, cli_path=str(cli.binary), home=str(tmp_path))
    argv = harness.command(ctx)
    for path, text in harness.files(ctx).items():
        Path(path).write_text(text)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **harness.env(ctx)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env, stdin=subprocess.DEVNULL,
                          cwd=tmp_path)
    out = done.stdout + done.stderr
    assert "unrecognized arguments" not in out and "No such option" not in out and "expected one argument" not in out
    assert "invalid key" in out or "AuthenticationError" in out, out[-2000:]
