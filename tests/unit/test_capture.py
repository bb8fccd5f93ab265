"""The capture journal reads back exactly, shares prefixes, survives restarts and torn writes, and keeps order."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_gym.journal import common_prefix, read_session
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.schema import CompletionRecord
from tests._fakes import disk_full
from tests._waiting import until


def record(session: str, prompt: list[int], response: list[int],
           messages: list[dict] | None = None) -> CompletionRecord:
    messages = messages or [{"role": "user", "content": str(len(prompt))}]
    return CompletionRecord(
        completion_id=f"c{len(prompt)}-{len(response)}", session_id=session, index=-1, provider="anthropic",
        engine="oracle", request={"model": "m", "messages": messages, "max_tokens": 5},
        normalized_request={"model": "m", "messages": messages}, prompt_ids=prompt, response_ids=response,
        response_logprobs=[-0.25 * (i % 5) - 1e-9 * i for i in range(len(response))], finish_reason="stop",
    )


def test_common_prefix():
    from array import array

    a, b = array("I", [1, 2, 3, 4]).tobytes(), array("I", [1, 2, 9]).tobytes()
    assert common_prefix(a, b) == 2
    assert common_prefix(a, a) == 4
    assert common_prefix(b"", a) == 0
    assert common_prefix(array("I", [1, 2]).tobytes(), a) == 2
    # tokens that differ only in a high byte are still different tokens
    assert common_prefix(array("I", [5, 256 + 7]).tobytes(), array("I", [5, 7]).tobytes()) == 1


def conversation(turns: int, seed: int = 0) -> list[CompletionRecord]:
    """An append-only chat: each prompt is the previous prompt + response + a new user tail."""
    rng = random.Random(seed)
    out, prompt, messages = [], [rng.randrange(150000) for _ in range(50)], [{"role": "system", "content": "s"}]
    for turn in range(turns):
        messages = [*messages, {"role": "user", "content": f"turn {turn}"}]
        response = [rng.randrange(150000) for _ in range(rng.randrange(1, 30))]
        out.append(record("chat", list(prompt), response, messages))
        messages = [*messages, {"role": "assistant", "content": f"answer {turn}"}]
        prompt = prompt + response + [rng.randrange(150000) for _ in range(rng.randrange(1, 20))]
    return out


@pytest.mark.parametrize("on_disk", [False, True])
async def test_reads_back_exactly(tmp_path: Path, on_disk: bool):
    journal = CaptureJournal(tmp_path if on_disk else None)
    originals = conversation(30)
    for rec in originals:
        await journal.append(rec.model_copy(deep=True))
    back = await journal.records("chat")
    assert [r.index for r in back] == list(range(30))
    for orig, got in zip(originals, back, strict=True):
        assert got.model_dump(exclude={"index"}) == orig.model_dump(exclude={"index"})
    journal.close()


async def test_storage_grows_with_unique_tokens(tmp_path: Path):
    journal = CaptureJournal(tmp_path)
    records = conversation(200, seed=1)
    for rec in records:
        await journal.append(rec)
    unique = len(records[-1].prompt_ids) + len(records[-1].response_ids)
    naive = sum(len(r.prompt_ids) + len(r.response_ids) for r in records)
    token_bytes = (tmp_path / "chat" / "tokens.bin").stat().st_size
    assert token_bytes == 4 * unique  # every token stored once
    assert naive > 50 * unique  # what a per-call copy would have cost
    journal.close()


async def test_branches_and_retries_share_what_they_can(tmp_path: Path):
    journal = CaptureJournal(tmp_path)
    base = list(range(1000))
    await journal.append(record("b", base, [5000, 5001]))
    await journal.append(record("b", base, [6000]))  # a retry of the same prompt
    await journal.append(record("b", [*base, 5000, 5001, 7], [8]))  # continues the first attempt
    await journal.append(record("b", [42, 43], [44]))  # a sub-agent with its own prompt
    back = await journal.records("b")
    assert [r.prompt_ids for r in back] == [base, base, [*base, 5000, 5001, 7], [42, 43]]
    assert (tmp_path / "b" / "tokens.bin").stat().st_size == 4 * (1000 + 2 + 1 + 1 + 1 + 2 + 1)
    journal.close()


async def test_restart_resumes_the_journal(tmp_path: Path):
    records = conversation(6)
    first = CaptureJournal(tmp_path)
    for rec in records[:3]:
        await first.append(rec)
    first.close()
    second = CaptureJournal(tmp_path)
    for rec in records[3:]:
        await second.append(rec)
    back = await second.records("chat")
    assert [r.index for r in back] == list(range(6))
    assert [r.prompt_ids for r in back] == [r.prompt_ids for r in records]
    second.close()


async def test_torn_tail_loses_only_the_unfinished_record(tmp_path: Path):
    journal = CaptureJournal(tmp_path)
    for rec in conversation(4):
        await journal.append(rec)
    journal.close()
    tokens = tmp_path / "chat" / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:-4])  # the last record's binary data is incomplete
    back = read_session(tmp_path / "chat")
    assert [r.index for r in back] == [0, 1, 2]


async def test_concurrent_appends_keep_order_and_lose_nothing(tmp_path: Path):
    journal = CaptureJournal(tmp_path, max_pending=2)
    recs = [record("c", [i, i + 1], [i]) for i in range(60)]
    await asyncio.gather(*(journal.append(r) for r in recs))
    back = await journal.records("c")
    assert [r.index for r in back] == list(range(60))
    assert sorted(r.prompt_ids[0] for r in back) == list(range(60))
    journal.close()


async def test_session_ids_are_safe_directory_names(tmp_path: Path):
    journal = CaptureJournal(tmp_path)
    await journal.append(record("../escape", [1], [2]))
    assert not (tmp_path.parent / "escape").exists()
    assert (await journal.records("../escape"))[0].session_id == "../escape"
    journal.close()


prompts = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.integers(0, 10), prompts, prompts), min_size=1, max_size=12))
def test_any_branching_history_reads_back(steps):
    """Prompts built by extending or truncating any earlier record read back exactly."""

    async def run() -> None:
        journal = CaptureJournal()
        fulls: list[list[int]] = []
        originals = []
        for pick, tail, response in steps:
            base = fulls[pick % len(fulls)][: len(tail) * 3] if fulls else []
            rec = record("h", base + tail, response)
            originals.append(rec.model_copy(deep=True))
            await journal.append(rec)
            fulls.append(rec.prompt_ids + rec.response_ids)
        back = await journal.records("h")
        assert [(r.prompt_ids, r.response_ids, r.response_logprobs) for r in back] == [
            (r.prompt_ids, r.response_ids, r.response_logprobs) for r in originals]

    asyncio.run(run())


# -- issue 18 (blobs through the writer) and issue 20 (journal codec gaps) ---------------------------------------

def agent_turns(session: str, turns: int) -> list[CompletionRecord]:
    """A growing agent conversation whose every call carries the same large tool list and system prompt."""
    tools = [{"name": f"tool{i}", "description": "does a thing " * 50} for i in range(4)]
    out, messages = [], [{"role": "user", "content": "start " * 80}]
    for turn in range(turns):
        rec = record(session, list(range(10 + turn)), [turn], list(messages))
        rec.request.update(system="be brief " * 100, tools=tools)
        rec.normalized_request["tools"] = tools
        out.append(rec)
        messages = [*messages, {"role": "assistant", "content": f"answer {turn} " * 30}]
    return out


async def test_a_reopened_stream_with_blobs_keeps_storing_each_thing_once(tmp_path: Path):
    recs = agent_turns("a", 6)
    journal = CaptureJournal(tmp_path)
    for rec in recs[:3]:
        await journal.append(rec.model_copy(deep=True))
    journal.close()
    lines_before = (tmp_path / "a" / "records.jsonl").read_bytes()
    reopened = CaptureJournal(tmp_path)  # a restarted proxy: the encoder state comes back from disk
    for rec in recs[3:]:
        await reopened.append(rec.model_copy(deep=True))
    added = (tmp_path / "a" / "records.jsonl").read_bytes()[len(lines_before):]
    assert b"does a thing" not in added and b"be brief" not in added
    back = await reopened.records("a")
    assert [r.model_dump(exclude={"index"}) for r in back] == [r.model_dump(exclude={"index"}) for r in recs]
    reopened.close()


async def test_stored_bytes_is_the_same_in_memory_and_on_disk(tmp_path: Path):
    memory, disk = CaptureJournal(), CaptureJournal(tmp_path)
    for rec in agent_turns("b", 5):
        await memory.append(rec.model_copy(deep=True))
        await disk.append(rec.model_copy(deep=True))
    on_disk = sum(p.stat().st_size for p in (tmp_path / "b").iterdir())
    assert memory.stored_bytes("b") == disk.stored_bytes("b") == on_disk > 0
    disk.release("b")
    assert disk.stored_bytes("b") == on_disk  # read from the files once the stream left memory
    disk.close()


async def test_a_torn_partial_value_at_the_end_of_the_binary_files_is_cut(tmp_path: Path):
    journal = CaptureJournal(tmp_path)
    first = record("t", [1, 2, 3], [4, 5])
    await journal.append(first.model_copy(deep=True))
    journal.close()
    for name, junk in (("tokens.bin", b"\x07\x07"), ("logprobs.bin", b"\x01\x02\x03")):
        path = tmp_path / "t" / name
        path.write_bytes(path.read_bytes() + junk)  # a crash mid-value
    assert [r.response_ids for r in read_session(tmp_path / "t")] == [[4, 5]]
    reopened = CaptureJournal(tmp_path)
    second = record("t", [1, 2, 3, 4, 5, 6], [7, 8, 9])
    await reopened.append(second.model_copy(deep=True))
    back = await reopened.records("t")
    assert [(r.prompt_ids, r.response_ids, r.response_logprobs) for r in back] == [
        (r.prompt_ids, r.response_ids, r.response_logprobs) for r in (first, second)]
    reopened.close()


async def test_a_failing_write_reaches_the_request_and_the_stream_recovers(tmp_path: Path):
    journal = CaptureJournal(tmp_path)
    await journal.append(record("f", [1, 2], [3]))
    blocker = tmp_path / "f" / "tokens.bin"
    blocker.unlink()
    blocker.mkdir()  # opening the file now fails, as a full or read-only disk would
    with pytest.raises(OSError):
        await asyncio.wait_for(journal.append(record("f", [1, 2, 3, 4], [5])), 10)
    blocker.rmdir()
    (tmp_path / "f" / "tokens.bin").write_bytes(b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00")
    await journal.append(record("f", [1, 2, 3, 6], [7]))  # the encoder reloaded from disk: offsets stay right
    back = await journal.records("f")
    assert [(r.index, r.prompt_ids, r.response_ids) for r in back] == [(0, [1, 2], [3]), (1, [1, 2, 3, 6], [7])]
    journal.close()
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.wait_for(journal.append(record("f", [1], [2])), 10)  # never waits forever


async def test_a_call_whose_journal_write_fails_gets_an_error_answer_not_a_hang(tmp_path: Path):
    """Through the proxy: the harness hears of a journal that cannot be written (in its own error shape) at once,
    and once the disk is back the next call is journaled with the request exactly as it was sent."""
    import httpx
    import orjson

    from polar_gym.journal import read_received
    from polar_gym.proxy.app import create_app
    from tests._serving import oracle_service

    service = oracle_service(tmp_path)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(create_app(service, "admin")), base_url="http://proxy")
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"authorization": "Bearer w", "content-type": "application/json"}
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "tokens.bin").mkdir()  # the journal's file cannot be opened
    resp = await asyncio.wait_for(client.post("/v1/chat/completions", content=orjson.dumps(body), headers=headers),
                                  30)
    assert resp.status_code >= 500 and "error" in resp.json()
    (tmp_path / "w" / "tokens.bin").rmdir()
    sent = b'{"model": "policy", "messages": [{"role": "user", "content": "again"}]}'
    assert (await client.post("/v1/chat/completions", content=sent, headers=headers)).status_code == 200
    assert read_received(tmp_path / "w") == [sent]
    await client.aclose()
    service.journal.close()


async def test_the_writer_keeps_a_bounded_number_of_files_open(tmp_path: Path):
    """The writer keeps the files of the streams it wrote last open between calls; 100 streams never hold more
    than its bound, and closing the journal closes them all."""

    def open_fds() -> int:
        try:
            return len(os.listdir("/proc/self/fd"))
        except FileNotFoundError:
            pytest.skip("needs /proc to count open descriptors")

    before = open_fds()
    journal = CaptureJournal(tmp_path)
    for n in range(100):
        await journal.append(record(f"s{n}", [1, 2, n], [3]))
    held = open_fds() - before
    assert 3 <= held <= 3 * 64 + 8  # the writer thread's descriptors, bounded (a few for the thread itself)
    journal.close()
    assert open_fds() - before <= 8
    assert [r.prompt_ids for r in await CaptureJournal(tmp_path).records("s99")] == [[1, 2, 99]]


async def test_a_stream_whose_files_were_removed_is_written_to_fresh_files_not_lost(tmp_path: Path):
    """Files kept open must not swallow records once someone removes them (an operator clearing a session): the
    next record goes to new files on disk, as it did when every write reopened them."""
    import shutil

    journal = CaptureJournal(tmp_path)
    await journal.append(record("gone", [1, 2], [3]))
    shutil.rmtree(tmp_path / "gone")
    await journal.append(record("gone", [7, 8, 9], [4]))
    assert b'"completion_id":"c3-1"' in (tmp_path / "gone" / "records.jsonl").read_bytes()
    assert (tmp_path / "gone" / "tokens.bin").stat().st_size > 0
    journal.close()


@pytest.mark.parametrize("fsync", [False, True])
async def test_appends_to_open_files_skip_the_writer_thread_unless_fsync_is_asked(tmp_path: Path, monkeypatch,
                                                                                   fsync: bool):
    from polar_gym.proxy import capture

    handed: list[int] = []
    submit, submit_nowait = capture._Writer.submit, capture._Writer.submit_nowait

    async def counted(self: capture._Writer, job: Any) -> None:
        handed.append(1)
        await submit(self, job)

    def counted_nowait(self: capture._Writer, job: Any) -> Any:
        handed.append(1)
        return submit_nowait(self, job)

    monkeypatch.setattr(capture._Writer, "submit", counted)
    monkeypatch.setattr(capture._Writer, "submit_nowait", counted_nowait)
    journal = CaptureJournal(tmp_path, fsync=fsync)
    originals = conversation(6)
    for rec in originals:
        await journal.append(rec.model_copy(deep=True))
    assert len(handed) == (6 if fsync else 1)  # the first opens the files (thread); the others append on the loop
    back = await CaptureJournal(tmp_path).records("chat")
    assert [r.prompt_ids for r in back] == [r.prompt_ids for r in originals]
    journal.close()


async def test_a_failing_append_on_the_loop_reaches_the_call_and_the_stream_recovers(tmp_path: Path, monkeypatch):
    from polar_gym.proxy import capture

    journal = CaptureJournal(tmp_path)
    first, second, third = conversation(3)
    await journal.append(first.model_copy(deep=True))
    real_append = capture._append
    monkeypatch.setattr(capture, "_append", disk_full(torn=3))  # a torn token write, then the disk is full
    with pytest.raises(OSError, match="No space"):
        await journal.append(second.model_copy(deep=True))
    monkeypatch.setattr(capture, "_append", real_append)
    await journal.append(third.model_copy(deep=True))  # reloaded from disk: the torn bytes are cut
    back = await CaptureJournal(tmp_path).records("chat")
    assert [(r.index, r.prompt_ids) for r in back] == [(0, first.prompt_ids), (1, third.prompt_ids)]
    journal.close()


@pytest.mark.parametrize("on_disk", [False, True])
async def test_an_edited_history_reads_back_as_sent(tmp_path: Path, on_disk: bool):
    """A harness that edits a message in the middle (``[s, a, b]`` then ``[s, EDITED, b]``) shares only ``[s]``:
    a prefix count that skipped the differing message would read the second call back as ``[s, a, b]``."""
    journal = CaptureJournal(tmp_path if on_disk else None)
    s, b = {"role": "system", "content": "s"}, {"role": "user", "content": "b"}
    sent = [record("e", [1, 2], [3], [s, {"role": "user", "content": "a"}, b]),
            record("e", [1, 2, 9], [4], [s, {"role": "user", "content": "EDITED"}, b])]
    for rec in sent:
        await journal.append(rec.model_copy(deep=True))
    back = await journal.records("e")
    assert [r.request["messages"] for r in back] == [r.request["messages"] for r in sent]
    assert [r.normalized_request["messages"] for r in back] == [r.normalized_request["messages"] for r in sent]
    if on_disk:
        assert [r.request["messages"] for r in read_session(tmp_path / "e")] == [r.request["messages"] for r in sent]
    journal.close()


async def test_records_share_their_common_messages_instead_of_storing_them_again(tmp_path: Path):
    """The storage saving the journal promises: a long conversation that grows call after call costs about its
    unique messages, and a record reuses the earlier one's list (no message is written twice)."""
    journal = CaptureJournal(tmp_path)
    messages: list[dict[str, Any]] = []
    for turn in range(8):
        messages = [*messages, {"role": "user", "content": f"question {turn} " + "x" * 40}]
        await journal.append(record("m", list(range(10 + turn)), [turn], list(messages)))
        messages = [*messages, {"role": "assistant", "content": f"answer {turn}"}]
    lines = (tmp_path / "m" / "records.jsonl").read_bytes()
    for turn in range(8):  # each message's text is stored once (request and normalized request share it too)
        assert lines.count(f"question {turn} ".encode()) <= 2
    assert journal.stored_bytes("m") == sum(p.stat().st_size for p in (tmp_path / "m").iterdir())
    back = await journal.records("m")
    assert back[-1].request["messages"] == messages[:-1]
    journal.close()


