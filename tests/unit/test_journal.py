"""The journal codec on its own: pure encoding and decoding, the attempt layout, and no dependency on the proxy."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest

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


# -- issue 20: the codec's documented bounds, each at its boundary ----------------------------------------------


def chat(index: int, messages: list, prompt: list[int] | None = None, **fields: object) -> CompletionRecord:
    """A record whose request and normalized request are both ``{"messages": messages}`` (no frame: too small)."""
    return CompletionRecord(completion_id=f"c{index}", session_id="s", index=index, provider="openai_chat",
                            engine="oracle", request={"messages": messages}, normalized_request={"messages": messages},
                            prompt_ids=[index] if prompt is None else prompt, response_ids=[7],
                            response_logprobs=[-0.5], **fields)


def own_line(chunk: bytes) -> dict:
    """The record's own line of an append (the blob lines it needs come before it)."""
    return orjson.loads(chunk.splitlines()[-1])


def blob_lines(chunk: bytes) -> list[bytes]:
    return [line for line in chunk.splitlines() if journal.is_blob_line(line)]


def sized_message(size: int) -> dict:
    """A message of exactly ``size`` serialized bytes."""
    message = {"role": "user", "content": ""}
    message["content"] = "x" * (size - len(orjson.dumps(message)))
    assert len(orjson.dumps(message)) == size
    return message


def test_a_value_of_blob_min_bytes_is_a_blob_and_one_byte_less_stays_in_the_line():
    """The documented threshold: at least 256 serialized bytes is stored once and referred to; below, inline."""
    for size, as_blob in ((255, False), (256, True)):
        rec = chat(0, [sized_message(size)])
        line, tokens, logprobs = SessionStore().encode(rec)
        assert decode([line], tokens, logprobs) == [rec]
        stored = own_line(line)["request"]["messages"]["tail"][0]
        assert len(blob_lines(line)) == int(as_blob)
        inline = rec.request["messages"][0]
        assert stored == ({"$ref": orjson.loads(blob_lines(line)[0])["$blob"]} if as_blob else inline)


def test_a_string_under_a_quarter_of_blob_min_characters_is_inline_without_being_measured():
    """Short strings skip serializing (the common case, kept cheap): under 64 characters a string stays inline even
    when escapes make it longer than 256 bytes; from 64 characters on it is measured like any value."""
    for n, as_blob in ((63, False), (64, True)):
        rec = chat(0, ["\x01" * n])
        assert len(orjson.dumps("\x01" * n)) > journal._BLOB_MIN  # escaped, six bytes a character
        line, tokens, logprobs = SessionStore().encode(rec)
        assert decode([line], tokens, logprobs) == [rec]
        assert len(blob_lines(line)) == int(as_blob)


def test_a_frame_of_frame_min_bytes_is_a_blob_and_one_byte_less_stays_in_the_line():
    """A body's fields but its conversation become one blob (its frame) from 64 serialized bytes on."""
    for size, framed in ((63, False), (64, True)):
        rec = chat(0, [{"role": "user", "content": "hi"}])
        rec.request = {"model": "", "messages": rec.request["messages"]}
        rec.request["model"] = "m" * (size - len(orjson.dumps({"model": "", "messages": None})))
        line, tokens, logprobs = SessionStore().encode(rec)
        assert decode([line], tokens, logprobs) == [rec]
        assert isinstance(own_line(line)["request"], list) == framed
        assert len(blob_lines(line)) == int(framed)


def test_an_encoder_forgets_its_least_recently_used_blob_past_blob_index_and_writes_it_again():
    """A store remembers the hashes of its 512 most recently used blobs: one used again stays known, one pushed out
    is written again when next needed (a few bytes more, never a dangling ref)."""
    kept = long_message(-1)
    store, lines, tokens, logprobs, records = SessionStore(), [], b"", b"", []

    def append(messages: list) -> bool:
        """Whether the append wrote ``kept``'s blob."""
        nonlocal tokens, logprobs
        records.append(chat(len(records), messages))
        line, tok, lp = store.encode(records[-1])
        lines.append(line)
        tokens += tok
        logprobs += lp
        return b"message -1" in line

    assert append([kept])
    for i in range(511):
        append([long_message(i)])
    assert not append([{"role": "user", "content": "again"}, kept])  # 512 blobs known: kept among them, now newest
    append([long_message(10_000)])  # the 513th pushes out the least recently used: not kept, just used
    assert not append([{"role": "user", "content": "and again"}, kept])
    for i in range(512):
        append([long_message(20_000 + i)])
    assert append([{"role": "user", "content": "once more"}, kept])  # 512 newer blobs pushed kept out
    assert decode(lines, tokens, logprobs) == records


