"""Known values (polar_gym.known_json): a body holding the tools a harness sent before is parsed without them, and
gives exactly what parsing it whole gives; what is derived from them is computed once and never goes stale; every
front end translates and the journal stores such a body exactly as a freshly parsed one; nothing changes them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from polar_gym.journal import SessionStore, decode, decode_received
from polar_gym.known_json import CONVERSATION_FIELDS, KNOWN, REPEATED_FIELDS, KnownValues
from polar_gym.proxy.detect import split_google_path
from polar_gym.proxy.providers.base import Route
from polar_gym.registry import PROVIDERS
from polar_gym.schema import CompletionRecord

TOOLS = [{"name": f"tool_{i}", "description": "d" * 300, "input_schema": {"type": "object", "properties": {
    "tools": {"type": "string"}, "command": {"type": "string", "description": "é ☃ \n\t\"quoted\""}}}}
    for i in range(20)]
SYSTEM = "You are a coding agent. " * 300


def body(**over: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "system": SYSTEM, "tools": TOOLS,
            "max_tokens": 10, **over}


def test_a_repeated_body_parses_to_the_same_value_without_parsing_its_tools_again():
    known = KnownValues()
    raw = orjson.dumps(body())
    first = known.loads(raw)
    assert known.hits == 0 and known.learned == 2  # tools and system
    second = known.loads(orjson.dumps(body(messages=[{"role": "user", "content": "again"}])))
    assert known.hits == 1
    assert second == orjson.loads(orjson.dumps(body(messages=[{"role": "user", "content": "again"}])))
    assert second["tools"] is first["tools"] and second["system"] is first["system"]
    assert known.json_of(second["tools"]) == orjson.dumps(TOOLS)
    assert known.json_of(TOOLS) is None  # equal, but not the known object


def test_bodies_not_written_as_orjson_writes_are_parsed_whole_and_never_learned():
    known = KnownValues()
    spaced = json.dumps(body()).encode()  # ", " and ": " separators, non-ASCII escaped
    assert known.loads(spaced) == json.loads(spaced)
    assert known.loads(spaced) == json.loads(spaced)
    assert known.learned == 0 and known.hits == 0


def test_small_values_are_not_learned():
    known = KnownValues()
    known.loads(orjson.dumps(body(tools=[{"name": "t"}], system="short")))
    assert known.learned == 0


@pytest.mark.parametrize("case", ["nested-first", "duplicate-key-last", "duplicate-key-first", "changed"])
def test_hostile_placements_of_the_known_bytes_parse_as_orjson_parses(case):
    known = KnownValues()
    known.loads(orjson.dumps(body()))
    tools = orjson.dumps(TOOLS).decode()
    other = '[{"name":"other"}]'
    raw = {
        # the same bytes under a nested "tools" key, before the real field (which differs)
        "nested-first": f'{{"meta":{{"tools":{tools}}},"model":"m","messages":[],"tools":{other}}}',
        # two top-level fields: the last one wins, in orjson and here
        "duplicate-key-last": f'{{"tools":{other},"model":"m","tools":{tools}}}',
        "duplicate-key-first": f'{{"tools":{tools},"model":"m","tools":{other}}}',
        # one byte changed inside the tools
        "changed": f'{{"model":"m","tools":{tools.replace("tool_7", "tool_8")}}}',
    }[case].encode()
    assert known.loads(raw) == orjson.loads(raw)


def test_a_malformed_body_raises_as_orjson_does_even_around_known_bytes():
    known = KnownValues()
    known.loads(orjson.dumps(body()))
    raw = b'{"model":"m","tools":' + orjson.dumps(TOOLS) + b',"max_tokens":}'
    with pytest.raises(orjson.JSONDecodeError) as ours:
        known.loads(raw)
    with pytest.raises(orjson.JSONDecodeError) as theirs:
        orjson.loads(raw)
    assert str(ours.value) == str(theirs.value)  # the error's position is the body's own


@given(st.lists(st.sampled_from(["same", "new-tools", "new-message", "spaced", "garbage", "nested"]),
                min_size=1, max_size=12))
def test_any_sequence_of_bodies_parses_as_orjson_parses(steps):
    known = KnownValues(min_bytes=64, max_total=4096, per_field=2)  # tiny bounds: entries come and go
    for i, step in enumerate(steps):
        tools = [{"name": f"t{i if step == 'new-tools' else 0}", "description": "x" * 80}]
        data = {"model": "m", "messages": [{"role": "user", "content": str(i)}], "tools": tools}
        raw = {"spaced": json.dumps(data).encode(), "garbage": orjson.dumps(data)[:-3],
               "nested": orjson.dumps({"x": {"tools": tools}, **data, "tools": "other"})}.get(step, orjson.dumps(data))
        try:
            expected = orjson.loads(raw)
        except orjson.JSONDecodeError:
            with pytest.raises(orjson.JSONDecodeError):
                known.loads(raw)
            continue
        assert known.loads(raw) == expected


def test_derived_values_are_computed_once_per_known_value_and_dropped_with_it():
    known = KnownValues(max_total=2 * len(orjson.dumps(TOOLS)))
    calls: list[int] = []

    def count(value: Any) -> list[int]:
        calls.append(1)
        return [len(value)]

    tools = known.loads(orjson.dumps(body()))["tools"]
    first = known.derive(tools, "count", count)
    assert known.derive(tools, "count", count) is first and len(calls) == 1
    assert known.derive(first, "again", lambda v: [v[0] * 2]) == [40]  # derived from a derived value: kept too
    assert known.derive(first, "again", lambda v: pytest.fail("computed again")) == [40]
    plain = [1, 2]
    assert known.derive(plain, "count", count) == [2] and known.derive(plain, "count", count) == [2]
    assert len(calls) == 3  # a value that is not known is computed every time
    for n in range(3):  # other tools push the first ones out
        known.loads(orjson.dumps(body(tools=[*TOOLS, {"name": f"extra{n}"}])))
    assert not known.known(tools) and not known.known(first)
    assert known.derive(tools, "count", count) == [20] and len(calls) == 4


def test_a_failing_derivation_is_not_kept():
    known = KnownValues()
    tools = known.loads(orjson.dumps(body()))["tools"]
    with pytest.raises(ValueError):
        known.derive(tools, "bad", lambda v: (_ for _ in ()).throw(ValueError("no")))
    assert known.derive(tools, "bad", lambda v: "fine") == "fine"


def test_as_fragments_serializes_to_the_same_bytes():
    known = KnownValues()
    parsed = known.loads(orjson.dumps(body()))
    parsed = known.loads(orjson.dumps(body()))
    fragments = known.as_fragments(parsed)
    assert isinstance(fragments["tools"], orjson.Fragment)
    assert orjson.dumps(fragments) == orjson.dumps(parsed)


# ------------------------------------------------------------------------------------------- the real harnesses

CASES = sorted((Path(__file__).parents[1] / "data" / "harness").glob("*/[0-9][0-9].json"))


def _route(path: str) -> Route:
    bare, _, query = path.partition("?")
    split = split_google_path(bare)
    model, action = split if split is not None else (None, None)
    return Route(bare, model=model, action=action, query=dict(parse_qsl(query)))


@pytest.mark.parametrize("case", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_recorded_harness_bodies_translate_and_journal_the_same_through_known_values(case):
    recorded = json.loads(case.read_text())
    raw = orjson.dumps(recorded["body"])
    provider, route = PROVIDERS.get(recorded["provider"])(), _route(recorded["path"])
    fresh = provider.parse(orjson.loads(raw), route)
    scope = f"recorded-{case.parent.name}-{case.stem}"
    KNOWN.loads(raw, scope)
    bodies = [KNOWN.loads(raw, scope) for _ in range(3)]
    shared = {key for key, value in bodies[-1].items() if KNOWN.known(value)}
    large = {key for key in REPEATED_FIELDS if len(orjson.dumps(recorded["body"].get(key))) >= KNOWN.min_bytes}
    assert shared == large  # every large repeated field is known (each recorded body is compact JSON)
    store, plain_store = SessionStore(), SessionStore()
    chunks: list[bytes] = []
    all_tokens = all_logprobs = b""
    for i, parsed in enumerate(bodies):
        inbound = provider.parse(parsed, route)
        assert inbound.chat.dump() == fresh.chat.dump()
        assert inbound.normalizations == fresh.normalizations
        assert orjson.dumps(inbound.chat.dump()) == orjson.dumps(fresh.chat.dump())  # key order too
        rec: dict[str, Any] = {"completion_id": f"c{i}", "session_id": "s", "index": i, "provider": provider.name,
                               "engine": "vllm", "started_at": 0.0, "prompt_ids": [1, 2, 3], "response_ids": [4],
                               "response_logprobs": [-0.5]}
        lines, tokens, logprobs = store.encode(CompletionRecord(**rec, request=parsed,
                                                                normalized_request=inbound.chat.dump()), raw)
        plain = plain_store.encode(CompletionRecord(**rec, request=orjson.loads(raw),
                                                    normalized_request=fresh.chat.dump()), raw)
        assert (lines, tokens, logprobs) == plain  # the journal stores the same bytes
        chunks.append(lines)
        all_tokens, all_logprobs = all_tokens + tokens, all_logprobs + logprobs
        assert decode_received(chunks, all_tokens, all_logprobs)[-1] == raw
        assert decode(chunks, all_tokens, all_logprobs)[-1].request == orjson.loads(raw)
    for key in shared:  # translating and journaling changed nothing shared
        assert orjson.dumps(bodies[-1][key]) == KNOWN.json_of(bodies[-1][key])
    name = next((n for n in CONVERSATION_FIELDS if isinstance(bodies[-1].get(n), list)), None)
    if name is not None:  # nor any of the conversation's items the three calls shared
        if len(orjson.dumps(bodies[-1][name])) >= KNOWN.min_conversation_bytes:  # kept: its items were shared
            assert all(a is b for a, b in zip(bodies[0][name], bodies[-1][name], strict=True))
        assert orjson.dumps(bodies[-1][name]) == orjson.dumps(orjson.loads(raw)[name])
    KNOWN.forget(scope)


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


# -------------------------------------------------------------------------- bounds, and what mutation testing found


def tools_of(n: int, size: int = 200) -> list[dict[str, Any]]:
    """A tools list ``n`` tells apart, of ``size`` bytes of JSON."""
    return [{"name": f"t{n}", "description": "x" * (size - len(orjson.dumps([{"name": f"t{n}", "description": ""}])))}]


def test_a_known_field_is_found_after_a_nested_key_of_the_same_name():
    known = KnownValues(min_bytes=64)
    known.loads(orjson.dumps({"tools": tools_of(1)}))
    raw = orjson.dumps({"meta": {"tools": ["something else"]}, "tools": tools_of(1)})
    assert known.loads(raw) == orjson.loads(raw) and known.hits == 1


def test_a_match_inside_another_match_gives_way_to_the_outer_one():
    """The tools hold a nested "system" key whose value is the known system prompt's bytes, before the real field:
    the tools' match (the outer one) is kept, the nested one dropped, and the body still parses without either."""
    known = KnownValues(min_bytes=64)
    system = "s" * 100
    tools = [{"name": "t", "input_schema": {"system": system}, "description": "x" * 100}]
    known.loads(orjson.dumps({"tools": tools, "system": system}))
    raw = orjson.dumps({"tools": tools, "system": system, "model": "m"})
    assert known.loads(raw) == orjson.loads(raw)
    assert known.hits == 1


