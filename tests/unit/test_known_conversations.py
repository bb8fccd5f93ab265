"""A session's conversation through known values (polar_gym.known_json, ``KnownValues.loads(raw, scope)``): the
items a body shares with the session's last ones are not parsed again and give exactly what parsing it whole gives;
recorded conversations grown item by item translate as fresh parses do; what is kept is bounded, most recently used
first, and freed by reference counting alone when the session is forgotten."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from polar_gym.known_json import CONVERSATION_FIELDS, KNOWN, KnownValues
from polar_gym.proxy.providers.base import Route
from polar_gym.registry import PROVIDERS
from tests.unit.test_known_json import CASES, SYSTEM, TOOLS, _route, body


@pytest.mark.parametrize("case", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_recorded_conversations_translate_the_same_as_they_grow_item_by_item(case):
    """Each recorded conversation sent one item longer each call, in one session (the items before the last are
    taken from the session's known conversation): each call translates as a fresh parse of it does."""
    recorded = json.loads(case.read_text())
    name = next((n for n in CONVERSATION_FIELDS if isinstance(recorded["body"].get(n), list)), None)
    if name is None:
        pytest.skip("no conversation list")
    provider, route = PROVIDERS.get(recorded["provider"])(), _route(recorded["path"])
    known = KnownValues(min_conversation_bytes=64)
    items = recorded["body"][name]
    for n in range(1, len(items) + 1):
        raw = orjson.dumps({**recorded["body"], name: items[:n]})
        parsed = known.loads(raw, "s")
        assert parsed == orjson.loads(raw)
        try:
            fresh = provider.parse(orjson.loads(raw), route)
        except Exception as exc:  # a cut conversation the protocol refuses: refused the same way
            with pytest.raises(type(exc)) as ours:
                provider.parse(parsed, route)
            assert str(ours.value) == str(exc)
            continue
        ours_inbound = provider.parse(parsed, route)
        assert orjson.dumps(ours_inbound.chat.dump()) == orjson.dumps(fresh.chat.dump())
        assert ours_inbound.normalizations == fresh.normalizations
    assert known.items_reused >= len(items) - 1 or len(orjson.dumps(items)) < 64
    assert orjson.dumps(parsed[name]) == orjson.dumps(items)  # translating changed no shared item


# ------------------------------------------------------------------------------- a session's growing conversation


def turn(i: int, size: int = 600) -> dict[str, Any]:
    return {"role": "user" if i % 2 else "assistant", "content": f"turn {i} " + "w" * size + " é ☃"}


def convo(n: int, **over: Any) -> dict[str, Any]:
    return body(messages=[turn(i) for i in range(n)], **over)


def test_a_growing_conversation_is_parsed_past_the_items_the_session_sent_before():
    known = KnownValues()
    first = known.loads(orjson.dumps(convo(4)), "s")
    second = known.loads(orjson.dumps(convo(6)), "s")
    assert second == orjson.loads(orjson.dumps(convo(6)))
    assert known.items_reused == 4
    assert all(a is b for a, b in zip(first["messages"], second["messages"][:4], strict=True))
    assert second["messages"] is not first["messages"]  # each call has its own list
    assert known.json_of(second["messages"][5]) is None  # an item's JSON is not kept twice (the text has it)
    third = known.loads(orjson.dumps(convo(6)), "s")  # a retry: the same conversation
    assert third == second and known.items_reused == 10
    other = known.loads(orjson.dumps(convo(6)), "t")  # another session learns its own
    assert other == second and known.items_reused == 10


@pytest.mark.parametrize("case", ["edited", "nested-first", "duplicate-last", "duplicate-first", "number-grows",
                                  "spaced-tail", "malformed", "not-a-list", "other-field", "empty"])
def test_hostile_and_odd_conversations_parse_as_orjson_parses(case: str):
    known = KnownValues(min_conversation_bytes=64)
    known.loads(orjson.dumps(convo(4)), "s")
    items = orjson.dumps([turn(i) for i in range(4)])[1:-1].decode()
    raw = {
        # the third turn changed: only the first two are shared
        "edited": orjson.dumps(body(messages=[turn(0), turn(1), turn(9), turn(3)])),
        # the same items under a nested "messages" before the field itself
        "nested-first": f'{{"meta":{{"messages":[{items}]}},"messages":[{items},{{"role":"user","content":"x"}}]}}'
        .encode(),
        "duplicate-last": f'{{"messages":[{{"role":"user","content":"a"}}],"messages":[{items}]}}'.encode(),
        "duplicate-first": f'{{"messages":[{items}],"messages":[{{"role":"user","content":"a"}}]}}'.encode(),
        "spaced-tail": f'{{"messages":[{items}, {{"role": "user", "content": "x"}}]}}'.encode(),
        "malformed": f'{{"messages":[{items},{{"role":"user",}}]}}'.encode(),
        "not-a-list": orjson.dumps(body(messages="hello")),
        "other-field": orjson.dumps({"contents": [turn(i) for i in range(4)]}),
        "empty": orjson.dumps(body(messages=[])),
    }.get(case, b"")
    if case == "number-grows":  # a list of numbers whose last one goes on
        known.loads(b'{"messages":[' + b",".join([b"1234567890"] * 20) + b"]}", "n")
        raw = b'{"messages":[' + b",".join([b"1234567890"] * 20) + b"5]}"
        assert known.loads(raw, "n") == orjson.loads(raw)
        return
    try:
        expected = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        with pytest.raises(orjson.JSONDecodeError) as ours:
            known.loads(raw, "s")
        assert str(ours.value) == str(exc)
        return
    assert known.loads(raw, "s") == expected
    if case == "edited":
        assert known.items_reused == 2


@given(st.lists(st.tuples(st.sampled_from(["grow", "same", "edit", "cut", "spaced", "garbage", "nested", "small",
                                           "forget", "escaped"]), st.integers(0, 7), st.sampled_from(["s", "t"])),
                min_size=1, max_size=14))
def test_any_sequence_of_conversations_parses_as_orjson_parses(steps):
    """And whenever a body is said to be what orjson writes of it (``loads_checked``), it is."""
    known = KnownValues(min_conversation_bytes=256, max_conversation_total=40_000, per_scope=2)
    sizes = {"s": 3, "t": 3}
    for step, at, scope in steps:
        n = sizes[scope]
        messages = [turn(i, 100) for i in range(n)]
        if step == "grow":
            sizes[scope] = n + 1 + at % 3
            messages = [turn(i, 100) for i in range(sizes[scope])]
        elif step == "edit":
            messages[at % n] = turn(at + 50, 100)
        elif step == "cut":
            messages = messages[:at % n + 1]
        elif step == "small":
            messages = [{"role": "user", "content": "x"}]
        elif step == "forget":
            known.forget(scope)
            continue
        data = {"model": "m", "messages": messages}
        raw = {"spaced": json.dumps(data).encode(), "garbage": orjson.dumps(data)[:-2],
               "nested": orjson.dumps({"x": {"messages": messages[:2]}, **data}),
               "escaped": orjson.dumps(data)[::-1].replace("é".encode()[::-1], b"9e00u\\", 1)[::-1],  # the last é
               }.get(step, orjson.dumps(data))
        try:
            expected = orjson.loads(raw)
        except orjson.JSONDecodeError:
            with pytest.raises(orjson.JSONDecodeError):
                known.loads(raw, scope)
            continue
        parsed, as_written = known.loads_checked(raw, scope)
        assert parsed == expected
        assert not as_written or orjson.dumps(parsed) == raw
        assert known._conversation_total <= 40_000


def test_conversations_are_bounded_per_session_and_in_all_and_forgotten_with_their_session():
    size = len(orjson.dumps([turn(i) for i in range(4)])) - 1
    known = KnownValues(max_conversation_bytes=size, max_conversation_total=2 * size + size // 2, per_scope=2)
    a = known.loads(orjson.dumps(convo(4)), "a")["messages"]
    known.loads(orjson.dumps(body(messages=[turn(9), *[turn(i) for i in range(1, 4)]])), "a")  # a sub-agent
    assert len(known._scopes["a"]) == 2 and known.known(a[0])
    known.loads(orjson.dumps(body(messages=[turn(8), *[turn(i) for i in range(1, 4)]])), "a")  # a third: oldest goes
    assert len(known._scopes["a"]) == 2 and not known.known(a[0])
    b = known.loads(orjson.dumps(convo(4)), "b")["messages"]  # over the total: "a", least recently used, goes
    assert list(known._scopes) == ["b"] and known._conversation_total == size
    known.forget("b")
    assert not known._scopes and known._conversation_total == 0 and not known.known(b[0])
    assert known.json_of(b[0]) is None  # the journal serializes it again


def test_items_shared_by_two_of_a_session_conversations_stay_known_until_both_are_gone():
    known = KnownValues(per_scope=2, min_conversation_bytes=64)
    first = known.loads(orjson.dumps(convo(4)), "s")["messages"]
    sub = known.loads(orjson.dumps(convo(5)), "s")["messages"]
    assert len(known._scopes["s"]) == 1 and sub[0] is first[0]  # went on from all of it: replaced it
    known.loads(orjson.dumps(body(messages=[turn(0), turn(7)])), "s")  # shares turn 0 only: kept beside
    known.loads(orjson.dumps(body(messages=[turn(9), turn(8)])), "s")  # pushes out the 5-turn one
    assert known.known(first[0])  # still held by the two-turn one
    known.loads(orjson.dumps(body(messages=[turn(6), turn(8)])), "s")
    assert not known.known(first[0])
    derived = known.derive(known.loads(orjson.dumps(convo(4)), "s")["messages"][1], "upper", lambda t: [t["role"]])
    known.forget("s")
    assert not known.known(derived)  # what was derived from an item goes with it


def test_what_a_forgotten_session_kept_is_freed_without_the_cyclic_collector():
    """A serving process runs the cyclic collector rarely (polar_gym.proxy.app.tune_gc_for_serving): what is
    forgotten must be freed by reference counting alone, so nothing kept may point back at what holds it."""
    import gc
    import weakref

    class Derived:
        pass

    known = KnownValues(min_conversation_bytes=64)
    gc.collect()
    gc.disable()
    try:
        items = known.loads(orjson.dumps(convo(4)), "s")["messages"]
        first = known.derive(items[0], "a", lambda _: Derived())
        second = known.derive(first, "b", lambda _: (Derived(), [Derived()]))  # derived from a derived value
        tools = known.loads(orjson.dumps(convo(4)), "t")["tools"]
        of_tools = known.derive(tools, "c", lambda _: Derived())
        refs = [weakref.ref(first), weakref.ref(second[0]), weakref.ref(second[1][0]), weakref.ref(of_tools)]
        del items, first, second, of_tools
        known.forget("s")
        known.forget("t")
        assert [r() is None for r in refs[:3]] == [True, True, True]
        known.clear()  # the tools go too
        del tools
        assert refs[3]() is None
    finally:
        gc.enable()


def test_a_known_item_the_protocol_refuses_is_refused_as_a_fresh_parse_refuses_it():
    """Validated once means refused every time, with the message (and its place in the body) a fresh parse gives."""
    from polar_gym.proxy.errors import RequestError

    provider, route = PROVIDERS.get("anthropic")(), Route("/v1/messages")
    bad = {"model": "m", "max_tokens": 5, "messages": [turn(1), {"role": "robot", "content": "x" * 700}, turn(3)]}
    with pytest.raises(RequestError) as fresh:
        provider.parse(orjson.loads(orjson.dumps(bad)), route)
    known = KNOWN.loads(orjson.dumps(bad), "refused")
    again = KNOWN.loads(orjson.dumps(bad), "refused")
    assert again["messages"][0] is known["messages"][0]  # the items are known ones
    for body_ in (known, again):
        with pytest.raises(RequestError) as ours:
            provider.parse(body_, route)
        assert str(ours.value) == str(fresh.value) and "messages.1.role" in str(ours.value)
    KNOWN.forget("refused")


def test_notes_of_known_turns_are_given_once_and_in_order():
    """Claude Code's billing line in two in-conversation system turns: one note, as translating afresh gives it."""
    billing = "x-anthropic-billing-header: cc_version=2.1.197.x; cc_entrypoint=cli; cch=00000;\n"
    system_turn = {"role": "system", "content": [{"type": "text", "text": billing + "reminder " * 80}]}
    body_ = {"model": "m", "max_tokens": 5, "messages": [turn(1), system_turn, turn(2, 300), system_turn, turn(3)]}
    raw = orjson.dumps(body_)
    provider, route = PROVIDERS.get("anthropic")(), Route("/v1/messages")
    fresh = provider.parse(orjson.loads(raw), route)
    for _ in range(3):
        inbound = provider.parse(KNOWN.loads(raw, "notes"), route)
        assert inbound.normalizations == fresh.normalizations
        assert orjson.dumps(inbound.chat.dump()) == orjson.dumps(fresh.chat.dump())
    assert fresh.normalizations.count(fresh.normalizations[0]) == 1
    KNOWN.forget("notes")


async def test_the_service_keeps_a_sessions_conversation_until_the_session_is_forgotten(tmp_path: Path):
    from tests._serving import oracle_service

    service = oracle_service(tmp_path)
    raw = orjson.dumps({"model": "policy", "messages": [turn(1), turn(2), turn(3)]})

    async def connected() -> bool:
        return False

    for _ in range(2):
        reply = await service.handle("openai_chat", raw, Route("/v1/chat/completions"), {"authorization": "Bearer kc"},
                                     connected)
        assert reply.status == 200, reply.body
    assert "kc" in KNOWN._scopes and KNOWN._scopes["kc"][0].items[0].holders
    service.forget("kc")
    assert "kc" not in KNOWN._scopes
    service.journal.close()


# ------------------------------------------------------------------ conversations: what mutation testing found


def test_the_documented_conversation_bounds():
    """docs/security.md: 4 conversations a session, at most 4 MiB each and 16 MiB in all, kept from 512 bytes."""
    known = KnownValues()
    assert (known.per_scope, known.min_conversation_bytes, known.max_conversation_bytes,
            known.max_conversation_total) == (4, 512, 4 * 1024 * 1024, 16 * 1024 * 1024)
    assert KnownValues().conversation_fields == ("messages", "input", "contents")


def messages_of_size(size: int, tag: str = "a") -> list[dict[str, Any]]:
    """One message whose conversation text (``[`` to the end of its last item) is ``size`` bytes."""
    bare = len(orjson.dumps([{"role": "user", "content": tag}])) - 1
    return [{"role": "user", "content": tag + "x" * (size - bare)}]


def test_conversations_exactly_at_the_size_bounds_are_kept_and_fill_the_total_exactly():
    size = 600
    known = KnownValues(min_conversation_bytes=size, max_conversation_bytes=size, max_conversation_total=2 * size)
    for tag, n in (("a", size), ("b", size - 1), ("c", size + 1)):
        known.loads(orjson.dumps({"messages": messages_of_size(n, tag)}), tag)
    assert list(known._scopes) == ["a"]  # 599 and 601 bytes: not kept
    known.loads(orjson.dumps({"messages": messages_of_size(size, "d")}), "d")
    assert list(known._scopes) == ["a", "d"] and known._conversation_total == 2 * size  # exactly the total: kept


def test_a_scope_used_again_is_the_most_recently_used_and_a_retry_keeps_its_conversation():
    size = len(orjson.dumps([turn(i) for i in range(4)])) - 1
    known = KnownValues(max_conversation_total=2 * size + size // 2, per_scope=2)
    known.loads(orjson.dumps(convo(4)), "a")
    known.loads(orjson.dumps(convo(4, model="b")), "b")
    kept = known._scopes["a"][0]
    again = known.loads(orjson.dumps(convo(4)), "a")  # a retry: nothing new to keep, but "a" was used
    assert known._scopes["a"] == [kept] and again["messages"][0] is kept.items[0].value
    known.loads(orjson.dumps(body(messages=[turn(9), turn(8), turn(7), turn(6)])), "c")
    assert list(known._scopes) == ["a", "c"]  # "b" was the least recently used
    known.loads(orjson.dumps(convo(5)), "a")  # goes on from all of it: learned, and "a" is the newest again
    known.loads(orjson.dumps(body(messages=[turn(5), turn(6), turn(7), turn(8)])), "d")
    assert list(known._scopes)[-2:] == ["a", "d"] and "c" not in known._scopes


def test_a_conversation_used_again_outlives_one_of_its_session_left_unused():
    known = KnownValues(per_scope=2, min_conversation_bytes=64)
    main = [turn(i) for i in range(3)]
    known.loads(orjson.dumps(body(messages=main)), "s")
    known.loads(orjson.dumps(body(messages=[turn(7), turn(8)])), "s")  # a sub-agent: kept beside
    assert len(known._scopes["s"]) == 2
    grown = known.loads(orjson.dumps(body(messages=[*main, turn(3)])), "s")  # the main agent again: the newest
    known.loads(orjson.dumps(body(messages=[turn(5), turn(6)])), "s")  # a third: the sub-agent's goes
    kept = [[item.value for item in prefix.items] for prefix in known._scopes["s"]]
    assert [turn(5), turn(6)] in kept and [*main, turn(3)] in kept
    assert known.loads(orjson.dumps(body(messages=[*main, turn(3), turn(4)])), "s")["messages"][0] is \
        grown["messages"][0]


def test_a_sub_agent_sharing_the_opening_is_kept_beside_not_instead():
    known = KnownValues(min_conversation_bytes=64)
    main = known.loads(orjson.dumps(body(messages=[turn(0), turn(1), turn(2)])), "s")["messages"]
    known.loads(orjson.dumps(body(messages=[turn(0), turn(7)])), "s")  # shares only the first turn
    assert len(known._scopes["s"]) == 2
    assert known.loads(orjson.dumps(body(messages=[turn(0), turn(1), turn(2), turn(3)])), "s")["messages"][2] is \
        main[2]


def test_what_was_derived_from_an_item_survives_the_conversation_going_on():
    known = KnownValues()
    calls: list[int] = []
    first = known.loads(orjson.dumps(convo(4)), "s")["messages"]
    known.derive(first[1], "k", lambda item: calls.append(1) or [item["role"]])
    second = known.loads(orjson.dumps(convo(6)), "s")["messages"]
    assert known.derive(second[1], "k", lambda item: calls.append(1) or [item["role"]]) == ["user"]
    assert calls == [1]  # computed once: the item, and what was derived from it, carried over


def test_a_conversation_cut_back_reuses_exactly_the_items_it_kept():
    known = KnownValues()
    known.loads(orjson.dumps(convo(6)), "s")
    cut = known.loads(orjson.dumps(convo(4)), "s")
    assert cut == orjson.loads(orjson.dumps(convo(4))) and known.items_reused == 4
    small = KnownValues(min_conversation_bytes=64)
    numbers = b'{"messages":[' + b",".join([b"1234567890"] * 20)
    small.loads(numbers + b"]}", "n")
    small.loads(numbers[:-10] + b"12345678905]}", "n")  # the last number goes on: the 19 before it are reused
    assert small.items_reused == 19


def test_one_digit_items_are_kept_too():
    known = KnownValues(min_conversation_bytes=8)
    known.loads(b'{"messages":[5,6,7,8,9]}', "d")
    assert known.loads(b'{"messages":[5,6,7,8,9,4]}', "d") == {"messages": [5, 6, 7, 8, 9, 4]}
    assert known.items_reused == 5


def test_clear_forgets_every_sessions_conversation():
    known = KnownValues()
    items = known.loads(orjson.dumps(convo(4)), "s")["messages"]
    known.clear()
    assert not known._scopes and known._conversation_total == 0 and not known.known(items[0])


def test_a_conversation_sent_again_is_its_sessions_most_recently_used():
    """A retry of the agent's conversation after a sub-agent's: the sub-agent's goes first when room runs out."""
    known = KnownValues(per_scope=2, min_conversation_bytes=64)
    main = known.loads(orjson.dumps(body(messages=[turn(0), turn(1), turn(2)])), "s")["messages"]
    sub = known.loads(orjson.dumps(body(messages=[turn(7), turn(8)])), "s")["messages"]
    known.loads(orjson.dumps(body(messages=[turn(0), turn(1), turn(2)])), "s")  # the agent's, again (a retry)
    known.loads(orjson.dumps(body(messages=[turn(5), turn(6)])), "s")  # a third: the least recently used goes
    assert known.known(main[0]) and not known.known(sub[0])


def test_a_session_looks_for_its_fields_outside_its_shared_items_and_only_for_those_its_last_body_held():
    """Looking for a field scans the body, so a session's next body is searched only for the repeated fields its
    last one held, and not inside the items it shares (a nested key of a field's name there is not the field).
    Either way the body parses exactly as orjson parses it; a field the last body lacked is parsed, then known
    from the call after."""
    known = KnownValues(min_bytes=64)
    nested = {"role": "user", "content": "x" * 600, "tools": [{"name": "not the tools"}], "system": "not it"}
    other = orjson.dumps(body())  # another session teaches the system prompt and the tools
    known.loads(other, "other")
    taught = known.loads(other, "other")
    first = {"model": "m", "messages": [nested, turn(1)], "tools": TOOLS}  # no system prompt yet
    known.loads(orjson.dumps(first), "s")
    grown = {**first, "messages": [nested, turn(1), turn(2)], "system": SYSTEM}
    raw = orjson.dumps(grown)
    parsed = known.loads(raw, "s")
    assert parsed == orjson.loads(raw)
    assert parsed["tools"] is taught["tools"]  # found past the shared items, whose nested "tools" is not it
    assert parsed["messages"][0]["tools"] == [{"name": "not the tools"}]
    assert parsed["system"] == SYSTEM and parsed["system"] is not taught["system"]  # its last body had none
    again = {**grown, "messages": [*grown["messages"], turn(3)]}
    raw = orjson.dumps(again)
    reused = known.loads(raw, "s")
    assert reused == orjson.loads(raw)
    assert reused["system"] is parsed["system"] or reused["system"] is taught["system"]  # looked for, found


@given(st.binary(max_size=40).map(lambda b: b.replace(b"\x00", b"ab")), st.sampled_from([b"a", b"ab", b"bab"]),
       st.integers(0, 45), st.integers(0, 45), st.integers(0, 45))
def test_finding_a_marker_outside_the_shared_items_is_the_first_one_that_does_not_begin_there(
        raw: bytes, marker: bytes, start: int, skip_from: int, length: int):
    from polar_gym.known_json import _find_outside

    skip_to = min(len(raw), skip_from + length)
    skip_from = min(skip_from, skip_to)
    expected = next((at for at in range(start, len(raw)) if raw.startswith(marker, at)
                     and not skip_from <= at < skip_to), -1)
    assert _find_outside(raw, marker, start, skip_from, skip_to) == expected


def test_a_sessions_earlier_messages_are_dumped_once_and_the_request_dumps_as_pydantic_does():
    """The normalized request's messages that a session sent before are shared (their translation is known), so
    their dump is computed once: the next call's dump holds the same dicts. A message of this call alone is dumped
    now. Either way the request dumps exactly as ``model_dump(exclude_none=True)`` does, key order included."""
    from polar_gym.proxy.chat import ChatMessage, ChatRequest, Tool

    provider, route = PROVIDERS.get("anthropic")(), Route("/v1/messages")
    first = convo(3)
    second = convo(4)
    one = provider.parse(KNOWN.loads(orjson.dumps(first), "dumps"), route).chat.dump()
    two = provider.parse(KNOWN.loads(orjson.dumps(second), "dumps"), route).chat.dump()
    shared = [a is b for a, b in zip(one["messages"], two["messages"], strict=False)]
    assert shared == [True, True, True, True]  # the system prompt and the three turns the session sent before
    from polar_gym.journal import SessionStore
    from polar_gym.schema import CompletionRecord

    store = SessionStore()
    for i, dumped in enumerate((one, two)):
        store.encode(CompletionRecord(completion_id=f"c{i}", session_id="dumps", index=i, provider="anthropic",
                                      engine="vllm", request={}, normalized_request=dumped))
    kept = [KNOWN._index[id(m)] for m in two["messages"] if id(m) in KNOWN._index]
    assert kept and all(entry.json is None for entry in kept)  # journaled once each: their JSON is not kept
    KNOWN.forget("dumps")
    fresh = [ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", content=None, name="x")]
    for tools in (None, [Tool(function={"name": "t", "parameters": {}})]):
        request = ChatRequest(model="m", messages=fresh, tools=tools, max_tokens=5, extra={"a": 1})
        assert orjson.dumps(request.dump()) == orjson.dumps(request.model_dump(exclude_none=True))
    assert ChatRequest(model="m", messages=fresh).dump()["messages"][0] is not \
        ChatRequest(model="m", messages=fresh).dump()["messages"][0]  # not known: dumped each time


def test_a_body_with_known_parts_is_proved_to_be_what_orjson_writes_by_serializing_the_rest_alone():
    """``loads_checked`` says a body is what ``orjson.dumps`` writes of it when the parts it did not know prove it;
    a body written otherwise anywhere outside its known parts (spaces, an escape orjson does not write, a key twice,
    a number orjson writes another way) is not; a body parsed whole is not checked."""
    known = KnownValues(min_bytes=64)
    first = orjson.dumps(convo(3))
    assert known.loads_checked(first, "s") == (orjson.loads(first), False)  # nothing known yet: not checked
    grown = orjson.dumps(convo(4))
    parsed, as_written = known.loads_checked(grown, "s")
    assert as_written and parsed == orjson.loads(grown) and known.items_reused == 3
    tail = grown[:-1]
    for written_otherwise in [tail + b',"stop": null}', tail + b',"x":"\\u00e9"}', tail + b',"max_tokens":11}',
                              tail + b',"t":1e5}', tail + b',"t":1.50}', tail + b' }']:
        parsed, as_written = known.loads_checked(written_otherwise, "s")
        assert parsed == orjson.loads(written_otherwise) and not as_written, written_otherwise[-20:]
    parsed, as_written = known.loads_checked(tail + b',"t":1.5}', "s")
    assert as_written and orjson.dumps(parsed) == tail + b',"t":1.5}'


def test_finding_a_marker_outside_the_shared_items_every_way_it_can_lie():
    """Every start and span over a few bodies: a marker straddling the span's start, at the body's first byte,
    right after the span, inside it only."""
    from polar_gym.known_json import _find_outside

    for raw in (b"abab", b"xxabyyab", b"ab", b"babab", b"aXbab"):
        for marker in (b"a", b"ab", b"bab"):
            for start in range(len(raw) + 1):
                for skip_from in range(len(raw) + 1):
                    for skip_to in range(skip_from, len(raw) + 1):
                        expected = next((at for at in range(start, len(raw)) if raw.startswith(marker, at)
                                         and not skip_from <= at < skip_to), -1)
                        got = _find_outside(raw, marker, start, skip_from, skip_to)
                        assert got == expected, (raw, marker, start, skip_from, skip_to)


def test_known_values_as_fragments_leave_the_body_given_alone():
    """``as_fragments`` swaps a known value for its JSON in a copy (the body given is the caller's), and hands back
    the body itself when it holds none."""
    known = KnownValues(min_bytes=64)
    raw = orjson.dumps(body())
    parsed = known.loads(raw)
    fragments = known.as_fragments(parsed)
    assert fragments is not parsed and isinstance(fragments["tools"], orjson.Fragment)
    assert isinstance(fragments["system"], orjson.Fragment) and fragments["model"] == "m"
    assert parsed["tools"] is known.loads(raw)["tools"] and isinstance(parsed["tools"], list)  # unchanged
    assert orjson.dumps(fragments) == raw
    plain = {"model": "m", "tools": [{"name": "t"}]}
    assert known.as_fragments(plain) is plain
    derived = known.derive(parsed["tools"], "renamed", lambda tools: [{**tool, "name": "x"} for tool in tools])
    upstream = known.as_fragments({"tools": derived})  # a derived value's JSON, made on first use
    assert isinstance(upstream["tools"], orjson.Fragment) and orjson.dumps(upstream) == orjson.dumps({"tools": derived})


def test_what_is_derived_is_known_in_turn_down_to_a_tuples_lists_items():
    """A derived result is known, and so are the items of a tuple it is and the items of a list in that tuple (a
    translation's messages beside its notes); the items of a list derived alone are not (each would be an entry
    kept for nothing)."""
    known = KnownValues(min_bytes=64)
    value = known.loads(orjson.dumps(body()))["tools"]
    alone = known.derive(value, "alone", lambda v: [{"a": 1}, {"b": 2}])
    paired = known.derive(value, "paired", lambda v: ([{"a": 1}], ["a note"], ({"c": 3},)))
    assert known.known(alone) and not any(known.known(item) for item in alone)
    assert known.known(paired) and known.known(paired[0]) and known.known(paired[0][0])
    assert known.known(paired[2]) and known.known(paired[2][0])


def test_a_sessions_fields_are_found_in_its_last_bodys_order_and_in_any_other():
    """Each repeated field is looked for after the one before it (the last body's order: a field behind a 30 KB
    system prompt is not searched for through it), and found as well when the next body sends them in another
    order."""
    known = KnownValues(min_bytes=64)
    first = {"model": "m", "messages": [turn(0), turn(1)], "system": SYSTEM, "tools": TOOLS}
    taught = known.loads(orjson.dumps(first), "s")
    again = known.loads(orjson.dumps({**first, "messages": [turn(0), turn(1), turn(2)]}), "s")
    assert again["system"] is taught["system"] and again["tools"] is taught["tools"]
    swapped = {"model": "m", "messages": [turn(0), turn(1), turn(2), turn(3)], "tools": TOOLS, "system": SYSTEM}
    raw = orjson.dumps(swapped)
    parsed = known.loads(raw, "s")
    assert parsed == orjson.loads(raw) and list(parsed) == list(swapped)
    assert parsed["system"] is taught["system"] and parsed["tools"] is taught["tools"]