def test_a_prompt_shares_tokens_with_a_record_up_to_16_records_back_and_no_further():
    for between, shares in ((15, True), (16, False)):
        records = [chat(0, [], prompt=list(range(1, 9)))]
        records += [chat(i, [], prompt=[100 + i]) for i in range(1, between + 1)]
        records.append(chat(between + 1, [], prompt=[*range(1, 9), 99]))
        lines, tokens, logprobs = encoded(records)
        assert decode(lines, tokens, logprobs) == records
        assert own_line(lines[-1])["prompt_ids"]["keep"] == (8 if shares else 0)


def test_bodies_without_a_conversation_list_mix_with_chats():
    """A completions-style body (a prompt string, no message list) shares no list, and a chat after it still
    shares with the chat before it."""
    plain = chat(1, [])
    plain.request = plain.normalized_request = {"model": "policy", "prompt": "hello"}
    records = [chat(0, [long_message(0)]), plain, chat(2, [long_message(0), long_message(1)])]
    lines, tokens, logprobs = encoded(records)
    assert decode(lines, tokens, logprobs) == records
    assert own_line(lines[2])["request"]["messages"]["$shared"] == {"base": 0, "keep": 1}


def test_blank_lines_in_a_records_file_are_skipped(tmp_path: Path):
    records = [agent_record(0, [long_message(0)]), agent_record(1, [long_message(0), long_message(1)])]
    lines, tokens, logprobs = encoded(records)
    (tmp_path / journal.RECORDS_FILE).write_bytes(b"\n".join([lines[0], b"  ", lines[1], b""]))
    (tmp_path / journal.TOKENS_FILE).write_bytes(tokens)
    (tmp_path / journal.LOGPROBS_FILE).write_bytes(logprobs)
    assert read_session(str(tmp_path)) == records  # a path given as a string reads too
    assert journal.read_received(str(tmp_path)) == [None, None]


def test_every_dialect_names_the_body_it_rebuilds_byte_for_byte():
    """Each serializer a harness may use is recognised (the record names it, no raw copy): a float Python writes
    as 1e-07 and orjson as 1e-7, and a non-ASCII character, tell all five apart."""
    body = {"model": "policy", "temperature": 1e-07, "messages": [{"role": "user", "content": "é"}]}
    forms = {"orjson": orjson.dumps(body), "json": json.dumps(body).encode(),
             "json_compact": json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(),
             "json_compact_ascii": json.dumps(body, separators=(",", ":")).encode(),
             "json_utf8": json.dumps(body, ensure_ascii=False).encode()}
    assert len(set(forms.values())) == len(forms)
    for name, form in forms.items():
        rec = chat(0, body["messages"])
        rec.request = body
        line, tokens, logprobs = SessionStore().encode(rec, form)
        assert own_line(line)["$recv"] == name and not blob_lines(line)
        assert decode_received([line], tokens, logprobs) == [form]


def test_the_dialect_that_matched_last_is_tried_first():
    """A body several serializers write alike (ASCII, no floats) is named after the harness's last known one."""
    unicode_body = {"messages": [{"role": "user", "content": "é"}]}
    ascii_body = {"messages": [{"role": "user", "content": "e"}]}
    store, lines, tokens, logprobs, forms = SessionStore(), [], b"", b"", []
    for i, (body, form, name) in enumerate([
            (ascii_body, orjson.dumps(ascii_body), "orjson"),
            (unicode_body, json.dumps(unicode_body, separators=(",", ":")).encode(), "json_compact_ascii"),
            (ascii_body, orjson.dumps(ascii_body), "json_compact_ascii"),  # the same bytes as orjson's
            (unicode_body, orjson.dumps(unicode_body), "orjson"),
            (ascii_body, orjson.dumps(ascii_body), "orjson")]):
        rec = chat(i, body["messages"])
        line, tok, lp = store.encode(rec, form)
        assert own_line(line)["$recv"] == name
        lines, tokens, logprobs, forms = [*lines, line], tokens + tok, logprobs + lp, [*forms, form]
    assert decode_received(lines, tokens, logprobs) == forms


def counted_hashing(monkeypatch) -> list[int]:
    """The sizes of the values the journal hashes, in order."""
    hashed: list[int] = []

    def sha256(data: bytes) -> hashlib._Hash:
        hashed.append(len(data))
        return hashlib.sha256(data)

    monkeypatch.setattr(journal, "hashlib", SimpleNamespace(sha256=sha256))
    return hashed


