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
