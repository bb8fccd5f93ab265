"""An engine's prompt token IDs parsed past what the session's last answer shared (polar_gym.known_prompt_ids
.KnownPromptIds): every answer gives exactly what ``orjson.loads`` gives, the IDs come checked and packed, a
hostile or odd answer is parsed whole, and what is kept is bounded and dropped with its session."""

from __future__ import annotations

from array import array
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_gym.journal import SessionStore, decode
from polar_gym.known_prompt_ids import KnownPromptIds, PromptIds
from polar_gym.proxy.engines.openai import token_ids_in
from polar_gym.proxy.engines.sglang import SGLangEngine
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.schema import CompletionRecord

PROMPT = [(i * 7919) % 151000 for i in range(3000)]


def answer(ids: list[Any], *, where: str = "top", **extra: Any) -> bytes:
    """A vLLM chat answer (``top``) or an SGLang / completions one (``choice``) with ``ids`` as its prompt."""
    logprobs = {"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.0}]}
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "ok"}, "token_ids": [1, 2],
                              "finish_reason": "stop", "logprobs": logprobs}
    body: dict[str, Any] = {"id": "x", "choices": [choice], **extra}
    if where == "top":
        body = {"id": "x", "prompt_token_ids": ids, **{k: v for k, v in body.items() if k != "id"}}
    else:
        choice["prompt_token_ids"] = ids
    return orjson.dumps(body)


def test_a_growing_prompt_is_parsed_past_the_known_one_and_equals_a_whole_parse():
    known = KnownPromptIds()
    first = known.loads(answer(PROMPT), "s")
    assert type(first["prompt_token_ids"]) is PromptIds and known.hits == 0
    grown = [*PROMPT, 151644, 77091, 198]
    second = known.loads(answer(grown), "s")
    assert second == orjson.loads(answer(grown))
    assert known.hits == 1 and known.reused == len(PROMPT)
    ids = second["prompt_token_ids"]
    assert type(ids) is PromptIds and ids.packed.tobytes() == array("I", grown).tobytes()
    assert ids[0] is first["prompt_token_ids"][0]  # the shared items are the known ones, not parsed again


def test_the_same_prompt_again_is_the_same_list_and_a_longer_one_a_new_list():
    """A retry's IDs are the known list itself (no copy of a long prompt); one that goes on is a new list, so the
    known one never changes."""
    known = KnownPromptIds()
    first = known.loads(answer(PROMPT), "s")["prompt_token_ids"]
    again = known.loads(answer(PROMPT), "s")["prompt_token_ids"]
    assert again is first and known.reused == len(PROMPT)
    assert again.packed.tobytes() == array("I", PROMPT).tobytes()
    grown = known.loads(answer([*PROMPT, 5]), "s")["prompt_token_ids"]
    assert grown is not first and grown == [*PROMPT, 5] and first == PROMPT
    assert grown.packed.tobytes() == array("I", [*PROMPT, 5]).tobytes()
    assert first.packed.tobytes() == array("I", PROMPT).tobytes()


def test_a_prompt_that_diverges_reuses_the_items_before_the_first_difference():
    known = KnownPromptIds()
    known.loads(answer(PROMPT), "s")
    changed = [*PROMPT[:1000], 424242, *PROMPT[1001:]]  # a compaction rewrote one token
    got = known.loads(answer(changed), "s")
    assert got == orjson.loads(answer(changed)) and known.reused == 1000
    assert got["prompt_token_ids"].packed.tobytes() == array("I", changed).tobytes()
    # a token that only extends a known one's digits is not shared ("12" then "123")
    digits = [*changed[:2000], changed[2000] * 10 + 7]  # (the changed prompt replaced the one it came from)
    assert known.loads(answer(digits), "s") == orjson.loads(answer(digits))
    assert known.reused == 1000 + 2000


def test_sglang_and_completions_answers_hold_the_ids_in_the_first_choice():
    known = KnownPromptIds()
    known.loads(answer(PROMPT, where="choice"), "s")
    grown = [*PROMPT, 5]
    assert known.loads(answer(grown, where="choice"), "s") == orjson.loads(answer(grown, where="choice"))
    assert known.hits == 1


@pytest.mark.parametrize("case", ["nested", "duplicate", "negative", "too_large", "floats", "strings", "spaced",
                                  "malformed_tail", "second_choice"])