def test_the_digest_memo_hashes_a_value_of_min_bytes_once_and_a_smaller_one_every_time(monkeypatch):
    hashed = counted_hashing(monkeypatch)
    memo = journal.DigestMemo()
    large, small = b"a" * 4096, b"b" * 4095
    digests = [memo.digest(v) for v in (large, large, small, small)]
    assert digests == [hashlib.sha256(v).digest()[:16] for v in (large, large, small, small)]
    assert hashed == [4096, 4095, 4095]


@pytest.mark.parametrize(("memo", "entries"), [(journal.DigestMemo(), 32), (SessionStore().memo, 4)],
                         ids=["shared", "a store's own"])
def test_the_digest_memo_remembers_its_last_entries_sizes(monkeypatch, memo: journal.DigestMemo, entries: int):
    """A harness's tools and system prompt, sent on every call, are hashed once while at most ``entries`` other
    large values came since; the oldest is forgotten first (and only hashed again, never misnamed)."""
    hashed = counted_hashing(monkeypatch)
    values = [bytes([65 + i % 26]) * (4096 + i) for i in range(entries + 1)]
    for value in values[:entries]:
        memo.digest(value)
    assert memo.digest(values[0]) == hashlib.sha256(values[0]).digest()[:16]
    assert len(hashed) == entries  # all remembered
    memo.digest(values[entries])
    assert memo.digest(values[0]) == hashlib.sha256(values[0]).digest()[:16]
    assert hashed[-1] == len(values[0])  # pushed out by the newest


def test_a_new_value_of_a_remembered_size_becomes_the_memo_s_newest(monkeypatch):
    hashed = counted_hashing(monkeypatch)
    memo = journal.DigestMemo(entries=2, min_bytes=8)
    first, edited, other, newest = b"A" * 8, b"B" * 8, b"C" * 9, b"D" * 10
    for value in (first, other, edited, newest, edited):
        assert memo.digest(value) == hashlib.sha256(value).digest()[:16]
    assert hashed == [8, 9, 8, 10]  # newest pushed out other, not edited


def test_a_crash_during_the_first_record_leaves_an_empty_stream_that_appends_again(tmp_path: Path):
    """Only the blob lines and tokens of the first record made it (logprobs.bin not even created): everything goes,
    and the next append starts from a clean stream."""
    rec = agent_record(0, [long_message(0)])
    lines, tokens, logprobs = encoded([rec])
    torn = b"".join(line + b"\n" for line in blob_lines(lines[0]))
    assert torn
    (tmp_path / journal.RECORDS_FILE).write_bytes(torn)
    (tmp_path / journal.TOKENS_FILE).write_bytes(tokens)
    assert read_session(tmp_path) == []
    journal.truncate_torn_tail(tmp_path, torn.splitlines(keepends=True), 0, SessionStore())
    assert journal.stored_bytes(tmp_path) == 0 and not (tmp_path / journal.LOGPROBS_FILE).exists()
    with (tmp_path / journal.RECORDS_FILE).open("ab") as f:
        f.write(lines[0])
    (tmp_path / journal.TOKENS_FILE).write_bytes(tokens)
    (tmp_path / journal.LOGPROBS_FILE).write_bytes(logprobs)
    assert read_session(tmp_path) == [rec]
    assert journal.stored_bytes(tmp_path) == len(lines[0]) + len(tokens) + len(logprobs)


def test_attempts_count_records_not_blob_lines_and_a_stream_without_a_pointer_is_current(tmp_path: Path):
    stream = tmp_path / "sess" / ATTEMPTS_DIR / "a1"
    stream.mkdir(parents=True)
    lines, _, _ = encoded([agent_record(0, [long_message(0)]), agent_record(1, [long_message(0), long_message(1)])])
    assert blob_lines(b"".join(lines))
    (stream / journal.RECORDS_FILE).write_bytes(b"".join(lines))
    assert count_attempts(tmp_path / "sess") == {"a1": 2}
    assert is_superseded_attempt(stream) is False  # no current-attempt written yet: nothing newer
    assert is_superseded_attempt(tmp_path / "sess") is False  # not an attempt at all


def test_a_call_log_entry_counts_tokens_drops_bodies_and_cuts_long_errors():
    rec = agent_record(0, [long_message(0)])
    entry = journal.call_log_entry(rec)
    assert entry == {**rec.model_dump(mode="json", exclude={"request", "normalized_request", "response",
                                                            "prompt_ids", "response_ids", "response_logprobs"}),
                     "prompt_tokens": 3, "response_tokens": 1}
    assert entry["error"] is None and json.loads(json.dumps(entry)) == entry
    for length, kept in ((2000, "e" * 2000), (2001, "e" * 2000 + "...")):
        failed = rec.model_copy(update={"status": "error", "error": "e" * length})
        assert journal.call_log_entry(failed)["error"] == kept


