"""The capture journal's dispatch attempts and its bounded memory: each attempt of a gateway session is its own
stream and the latest is what reading the session returns (a restarted gateway included), and the streams held in
memory are bounded (an evicted one reads back from disk, one in use is never evicted). Split from test_capture.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

from polar_gym.proxy.capture import CaptureJournal
from tests.unit.test_capture import conversation, record

# -- issue 11: attempts (fault 8) and bounded memory (fault 9) ---------------------------------------------------

async def test_each_attempt_is_its_own_stream_and_the_latest_is_what_the_session_reads(tmp_path: Path):
    journal = CaptureJournal(tmp_path)
    await journal.begin_attempt("s", "aaaaaaaaaaaa")
    await journal.append(record("s", [1, 2, 3], [4]), "aaaaaaaaaaaa")  # the dead attempt's call
    await journal.begin_attempt("s", "bbbbbbbbbbbb")
    await journal.append(record("s", [1, 2, 3], [5, 6]), "bbbbbbbbbbbb")
    (rec,) = await journal.records("s")
    assert rec.response_ids == [5, 6] and rec.index == 0  # a fresh stream: its own index 0, no mixed-in call
    assert [r.response_ids for r in await journal.records("s", "aaaaaaaaaaaa")] == [[4]]
    assert await journal.attempts("s") == {"aaaaaaaaaaaa": 1, "bbbbbbbbbbbb": 1}
    journal.close()
    restarted = CaptureJournal(tmp_path)  # a new process knows the latest attempt from disk
    assert [r.response_ids for r in await restarted.records("s")] == [[5, 6]]
    assert (tmp_path / "s" / "attempts" / "bbbbbbbbbbbb" / "records.jsonl").exists()
    restarted.close()


async def test_a_new_attempt_marked_at_submit_never_reads_as_the_dead_one(tmp_path: Path):
    """Issue 35: after a gateway's kill -9 and restart, the disk still names the dead attempt until the new one's
    INIT writes its pointer; a session marked latest at submit reads as its own (empty) attempt meanwhile."""
    dead = CaptureJournal(tmp_path)
    await dead.begin_attempt("s", "aaaaaaaaaaaa")
    await dead.append(record("s", [1, 2, 3], [4]), "aaaaaaaaaaaa")
    dead.close()
    restarted = CaptureJournal(tmp_path)
    assert [r.response_ids for r in await restarted.records("s")] == [[4]]  # what the disk says
    restarted.mark_latest("s", "bbbbbbbbbbbb")  # what the gateway does at submit
    assert await restarted.records("s") == []
    assert await restarted.latest_attempt("s") == "bbbbbbbbbbbb"
    restarted.close()


async def test_open_streams_are_bounded_and_an_evicted_one_reads_back_from_disk(tmp_path: Path):
    journal = CaptureJournal(tmp_path, max_open=3)
    originals = {f"s{i}": conversation(4, seed=i) for i in range(10)}
    for sid, recs in originals.items():
        for rec in recs:
            await journal.append(rec.model_copy(update={"session_id": sid}, deep=True))
        assert journal.open_streams() <= 3
    for sid, recs in originals.items():  # most were evicted: read from disk, exactly
        back = await journal.records(sid)
        assert [r.model_dump(exclude={"index", "session_id"}) for r in back] == \
               [r.model_dump(exclude={"index", "session_id"}) for r in recs]
    # an evicted stream reopens where it was: the next record continues its indices and shares its prefix
    nxt = originals["s0"][-1]
    await journal.append(record("s0", nxt.prompt_ids + nxt.response_ids + [1], [2]))
    back = await journal.records("s0")
    assert [r.index for r in back] == list(range(5)) and back[-1].response_ids == [2]
    journal.release("s0")
    assert "s0" not in journal.sessions()  # a released stream leaves memory at once
    journal.close()


async def test_eviction_never_drops_a_stream_in_use(tmp_path: Path):
    journal = CaptureJournal(tmp_path, max_open=1)
    recs = [record(f"s{i % 5}", [i % 5, 1, 2, j], [j]) for j in range(6) for i in range(5)]
    await asyncio.gather(*(journal.append(r) for r in recs))
    for i in range(5):
        back = await journal.records(f"s{i}")
        assert [r.index for r in back] == list(range(6))
        assert sorted(r.response_ids[0] for r in back) == list(range(6))
    journal.close()


async def test_reopening_a_torn_journal_cuts_the_tail_so_new_records_stay_exact(tmp_path: Path):
    journal = CaptureJournal(tmp_path)
    recs = conversation(3, seed=5)
    for rec in recs:
        await journal.append(rec.model_copy(deep=True))
    journal.close()
    directory = tmp_path / "chat"
    # a crash after some token bytes of a fourth record and half of its line
    (directory / "tokens.bin").write_bytes((directory / "tokens.bin").read_bytes() + b"\x01\x02\x03\x04\x05\x06")
    (directory / "records.jsonl").write_bytes((directory / "records.jsonl").read_bytes() + b'{"completion_id": "t')
    reopened = CaptureJournal(tmp_path)
    extra = record("chat", recs[-1].prompt_ids + recs[-1].response_ids + [9], [10, 11])
    await reopened.append(extra.model_copy(deep=True))
    back = await reopened.records("chat")
    assert [r.response_ids for r in back] == [r.response_ids for r in recs] + [[10, 11]]
    assert back[-1].prompt_ids == extra.prompt_ids
    reopened.close()