def test_the_least_recently_used_value_is_forgotten_first():
    size = len(orjson.dumps(tools_of(0)))
    known = KnownValues(min_bytes=64, max_total=2 * size, per_field=8)
    a = known.loads(orjson.dumps({"tools": tools_of(0)}))["tools"]
    known.loads(orjson.dumps({"tools": tools_of(1)}))
    assert known.loads(orjson.dumps({"tools": tools_of(0)}))["tools"] is a  # used again: the newest
    known.loads(orjson.dumps({"tools": tools_of(2)}))  # over the bound: the oldest unused (tools 1) goes
    assert known.known(a) and known.loads(orjson.dumps({"tools": tools_of(0)}))["tools"] is a
    hits = known.hits
    known.loads(orjson.dumps({"tools": tools_of(1)}))
    assert known.hits == hits  # forgotten: parsed whole


def test_values_exactly_at_the_bounds_are_learned_and_fill_the_total_exactly():
    size = len(orjson.dumps(tools_of(0)))
    known = KnownValues(min_bytes=size, max_bytes=size, max_total=2 * size, per_field=8)
    a = known.loads(orjson.dumps({"tools": tools_of(0)}))["tools"]
    b = known.loads(orjson.dumps({"tools": tools_of(1)}))["tools"]
    assert known.learned == 2 and known.known(a) and known.known(b)  # 2 x size is not over 2 x size
    known.loads(orjson.dumps({"tools": tools_of(2, size + 1)}))
    known.loads(orjson.dumps({"tools": tools_of(3, size - 1)}))
    assert known.learned == 2  # one byte over max_bytes, one under min_bytes