async def test_a_session_on_disk_but_not_loaded_reads_back_after_a_restart(tmp_path: Path):
    originals = conversation(5)
    journal = CaptureJournal(tmp_path)
    for rec in originals:
        await journal.append(rec.model_copy(deep=True))
    size = journal.stored_bytes("chat")
    journal.close()
    restarted = CaptureJournal(tmp_path)  # nothing loaded: the session is read from its files
    assert restarted.stored_bytes("chat") == size
    back = await restarted.records("chat")
    assert [r.model_dump(exclude={"index"}) for r in back] == [r.model_dump(exclude={"index"}) for r in originals]
    assert [r.index for r in back] == list(range(5))
    restarted.close()


async def test_records_encoded_in_one_loop_iteration_are_written_together_and_in_order(tmp_path: Path, monkeypatch):
    """Group commit: the calls that reach the journal in one loop iteration (one session's and others') are written
    with one write per file per stream, and read back in the order they were numbered."""
    from polar_gym.proxy import capture

    journal = CaptureJournal(tmp_path)
    turns = conversation(13)
    await journal.append(turns[0].model_copy(deep=True))  # opens the files (through the writer thread)
    await journal.append(record("other", [5, 6], [7]))
    writes: list[int] = []
    real_append = capture._append

    def counted(fds: Any, payloads: Any, fsync: bool) -> None:
        writes.append(payloads[2].count(b"\n"))
        real_append(fds, payloads, fsync)

    monkeypatch.setattr(capture, "_append", counted)
    together = [journal.append(rec.model_copy(deep=True)) for rec in turns[1:]]
    together += [journal.append(record("other", [5, 6, 7, 8 + n], [9])) for n in range(4)]
    done = await asyncio.wait_for(asyncio.gather(*together), 60)
    assert [r.index for r in done] == [*range(1, 13), 1, 2, 3, 4]
    assert sorted(writes) == [4, 12]  # one write of each file per stream, for all its records
    back = await CaptureJournal(tmp_path).records("chat")
    assert [(r.index, r.prompt_ids, r.response_ids) for r in back] == [
        (n, r.prompt_ids, r.response_ids) for n, r in enumerate(turns)]
    journal.close()


