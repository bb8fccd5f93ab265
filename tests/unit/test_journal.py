"""The journal codec on its own: pure encoding and decoding, the attempt layout, and no dependency on the proxy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import orjson

import polar_gym.journal as journal
from polar_gym.journal import (
    ATTEMPTS_DIR,
    CURRENT_ATTEMPT,
    SessionStore,
    count_attempts,
    decode,
    decode_received,
    is_superseded_attempt,
    read_current_attempt,
    read_session,
)
from polar_gym.schema import CompletionRecord


def record(index: int, prompt: list[int], response: list[int]) -> CompletionRecord:
    messages = [{"role": "user", "content": str(i)} for i in range(index + 1)]
    return CompletionRecord(completion_id=f"c{index}", session_id="s", index=index, provider="openai_chat",
                            engine="oracle", request={"messages": messages}, normalized_request={"messages": messages},
                            prompt_ids=prompt, response_ids=response, response_logprobs=[-0.5] * len(response))


def encoded(records: list[CompletionRecord]) -> tuple[list[bytes], bytes, bytes]:
    store, lines, tokens, logprobs = SessionStore(), [], b"", b""
    for rec in records:
        line, tok, lp = store.encode(rec)
        lines.append(line)
        tokens += tok
        logprobs += lp
    return lines, tokens, logprobs


def test_encode_then_decode_is_exact_and_shares_prefixes():
    records = [record(0, [1, 2, 3], [4, 5]), record(1, [1, 2, 3, 4, 5, 6], [7])]
    lines, tokens, logprobs = encoded(records)
    assert decode(lines, tokens, logprobs) == records
    assert len(tokens) // 4 == 3 + 2 + 1 + 1  # the second prompt stored only its new token


def test_decode_stops_at_a_torn_tail():
    records = [record(0, [1, 2], [3]), record(1, [1, 2, 3, 9], [8, 7])]
    lines, tokens, logprobs = encoded(records)
    assert decode(lines, tokens[:-4], logprobs) == records[:1]  # the last line's tokens are missing
    assert decode([lines[0], lines[1][:10]], tokens, logprobs) == records[:1]  # the last line is cut


def test_attempt_layout(tmp_path: Path):
    session = tmp_path / "sess"
    assert read_current_attempt(session) is None and count_attempts(session) == {}
    for attempt, n in (("a1", 2), ("a2", 1)):
        stream = session / ATTEMPTS_DIR / attempt
        stream.mkdir(parents=True)
        lines, tokens, logprobs = encoded([record(i, [1, i], [2]) for i in range(n)])
        (stream / journal.RECORDS_FILE).write_bytes(b"".join(lines))
        (stream / journal.TOKENS_FILE).write_bytes(tokens)
        (stream / journal.LOGPROBS_FILE).write_bytes(logprobs)
    (session / CURRENT_ATTEMPT).write_text("a2\n")
    assert read_current_attempt(session) == "a2"
    assert count_attempts(session) == {"a1": 2, "a2": 1}
    assert is_superseded_attempt(session / ATTEMPTS_DIR / "a1")
    assert not is_superseded_attempt(session / ATTEMPTS_DIR / "a2") and not is_superseded_attempt(session)
    assert len(read_session(session / ATTEMPTS_DIR / "a1")) == 2
    assert journal.stored_bytes(session / ATTEMPTS_DIR / "a2") > 0


def test_reading_journals_never_imports_the_proxy():
    code = ("import sys, polar_gym.journal, polar_gym.merge.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('polar_gym.proxy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- issue 18: each thing stored once, the request as received, old journals ------------------------------------

DATA = Path(__file__).resolve().parents[1] / "data" / "journal"
TOOLS = [{"name": f"tool{i}", "description": "does a thing " * 40, "input_schema": {"type": "object"}}
         for i in range(5)]
SYSTEM = [{"type": "text", "text": "You are an agent. " * 60}]


def agent_record(index: int, messages: list[dict], tools: list[dict] = TOOLS) -> CompletionRecord:
    request = {"model": "policy", "system": SYSTEM, "tools": tools, "messages": messages, "max_tokens": 100}
    normalized = {"model": "policy", "messages": [{"role": "system", "content": SYSTEM[0]["text"]}, *messages],
                  "tools": [{"type": "function", "function": t} for t in tools]}
    return CompletionRecord(completion_id=f"c{index}", session_id="s", index=index, provider="anthropic",
                            engine="oracle", request=request, normalized_request=normalized,
                            prompt_ids=[1, 2, index], response_ids=[7], response_logprobs=[-0.5])


def long_message(n: int) -> dict:
    return {"role": "user", "content": f"message {n}: " + "lorem ipsum " * 40}


def test_tools_and_system_are_stored_once_and_read_back_exactly():
    messages = [long_message(0)]
    records = []
    for i in range(4):
        records.append(agent_record(i, list(messages)))
        messages.append(long_message(i + 1))
    lines, tokens, logprobs = encoded(records)
    assert decode(lines, tokens, logprobs) == records
    once = sum(len(orjson.dumps(v)) for v in (TOOLS, SYSTEM, records[0].normalized_request["tools"]))
    assert len(lines[0]) > once  # the first record carries its blobs
    for line, rec in zip(lines[1:], records[1:], strict=True):
        assert len(line) < len(orjson.dumps(rec.request)) // 3  # later ones refer to them
        assert b"does a thing" not in line and b"You are an agent" not in line


def test_a_message_repeated_without_being_a_prefix_is_not_stored_again():
    """A harness that edits history (drops one early message, compaction): the prefix breaks, the rest is refs."""
    history = [long_message(n) for n in range(6)]
    first, edited = agent_record(0, history), agent_record(1, [history[0], *history[2:]])
    lines, tokens, logprobs = encoded([first, edited])
    assert decode(lines, tokens, logprobs) == [first, edited]
    assert b"lorem ipsum" not in lines[1]


def test_values_that_look_like_references_read_back_as_themselves():
    lookalike = {"$ref": "0" * 32}
    rec = agent_record(0, [{"$shared": {"base": 0, "keep": 1}, "role": "user"}, long_message(1)])
    rec.request["metadata"] = lookalike
    rec.request["input"] = {"$shared": 1}
    lines, tokens, logprobs = encoded([rec])
    assert decode(lines, tokens, logprobs) == [rec]


def test_the_blob_index_is_bounded():
    store = SessionStore()
    for i in range(journal._BLOB_INDEX + 50):
        store.encode(agent_record(i, [long_message(i)], tools=[{"name": f"t{i}", "description": "x" * 300}]))
    assert len(store._blobs) <= journal._BLOB_INDEX


def test_a_torn_record_after_its_blobs_is_cut_with_them(tmp_path: Path):
    records = [agent_record(0, [long_message(0)]), agent_record(1, [long_message(0), long_message(1)])]
    lines, tokens, logprobs = encoded(records)
    blob_lines = [line for line in lines[1].splitlines(keepends=True) if journal.is_blob_line(line)]
    assert blob_lines  # the second record brought its new message as a blob
    torn = [lines[0], *blob_lines]  # the crash hit after the blobs, before the record's own line
    assert decode(torn, tokens, logprobs) == records[:1]
    (tmp_path / journal.RECORDS_FILE).write_bytes(b"".join(torn))
    (tmp_path / journal.TOKENS_FILE).write_bytes(tokens)
    (tmp_path / journal.LOGPROBS_FILE).write_bytes(logprobs)
    store = SessionStore()
    store.encode(records[0])
    journal.truncate_torn_tail(tmp_path, b"".join(torn).splitlines(keepends=True), 1, store)
    assert (tmp_path / journal.RECORDS_FILE).read_bytes() == lines[0]
    assert count_attempts(tmp_path.parent) == {} and read_session(tmp_path) == records[:1]


def test_the_request_as_received_comes_back_byte_for_byte():
    body = agent_record(0, [long_message(0), {"role": "user", "content": "é ü \u2028 \x1f \"q\" 1/2"}]).request
    forms = [orjson.dumps(body), json.dumps(body).encode(), json.dumps(body, indent=2).encode(),
             orjson.dumps(body), None]
    store, lines, tokens, logprobs = SessionStore(), [], b"", b""
    for i, form in enumerate(forms):
        rec = agent_record(i, body["messages"])
        line, tok, lp = store.encode(rec, form)
        lines.append(line)
        tokens += tok
        logprobs += lp
    assert decode_received(lines, tokens, logprobs) == forms
    assert len(lines[3]) < len(forms[3]) // 3  # a known serializer: nothing more stored than the parsed body


def test_a_journal_written_before_blobs_still_reads():
    expected = json.loads((DATA / "v1" / "expected.json").read_text())
    assert [r.model_dump(mode="json") for r in read_session(DATA / "v1")] == expected
    assert journal.read_received(DATA / "v1") == [None] * len(expected)
    assert count_attempts(DATA) == {}


def test_the_digest_memo_names_blobs_by_their_sha256_and_never_confuses_two_values_of_one_size():
    import hashlib

    memo = journal.DigestMemo(entries=2, min_bytes=8)
    tools, other = b'{"tools":[1,2,3]}', b'{"tools":[1,2,4]}'  # the same length, different bytes
    assert len(tools) == len(other)
    for value in (tools, tools, other, tools, b"tiny", b'{"system":"a longer value"}', tools):
        assert memo.digest(value) == hashlib.sha256(value).digest()[:16]
    assert len(memo._known) <= 2


def test_streams_sharing_a_memo_each_hold_every_blob_they_refer_to():
    """The memo only saves hashing: each stream still writes the blobs it refers to, so it reads back alone."""
    memo = journal.DigestMemo(min_bytes=64)
    tools = [{"name": f"tool{i}", "description": "d" * 200} for i in range(5)]
    stores = [SessionStore(memo), SessionStore(memo)]
    for store in stores:
        rec = record(0, [1, 2], [3])
        rec.request = {"tools": tools, "messages": rec.request["messages"]}
        line, tok, lp = store.encode(rec)
        assert decode([line], tok, lp)[0].request["tools"] == tools
