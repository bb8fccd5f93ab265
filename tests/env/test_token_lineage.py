"""Token lineage of captured calls (polar_gym.env.token_lineage, pure: no NeMo Gym): numbered cases on semantic
token ids, then sessions the real proxy captured (oracle engine, real Qwen tokenizer, official SDKs)."""

from __future__ import annotations

import json
from pathlib import Path

from polar_gym.env.token_lineage import (
    CallTokens,
    calls_from_nemo_payload,
    calls_from_records,
    has_model_history,
    link_calls,
)
from polar_gym.merge.nemo_payload import session_nemo_payload
from polar_gym.schema import CompletionRecord
from tests._serving import RunningProxy
from tests.env._capture_kit import anthropic_loop, captured, main_sub_and_retry
from tests.env._env_kit import two_chain_result

SYSTEM, USER, TOOL = [1, 2], [3], [7]


def call(name: str, prompt: list[int], generation: list[int], history: bool = False) -> CallTokens:
    items = [{"role": "assistant", "content": "x"}] if history else []
    return CallTokens(name, prompt, generation, [-0.5] * len(generation), request_items=items)


def shape(calls: list[CallTokens]) -> list[tuple[str, str | None, str, int, int | None]]:
    return [(k.call_id, k.parent_call_id, k.resolution, k.chain, k.parent_chain) for k in link_calls(calls)]


def test_01_a_tool_loop_is_one_chain_of_resolved_links() -> None:
    a = call("a", SYSTEM + USER, [10, 11])
    b = call("b", SYSTEM + USER + [10, 11] + TOOL, [12], history=True)
    c = call("c", SYSTEM + USER + [10, 11] + TOOL + [12] + TOOL, [13], history=True)
    assert shape([a, b, c]) == [("a", None, "root", 0, None), ("b", "a", "resolved", 0, None),
                                ("c", "b", "resolved", 0, None)]


def test_02_an_interleaved_sub_agent_is_a_root_of_its_own_chain() -> None:
    a = call("a", SYSTEM + USER, [10])
    s = call("s", [1, 9] + USER, [50])
    b = call("b", SYSTEM + USER + [10] + TOOL, [11], history=True)
    t = call("t", [1, 9] + USER + [50] + TOOL, [51], history=True)
    assert shape([a, s, b, t]) == [("a", None, "root", 0, None), ("s", None, "root", 1, None),
                                   ("b", "a", "resolved", 0, None), ("t", "s", "resolved", 1, None)]


def test_03_a_retry_keeps_the_conversation_that_went_on_and_branches_the_lost_answer() -> None:
    a = call("a", SYSTEM + USER, [10])
    lost = call("lost", SYSTEM + USER + [10] + TOOL, [11], history=True)
    retry = call("retry", SYSTEM + USER + [10] + TOOL, [12], history=True)
    d = call("d", SYSTEM + USER + [10] + TOOL + [12] + TOOL, [13], history=True)
    assert shape([a, lost, retry, d]) == [("a", None, "root", 0, None), ("lost", "a", "resolved", 1, 0),
                                          ("retry", "a", "resolved", 0, None), ("d", "retry", "resolved", 0, None)]


def test_04_a_compacted_context_with_model_history_is_an_unresolved_boundary_not_a_root() -> None:
    a = call("a", SYSTEM + USER, [10])
    summary = call("summary", SYSTEM + [8, 8], [20], history=True)  # a summary replaced the old turns
    assert shape([a, summary]) == [("a", None, "root", 0, None), ("summary", None, "unresolved", 1, None)]


def test_05_the_longest_whole_sequence_wins_and_a_partial_overlap_is_no_parent() -> None:
    a = call("a", [1], [2])
    b = call("b", [1, 2, 3], [4], history=True)
    near = call("near", [1, 2, 3, 5], [6], history=True)  # shares tokens with b's prompt, not b's whole sequence
    c = call("c", [1, 2, 3, 4, 5], [6], history=True)
    assert [x[1] for x in shape([a, b, near, c])] == [None, "a", "a", "b"]