async def test_a_failing_batch_fails_each_of_its_calls_and_the_stream_recovers(tmp_path: Path, monkeypatch):
    """A batch the disk refuses (torn part-way) is an error for every call in it; the next call reloads the stream
    from disk, cutting the torn part, and goes on from the records written before the batch."""
    from polar_gym.proxy import capture

    journal = CaptureJournal(tmp_path)
    turns = conversation(6)
    await journal.append(turns[0].model_copy(deep=True))
    real_append = capture._append
    monkeypatch.setattr(capture, "_append", disk_full(torn=5))
    failed = await asyncio.wait_for(asyncio.gather(
        *(journal.append(rec.model_copy(deep=True)) for rec in turns[1:5]), return_exceptions=True), 60)
    assert all(isinstance(exc, OSError) and "No space" in str(exc) for exc in failed)
    monkeypatch.setattr(capture, "_append", real_append)
    again = await journal.append(turns[5].model_copy(deep=True))
    assert again.index == 1
    back = await CaptureJournal(tmp_path).records("chat")
    assert [(r.index, r.prompt_ids) for r in back] == [(0, turns[0].prompt_ids), (1, turns[5].prompt_ids)]
    journal.close()


@pytest.mark.parametrize("fails", [False, True])
async def test_calls_queued_behind_a_batch_the_writer_thread_writes_wait_for_it(tmp_path: Path, monkeypatch,
                                                                              fails: bool):
    """A stream whose files are not open yet is written by the writer thread; what its session encodes meanwhile
    waits for that batch and is written after it, in order. When the thread's write fails, the calls queued
    behind it fail too (their records went on from the lost ones) and the stream recovers from disk."""
    import threading

    from polar_gym.proxy import capture

    journal = CaptureJournal(tmp_path)
    turns = conversation(5)
    release = threading.Event()
    real_write = capture._OpenFiles.write

    def slow_write(self: Any, directory: Path, payloads: Any, fsync: bool) -> None:
        release.wait(30)  # the thread holds the first batch until the next calls are queued behind it
        if fails:
            raise OSError(5, "Input/output error")
        real_write(self, directory, payloads, fsync)

    monkeypatch.setattr(capture._OpenFiles, "write", slow_write)
    first = [asyncio.ensure_future(journal.append(turns[0].model_copy(deep=True)))]
    await until(lambda: (s := journal._sessions.get(("chat", None))) is not None and s.inflight is not None,
                what="the first batch to reach the writer thread")
    session = journal._sessions[("chat", None)]
    behind = [asyncio.ensure_future(journal.append(rec.model_copy(deep=True))) for rec in turns[1:4]]
    await until(lambda: len(session.pending) == 3, what="the next calls to queue behind it")
    assert not any(task.done() for task in first + behind)
    release.set()
    results = await asyncio.wait_for(asyncio.gather(*first, *behind, return_exceptions=True), 60)
    monkeypatch.setattr(capture._OpenFiles, "write", real_write)
    if fails:
        assert all(isinstance(r, OSError) for r in results)
        assert (await journal.append(turns[4].model_copy(deep=True))).index == 0
        expected = [turns[4].prompt_ids]
    else:
        assert [r.index for r in results] == [0, 1, 2, 3]  # type: ignore[union-attr]
        expected = [rec.prompt_ids for rec in turns[:4]]
    assert [r.prompt_ids for r in await CaptureJournal(tmp_path).records("chat")] == expected
    journal.close()