def test_each_field_keeps_its_newest_values_and_gives_their_room_back():
    size = len(orjson.dumps(tools_of(0)))
    known = KnownValues(min_bytes=64, max_total=2 * size, per_field=1)
    seen = [known.loads(orjson.dumps({"tools": tools_of(n)}))["tools"] for n in range(4)]
    assert [known.known(v) for v in seen] == [False, False, False, True]  # one per field, the newest
    known = KnownValues(min_bytes=64, per_field=2)
    seen = [known.loads(orjson.dumps({"tools": tools_of(n)}))["tools"] for n in range(3)]
    assert [known.known(v) for v in seen] == [False, True, True]


def test_the_default_bounds():
    known = KnownValues()
    small = known.loads(orjson.dumps({"tools": tools_of(0, 4095)}))["tools"]
    large = known.loads(orjson.dumps({"tools": tools_of(1, 4096)}))["tools"]
    assert len(orjson.dumps(small)) == 4095 and not known.known(small) and known.known(large)
    seen = [known.loads(orjson.dumps({"tools": tools_of(n, 5000)}))["tools"] for n in range(2, 7)]
    assert [known.known(v) for v in seen] == [False, True, True, True, True]  # four a field


def test_clear_forgets_everything():
    known = KnownValues(min_bytes=64)
    tools = known.loads(orjson.dumps({"tools": tools_of(0)}))["tools"]
    derived = known.derive(tools, "k", lambda v: [len(v)])
    known.clear()
    assert not known.known(tools) and not known.known(derived)
    assert known.loads(orjson.dumps({"tools": tools_of(0)}))["tools"] is not tools and known.hits == 0
    assert known.learned == 2  # learned again


