"""The conversation count the real-harness tests compare chains against, on hand-written call sequences: it reads
request messages only (no tokens, no builder), so a builder bug cannot hide in it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tests.engine._engine_kit import count_conversations

SYSTEM = {"role": "system", "content": "You are an agent."}


def call(messages: list[dict[str, Any]], reply: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(normalized_request={"messages": messages}, response={"message": reply})


def shell(command: str, call_id: str = "c1", spacing: str = ": ") -> dict[str, Any]:
    return {"role": "assistant", "content": "", "reasoning_content": "let me look",
            "tool_calls": [{"id": call_id, "type": "function",
                            "function": {"name": "bash", "arguments": f'{{"command"{spacing}"{command}"}}'}}]}


def test_a_tool_loop_with_reasoning_dropped_and_ids_renamed_is_one_conversation() -> None:
    first = [SYSTEM, {"role": "user", "content": "fix it"}]
    # the harness sends the call back without reasoning, with its own ID and compact JSON
    echoed = {**shell("ls", "toolu_9", ":"), "reasoning_content": None}
    second = [*first, echoed, {"role": "tool", "tool_call_id": "toolu_9", "content": "a.txt"}]
    third = [*second, {"role": "assistant", "content": "  done \n"}, {"role": "user", "content": "go on"}]
    calls = [call(first, shell("ls")), call(second, {"role": "assistant", "content": "done"}),
             call(third, {"role": "assistant", "content": "ok"})]
    count = count_conversations(calls)
    assert (count.conversations, count.roots, count.edited) == (1, 1, 0)


def test_retries_side_requests_branches_forks_and_edits_are_counted_apart() -> None:
    first = [SYSTEM, {"role": "user", "content": "fix it"}]
    after = [*first, {"role": "assistant", "content": "A"}, {"role": "user", "content": "next"}]
    calls = [
        call(first, {"role": "assistant", "content": "A"}),
        call(first, {"role": "assistant", "content": "B"}),            # a retry: same turn
        call([{"role": "user", "content": "title?"}], {"role": "assistant", "content": "T"}),  # side request
        call(after, {"role": "assistant", "content": "C"}),            # goes on from attempt A
        call([*first, {"role": "assistant", "content": "B"}, {"role": "user", "content": "x"}],
             {"role": "assistant", "content": "D"}),                   # goes on from attempt B too: a fork
        call([*first, {"role": "assistant", "content": "A"}, {"role": "user", "content": "other"}],
             {"role": "assistant", "content": "E"}),                   # a second turn from reply A: a branch
        call([*first, {"role": "assistant", "content": "edited"}, {"role": "user", "content": "next"}],
             {"role": "assistant", "content": "F"}),                   # history edited: a new conversation
    ]
    count = count_conversations(calls)
    assert (count.roots, count.edited, count.branches, count.forks) == (3, 1, 1, 1)
    assert count.conversations == 5
    assert [c.response["message"]["content"] for c in count.branch_calls] == ["E"]