def test_model_history_is_read_in_every_dialect() -> None:
    assert has_model_history([{"role": "model", "parts": []}])  # Google
    assert has_model_history([{"type": "function_call", "name": "x"}])  # Responses
    assert not has_model_history([{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}])


def test_records_that_cannot_train_are_holes_and_failed_calls_are_left_out() -> None:
    base = {"session_id": "s", "provider": "openai_chat", "engine": "oracle", "prompt_ids": [1], "response_ids": [2]}
    records = [CompletionRecord(completion_id="ok", index=0, response_logprobs=[-0.1], **base),
               CompletionRecord(completion_id="plain", index=1, token_faithful=False, **base),
               CompletionRecord(completion_id="nolp", index=2, **base),
               CompletionRecord(completion_id="err", index=3, status="error", **base)]
    calls, holes = calls_from_records(records)
    assert [c.call_id for c in calls] == ["ok"] and holes == ["plain", "nolp"]
    assert calls[0].extras == {"polar_session_id": "s", "polar_index": 0}


def test_the_nemo_payload_gives_every_chains_calls_once_parents_first() -> None:
    payload = json.loads(json.dumps(session_nemo_payload(two_chain_result())))
    calls = calls_from_nemo_payload(payload)
    assert [len(c.prompt) for c in calls] == sorted(len(c.prompt) for c in calls)
    # the fixture's two traces reuse span ids: two different calls under one id stay apart
    assert sorted(c.call_id for c in calls) == ["c0", "c0@1", "c2"]
    links = {k.call_id: k for k in link_calls(calls)}
    assert links["c2"].parent_call_id == "c0" and links["c0@1"].parent_call_id is None
    assert {links["c0"].chain, links["c0@1"].chain} == {0, 1}
    assert calls[0].response["message"]["role"] == "assistant"


def test_a_real_session_with_a_sub_agent_and_a_retry_links_like_the_engine_saw_it(proxy: RunningProxy,
                                                                                capture: Path) -> None:
    main_sub_and_retry(proxy, "main-sub-retry")
    records = captured(capture, "main-sub-retry")
    calls, holes = calls_from_records(records)
    assert holes == [] and len(calls) == len(records) == 7
    links = link_calls(calls)
    by_id = {r.completion_id: r for r in records}
    for link in links:  # every parent link is exact: the child's prompt starts with the parent's whole sequence
        if link.parent_call_id is not None:
            parent = by_id[link.parent_call_id]
            child = by_id[link.call_id]
            assert child.prompt_ids[:len(parent.prompt_ids) + len(parent.response_ids)] == \
                parent.prompt_ids + parent.response_ids
    main1, sub1, lost, main2, sub2, main3, compacted = links
    assert (main1.resolution, sub1.resolution, compacted.resolution) == ("root",) * 3
    assert len({main1.chain, sub1.chain, lost.chain, compacted.chain}) == 4
    assert lost.parent_call_id == main2.parent_call_id == main1.call_id
    assert main2.chain == main3.chain == main1.chain and main3.parent_call_id == main2.call_id
    assert lost.parent_chain == main1.chain and lost.chain not in {main1.chain, sub1.chain}
    assert sub2.parent_call_id == sub1.call_id and sub2.chain == sub1.chain
    assert calls[0].request_items[0] == {"role": "system", "content": "Main agent."}  # chat form, for Gym's lookup


def test_a_real_anthropic_tool_loop_is_one_chain(proxy: RunningProxy, capture: Path) -> None:
    turns = anthropic_loop(proxy, "anthropic-loop")
    calls, _ = calls_from_records(captured(capture, "anthropic-loop"))
    links = link_calls(calls)
    assert len(links) == turns and {k.chain for k in links} == {0}
    assert [k.parent_call_id for k in links] == [None] + [k.call_id for k in links[:-1]]