def test_odd_and_hostile_answers_parse_as_orjson_parses(case: str):
    """Each answer is sent after a known prompt, so the memo would reuse it if it could."""
    known = KnownPromptIds()
    known.loads(answer(PROMPT), "s")
    grown = [*PROMPT, 7]
    raw = {
        # the key inside a message first: only the top-level list is the prompt
        "nested": answer(grown, extra_field={"prompt_token_ids": PROMPT[:500]}).replace(
            b'{"id":"x",', b'{"id":"x","meta":{"prompt_token_ids":' + orjson.dumps(PROMPT[:600]) + b'},'),
        # orjson keeps the last of duplicate keys
        "duplicate": answer(grown)[:-1] + b',"prompt_token_ids":' + orjson.dumps(PROMPT[:700]) + b"}",
        "negative": answer([*PROMPT, -1]),
        "too_large": answer([*PROMPT, 2**32]),
        "floats": answer([*PROMPT, 1.5]),
        "strings": answer([*PROMPT[:10], "a]b", *PROMPT[10:]]),
        "spaced": answer(grown).replace(b",", b", "),
        "malformed_tail": answer(grown).replace(b",7]", b",7,]"),
        "second_choice": orjson.dumps({"choices": [{"index": 0}, {"prompt_token_ids": grown}]}),
    }[case]
    try:
        expected: Any = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        with pytest.raises(orjson.JSONDecodeError) as got:
            known.loads(raw, "s")
        assert str(got.value) == str(exc)  # the same error, at the same place
        return
    parsed = known.loads(raw, "s")
    assert parsed == expected
    if case in ("negative", "too_large", "floats", "strings"):
        ids = parsed["prompt_token_ids"]
        assert type(ids) is list  # not vouched for: the engine's reader checks (and refuses) them


def next_prompt(ids: list[int], kind: str, at: int) -> list[int]:
    if kind == "grow":
        return [*ids, at]
    if kind == "cut":
        return ids[:at + 400]
    if kind == "change":
        return [*ids[:at], at + 1, *ids[at + 1:]]
    if kind == "other":
        return [at, *PROMPT]
    if kind == "small":
        return ids[:5]
    if kind == "bad":
        return [*ids[:at], -at - 1]
    return ids


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grow", "same", "cut", "change", "other", "small", "bad"]),
                          st.integers(0, 2999), st.sampled_from(["s", "t"])), min_size=1, max_size=12))
def test_any_sequence_of_answers_parses_as_orjson_parses(steps: list[tuple[str, int, str]]):
    known = KnownPromptIds(max_tokens=20_000)
    current = {"s": list(PROMPT), "t": list(PROMPT)}
    for kind, at, scope in steps:
        ids = next_prompt(current[scope], kind, at)
        current[scope] = ids if kind != "bad" else current[scope]
        raw = answer(ids)
        parsed = known.loads(raw, scope)
        assert parsed == orjson.loads(raw)
        got = parsed["prompt_token_ids"]
        if type(got) is PromptIds:
            assert got.packed.tobytes() == array("I", ids).tobytes()
    assert known._tokens <= 20_000


def test_kept_ids_are_bounded_least_recently_used_session_first_and_forgotten_with_their_session():
    known = KnownPromptIds(max_tokens=10_000, per_scope=2)
    for scope in ("a", "b", "c"):
        known.loads(answer(PROMPT), scope)  # 3,000 each
    assert known._tokens == 9000
    known.loads(answer([9, *PROMPT[1:]]), "a")  # a sub-agent of "a": nothing shared, a list of its own
    assert list(known._scopes) == ["c", "a"] and known._tokens == 9000  # "b", the least recently used, went
    known.loads(answer([8, *PROMPT[1:]]), "a")  # a third list for "a": its oldest goes
    assert [len(e.ids) for e in known._scopes["a"]] == [3000, 3000] and known._tokens == 9000
    assert known.loads(answer([9, *PROMPT[1:], 5]), "a")["prompt_token_ids"][1:3000] == PROMPT[1:]
    assert known.hits == 1  # the sub-agent's list was still kept
    known.forget("a")
    assert list(known._scopes) == ["c"] and known._tokens == 3000
    assert known.loads(answer(PROMPT), None) == orjson.loads(answer(PROMPT))  # no session: parsed whole
    assert list(known._scopes) == ["c"]


def test_token_ids_in_checks_ids_and_takes_vouched_ones_as_they_are():
    ids = KnownPromptIds().loads(answer(PROMPT), "s")["prompt_token_ids"]
    assert token_ids_in(ids) is ids
    assert token_ids_in([1, 2]) == [1, 2]
    assert token_ids_in([1.0, "2"]) == [1, 2]  # numbers written otherwise: converted
    for bad in ([-1], [2**32], ["x"], [None]):
        with pytest.raises(ValueError, match="token IDs must be"):
            token_ids_in(bad)
    with pytest.raises(ValueError, match="must be a list"):
        token_ids_in("1,2")


