"""Tool-call ids in token-in mode: the parser derives them from the sampled text, so an agent that runs the same
command twice in one conversation would get the same id twice; a harness then holds two tool uses with one id
(Claude Code interrupts the second: seen on vLLM CPU, where it broke the chain at every later call). Ids also depend
on the prompt, so they are unique within a conversation and still the same when a call is replayed."""

from __future__ import annotations

from typing import Any

import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.proxy.tokenizer import HFChatTokenizer
from tests.unit.test_token_in import CALL_TEXT, chat, proxy


@pytest.fixture(scope="module")
def qwen() -> HFChatTokenizer:
    if not (tokenizer_dir() / ".complete").exists():
        pytest.skip("the Qwen tokenizer is not built (bash scripts/setup.sh)")
    return HFChatTokenizer(tokenizer_dir())


async def test_the_same_call_sampled_twice_in_a_conversation_gets_two_ids(qwen: HFChatTokenizer) -> None:
    _, _, client = proxy(qwen, [CALL_TEXT, CALL_TEXT, CALL_TEXT])
    history: list[dict[str, Any]] = [{"role": "user", "content": "ls?"}]
    first = await chat(client, history)
    history += [{"role": "assistant", "content": None, "tool_calls": first["tool_calls"]},
                {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "a.txt"}]
    second = await chat(client, history)
    assert second["tool_calls"][0]["function"] == first["tool_calls"][0]["function"]
    assert second["tool_calls"][0]["id"] != first["tool_calls"][0]["id"]
    # a replay of the first call (same prompt, same sample) keeps its id
    replay = await chat(client, history[:1])
    assert replay["tool_calls"][0]["id"] == first["tool_calls"][0]["id"]