async def test_closing_the_journal_writes_what_this_loop_iteration_encoded(tmp_path: Path):
    journal = CaptureJournal(tmp_path)
    await journal.append(record("k", [1, 2], [3]))
    late = asyncio.ensure_future(journal.append(record("k", [1, 2, 3, 4], [5])))
    await asyncio.sleep(0)  # encoded and queued; its batch is due at the end of the loop iteration
    journal.close()
    await asyncio.wait_for(late, 60)
    assert [r.prompt_ids for r in read_session(tmp_path / "k")] == [[1, 2], [1, 2, 3, 4]]


async def test_a_call_cancelled_while_its_record_waits_still_has_it_written(tmp_path: Path):
    """A call cancelled after its record was encoded (its harness gone, the server stopping): the record is written
    all the same, and the stream is held until it is, then let go (never evicted with a record still to write)."""
    journal = CaptureJournal(tmp_path)
    await journal.append(record("a", [1, 2], [3]))
    session = journal._sessions[("a", None)]
    call = asyncio.ensure_future(journal.append(record("a", [1, 2, 3, 4], [5])))
    await asyncio.sleep(0)  # it encodes and queues: its batch is due at the end of the loop iteration
    assert len(session.pending) == 1 and session.users == 1
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(call, 60)
    assert session.users == 0 and not session.pending
    assert [r.prompt_ids for r in read_session(tmp_path / "a")] == [[1, 2], [1, 2, 3, 4]]
    assert (await journal.append(record("a", [1, 2, 3, 4, 5, 6], [7]))).index == 2
    journal.close()