def test_derived_values_have_json_and_scalars_are_never_known():
    known = KnownValues(min_bytes=64)
    tools = known.loads(orjson.dumps({"tools": tools_of(0)}))["tools"]
    names = known.derive(tools, "names", lambda v: [t["name"] for t in v])
    assert known.json_of(names) == b'["t0"]' and known.json_of(names) is known.json_of(names)
    assert known.derive(tools, "count", len) == 1 and not known.known(1)
    assert known.derive(tools, "pair", lambda v: (len(v), "t")) == (1, "t") and not known.known("t")
    model = known.derive(tools, "model", lambda v: {object()})  # not JSON data: no JSON
    assert known.known(model) and known.json_of(model) is None


def test_what_is_derived_from_a_derived_value_goes_with_its_root():
    size = len(orjson.dumps(tools_of(0)))
    known = KnownValues(min_bytes=64, max_total=size + 100, per_field=8)
    instructions = {"instructions": "i" * 70}
    other = known.loads(orjson.dumps(instructions))["instructions"]  # another root, older
    tools = known.loads(orjson.dumps({"tools": tools_of(0)}))["tools"]
    child = known.derive(tools, "child", lambda v: [1])
    grandchild = known.derive(child, "grandchild", lambda v: [2])
    assert known.known(grandchild)
    assert known.loads(orjson.dumps(instructions))["instructions"] is other  # used again: tools are the oldest
    known.loads(orjson.dumps({"tools": tools_of(1)}))  # pushes the tools out, and all derived from them
    assert not known.known(tools) and not known.known(child) and not known.known(grandchild)
    assert known.known(other)


def test_the_default_size_bounds():
    """At most 1 MiB a value and 8 MiB in all (the newest kept)."""
    mib = 1024 * 1024
    known = KnownValues(fields=("tools", "system", "instructions"))
    largest = known.loads(orjson.dumps({"tools": tools_of(0, mib)}))["tools"]
    too_large = known.loads(orjson.dumps({"system": tools_of(1, mib + 1)}))["system"]
    assert known.known(largest) and not known.known(too_large)
    values = [known.loads(orjson.dumps({field: tools_of(n, mib)}))[field]
              for n, field in enumerate(["system"] * 4 + ["instructions"] * 3, start=2)]
    assert known.known(largest) and all(known.known(v) for v in values)  # 8 x 1 MiB: 8 MiB, not over
    known.loads(orjson.dumps({"instructions": tools_of(9, 4096)}))
    assert not known.known(largest) and all(known.known(v) for v in values)


def test_a_value_a_field_pushed_out_no_longer_counts_against_the_total():
    size = len(orjson.dumps(tools_of(0)))
    known = KnownValues(min_bytes=64, max_total=2 * size, per_field=1)
    for n in range(3):
        known.loads(orjson.dumps({"tools": tools_of(n)}))  # each pushes the one before out of its field
    last = known.loads(orjson.dumps({"tools": tools_of(2)}))["tools"]
    known.loads(orjson.dumps({"system": tools_of(3)}))
    assert known.known(last)  # size + size: within the total
    known.loads(orjson.dumps({"system": tools_of(4, 2 * size)}))  # its own field's one goes; still over: tools too
    assert not known.known(last)


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
                                           "forget"]), st.integers(0, 7), st.sampled_from(["s", "t"])),
                min_size=1, max_size=14))
def test_any_sequence_of_conversations_parses_as_orjson_parses(steps):
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
               "nested": orjson.dumps({"x": {"messages": messages[:2]}, **data})}.get(step, orjson.dumps(data))
        try:
            expected = orjson.loads(raw)
        except orjson.JSONDecodeError:
            with pytest.raises(orjson.JSONDecodeError):
                known.loads(raw, scope)
            continue
        assert known.loads(raw, scope) == expected
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