def test_a_request_known_to_be_what_orjson_writes_is_journaled_without_serializing_it(monkeypatch):
    """``received_is_orjson`` (proved while the body was parsed): the journal names orjson's form without writing
    the request again to compare, and gives the bytes back as received."""
    body = agent_record(0, [long_message(0), {"role": "user", "content": "é"}]).request
    calls: list[int] = []
    original = journal._DIALECTS["orjson"]
    monkeypatch.setitem(journal._DIALECTS, "orjson", lambda v: calls.append(1) or original(v))
    store = SessionStore()
    line, tokens, logprobs = store.encode(agent_record(0, body["messages"]), orjson.dumps(body), True)
    assert calls == []
    assert decode_received([line], tokens, logprobs) == [orjson.dumps(body)]  # reading serializes it, once
    store.encode(agent_record(1, body["messages"]), orjson.dumps(body))
    assert len(calls) == 2  # not known: compared


def test_a_conversation_is_shared_with_the_record_sharing_most_of_it_not_the_newest():
    """The newest record may share less of a conversation than an older one (a sub-agent's call came between):
    the encoder shares with the one sharing most, so the tail it stores is the shortest."""
    long_history = [long_message(i) for i in range(4)]
    records = [agent_record(0, long_history), agent_record(1, [long_history[0], long_message(9)]),  # a sub-agent's
               agent_record(2, [*long_history, long_message(5)])]
    lines, tokens, logprobs = encoded(records)
    shared = [part[:20] for part in lines[2].splitlines()[-1].split(b'"$shared":')[1:]]
    assert shared == [b'{"base":0,"keep":4},', b'{"base":0,"keep":5},']  # the request's, the normalized one's
    assert decode(lines, tokens, logprobs) == records


PNG_B64 = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8).decode()  # 2 KB of "pixels"
OTHER_B64 = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(range(255, -1, -1)) * 8).decode()


def image_record(index: int, payloads: list[str], extra: list[dict] | None = None) -> CompletionRecord:
    """An Anthropic call with one image per payload, each in a user turn (the bare base64 in the request, a data URL
    in the normalized request), as the proxy records it."""
    request_msgs: list[dict] = [*(extra or [])]
    normalized_msgs: list[dict] = [*(extra or [])]
    for n, payload in enumerate(payloads):
        request_msgs.append({"role": "user", "content": [{"type": "text", "text": f"look {n}"}, {
            "type": "image", "source": {"type": "base64", "media_type": "image/png", "data": payload}}]})
        normalized_msgs.append({"role": "user", "content": [{"type": "text", "text": f"look {n}"}, {
            "type": "image_url", "image_url": {"url": f"data:image/png;base64,{payload}"}}]})
    images = [{"sha256": hashlib.sha256(base64.b64decode(p)).hexdigest(), "media_type": "image/png",
               "size": len(base64.b64decode(p)), "prompt_span": None} for p in payloads]
    return CompletionRecord(completion_id=f"c{index}", session_id="s", index=index, provider="anthropic",
                            engine="oracle", request={"model": "policy", "messages": request_msgs},
                            normalized_request={"model": "policy", "messages": normalized_msgs}, images=images,
                            prompt_ids=[1, 2, index], response_ids=[7], response_logprobs=[-0.5])


def test_an_image_is_stored_once_per_stream_named_by_its_sha256():
    """The request's bare base64 and the normalized data URL are one blob; a later turn that sends the same image
    again in another message (a screenshot re-attached) refers to it."""
    first = image_record(0, [PNG_B64])
    again = image_record(1, [PNG_B64, OTHER_B64, PNG_B64])
    lines, tokens, logprobs = encoded([first, again])
    assert decode(lines, tokens, logprobs) == [first, again]
    stream = b"".join(lines)
    assert stream.count(PNG_B64.encode()) == 1 and stream.count(OTHER_B64.encode()) == 1
    blobs = [orjson.loads(x) for x in stream.splitlines() if journal.is_blob_line(x)]
    images = {b["$blob"]: b["v"] for b in blobs if len(b["$blob"]) == 64}
    assert images == {first.images[0]["sha256"]: PNG_B64, again.images[1]["sha256"]: OTHER_B64}


def test_harness_values_that_read_as_image_places_read_back_as_themselves():
    hostile = [{"role": "user", "content": [{"$img": first_sha, "head": "x"} for first_sha in ("ab" * 32,)]},
               {"$lift": {"role": "user", "content": "hi"}, "$imgs": None},
               {"$lift": {"role": "user", "content": "hi"}, "$imgs": ["ab" * 32]}]
    rec = image_record(0, [PNG_B64], extra=hostile)
    lines, tokens, logprobs = encoded([rec])
    assert decode(lines, tokens, logprobs) == [rec]