@pytest.mark.parametrize("engine", [VLLMEngine, SGLangEngine])
def test_an_engine_answer_with_ids_out_of_range_is_refused_when_read(engine: type):
    body = orjson.loads(answer([1, -5], where="top" if engine is VLLMEngine else "choice"))
    if engine is SGLangEngine:
        body["choices"][0]["meta_info"] = {"output_token_logprobs": [[-0.5, 1, None], [-1.0, 2, None]]}
    with pytest.raises(ValueError, match="token IDs must be"):
        engine.__new__(engine).parse(body)


def test_the_journal_stores_vouched_ids_exactly_as_a_plain_list():
    known = KnownPromptIds()
    records = []
    for n in (3000, 3003):
        ids = [*PROMPT, 1, 2, 3][:n]
        parsed = known.loads(answer(ids), "s")["prompt_token_ids"]
        records.append(CompletionRecord(completion_id=f"c{n}", session_id="s", index=len(records), provider="p",
                                        engine="vllm", model="m", stream=False, side_request=False, path="/",
                                        request={}, normalized_request={}, normalizations=[], started_at=0.0,
                                        token_faithful=True, response_ids=[5], response_logprobs=[-0.5]))
        records[-1].prompt_ids = parsed
    store, plain = SessionStore(), SessionStore()
    vouched = [store.encode(r) for r in records]
    for r in records:
        r.prompt_ids = list(r.prompt_ids)
    assert vouched == [plain.encode(r) for r in records]
    lines, tokens, logprobs = (b"".join(part) for part in zip(*vouched, strict=True))
    assert [r.prompt_ids for r in decode([lines], tokens, logprobs)] == [PROMPT, [*PROMPT, 1, 2, 3]]


# ------------------------------------------------------------------------------ what mutation testing found


def test_the_documented_bounds_and_a_compact_list():
    """docs/security.md: 2M prompt IDs in all, four lists a session, lists from 2 KB of JSON; a kept list has no
    ``__dict__`` (one per session, tens of thousands of IDs each)."""
    known = KnownPromptIds()
    assert (known.max_tokens, known.per_scope, known.min_bytes) == (2 << 20, 4, 2048)
    ids = known.loads(answer(PROMPT), "s")["prompt_token_ids"]
    assert not hasattr(ids, "__dict__")


def test_a_prompt_that_differs_in_its_first_id_shares_nothing():
    known = KnownPromptIds()
    known.loads(answer([1234, *PROMPT]), "s")
    other = [1235, *PROMPT]  # shares "[123" only: no whole ID
    assert known.loads(answer(other), "s") == orjson.loads(answer(other))
    assert known.hits == 0 and known.reused == 0


def test_a_prompt_cut_back_right_after_a_comma_reuses_every_id_before_it():
    known = KnownPromptIds()
    known.loads(answer(PROMPT), "s")
    cut = [*PROMPT[:2000], 999999]  # differs at the first digit after the 2,000th comma
    assert known.loads(answer(cut), "s") == orjson.loads(answer(cut)) and known.reused == 2000
    shorter = PROMPT[:1500]  # ends where the known list goes on
    assert known.loads(answer(shorter), "s") == orjson.loads(answer(shorter))


def test_a_sub_agent_sharing_the_opening_is_kept_beside_the_agents_prompt():
    known = KnownPromptIds()
    known.loads(answer(PROMPT), "s")
    known.loads(answer([*PROMPT[:1500], 7, 8, 9]), "s")  # shares 1,500 IDs: kept beside, not instead
    assert len(known._scopes["s"]) == 2
    grown = [*PROMPT, 5]
    assert known.loads(answer(grown), "s") == orjson.loads(answer(grown)) and known.reused == 1500 + 3000


def test_ids_exactly_at_the_total_are_kept():
    known = KnownPromptIds(max_tokens=6000)
    known.loads(answer(PROMPT), "a")
    known.loads(answer(PROMPT), "b")
    assert list(known._scopes) == ["a", "b"] and known._tokens == 6000


def test_an_answer_malformed_outside_the_ids_raises_as_orjson_does():
    known = KnownPromptIds()
    known.loads(answer(PROMPT), "s")
    raw = answer([*PROMPT, 1])[:-1] + b',"x":}'
    with pytest.raises(orjson.JSONDecodeError) as theirs:
        orjson.loads(raw)
    with pytest.raises(orjson.JSONDecodeError) as ours:
        known.loads(raw, "s")
    assert str(ours.value) == str(theirs.value)
