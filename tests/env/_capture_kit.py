"""Sessions captured for real by the proxy (oracle engine, the real Qwen tokenizer, token-in) into an on-disk
journal, driven through the official SDKs the way harnesses drive them: a main agent with a sub-agent interleaved
and a client retry, and an Anthropic Messages tool loop. Plus running the Gym-side helper (``_gym_side``) in NeMo
Gym's interpreter."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.dirnames import dirname_for
from polar_gym.env.conformance import gym_pythonpath
from polar_gym.journal import read_session
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.schema import CompletionRecord, OracleScript
from tests._serving import RunningProxy, oracle_service, serve

__all__ = ["TOOLS", "anthropic_loop", "capture", "captured", "gym_side", "live_proxy", "main_sub_and_retry", "proxy"]

SCRIPT = OracleScript(commands=["ls", "cat calc.py", "python3 -m unittest"], final_answer="Finished.")
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


def live_proxy(capture: Path) -> Iterator[RunningProxy]:
    from polar_gym.proxy.tokenizer import HFChatTokenizer

    if not (tokenizer_dir() / ".complete").exists():
        pytest.fail("the Qwen tokenizer asset is missing: run `bash scripts/setup.sh`")
    engine = OracleEngine(HFChatTokenizer(tokenizer_dir()), default_script=SCRIPT)
    yield from serve(oracle_service(capture, engine=engine))


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The captures directory of a test module's live proxy."""
    return tmp_path_factory.mktemp("capture") / "capture"


@pytest.fixture(scope="module")
def proxy(capture: Path) -> Iterator[RunningProxy]:
    """A live proxy (oracle, real Qwen tokenizer) journaling to ``capture``, one per test module."""
    yield from live_proxy(capture)


def _reply(client: openai.OpenAI, conv: list[dict[str, Any]]) -> None:
    reply = client.chat.completions.create(model="policy", messages=conv, tools=TOOLS).choices[0].message
    conv.append(reply.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"}))
    for call in reply.tool_calls or []:
        conv.append({"role": "tool", "tool_call_id": call.id, "content": "ok"})


def main_sub_and_retry(proxy: RunningProxy, key: str) -> None:
    """Main agent turn 1, sub-agent turn 1, main turn 2 sent twice (the first answer never used: a client retry),
    sub turn 2, main turn 3, then the main agent's context compacted into a summary: seven calls, four chains (main,
    sub-agent, the retry's branch off main turn 1, the post-compaction context)."""
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)
    main = [{"role": "system", "content": "Main agent."}, {"role": "user", "content": "Fix calc.py."}]
    sub = [{"role": "system", "content": "Explore sub-agent."}, {"role": "user", "content": "Look around."}]
    _reply(client, main)
    _reply(client, sub)
    client.chat.completions.create(model="policy", messages=main, tools=TOOLS)  # the retried call's lost answer
    _reply(client, main)
    _reply(client, sub)
    _reply(client, main)
    _reply(client, [main[0], {"role": "user", "content": "Summary of the work so far: ran ls. Continue."}])


def anthropic_loop(proxy: RunningProxy, key: str) -> int:
    client = anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0)
    tools = [{"name": "Bash", "description": "Run a command", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix calc.py."}]
    for turn in range(10):
        message = client.messages.create(model="claude-sonnet-4-5", max_tokens=2000, system="Be careful.",
                                         messages=messages, tools=tools)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        uses = [b for b in message.content if b.type == "tool_use"]
        if not uses:
            return turn + 1
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": "ok"} for b in uses]})
    raise AssertionError("the oracle never finished")


def captured(capture: Path, key: str) -> list[CompletionRecord]:
    """The session's journal as the proxy wrote it to disk."""
    return read_session(capture / dirname_for(key))


def gym_side(gym_python: Path, root: Path, rollout_id: str, command: str = "freeze", *args: str) -> dict[str, Any]:
    """``tests.env._gym_side COMMAND`` in NeMo Gym's interpreter (``freeze``: what a NeMo RL consumer gets from the
    rollout; ``deliver``: what the agent puts)."""
    env = {**os.environ, "PYTHONPATH": gym_pythonpath()}
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run([str(gym_python), "-m", "tests.env._gym_side", command, str(root), rollout_id, *args],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
