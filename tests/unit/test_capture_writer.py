"""The capture journal's writer around the codec: the descriptors it keeps open (bound, reuse, eviction, closing
what it gave up on), fsync on the writer thread, failing writes and opens, shutdown, back-pressure, and the bounds
and bookkeeping of the streams and attempts it holds in memory."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from polar_gym.journal import DigestMemo
from polar_gym.proxy import capture
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.schema import CompletionRecord
from tests._fakes import disk_full
from tests._waiting import until


def record(session: str, prompt: list[int], response: list[int]) -> CompletionRecord:
    messages = [{"role": "user", "content": str(prompt)}]
    return CompletionRecord(
        completion_id=f"c{len(prompt)}-{len(response)}", session_id=session, index=-1, provider="anthropic",
        engine="oracle", request={"model": "m", "messages": messages, "max_tokens": 5},
        normalized_request={"model": "m", "messages": messages}, prompt_ids=prompt, response_ids=response,
        response_logprobs=[-0.5] * len(response), finish_reason="stop",
    )


def descriptors_under(directory: Path) -> int:
    """This process's open descriptors on files under ``directory`` (removed ones too: ``... (deleted)``)."""
    try:
        names = os.listdir("/proc/self/fd")
    except FileNotFoundError:
        pytest.skip("needs /proc to see open descriptors")
    prefix, count = str(directory) + os.sep, 0
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, gone already
            continue
        count += target.startswith(prefix)
    return count


# -- the open-file cache ---------------------------------------------------------------------------------------

async def test_the_writer_holds_exactly_the_last_64_streams_files_and_closes_the_rest(tmp_path: Path):
    """The documented bound: 64 streams' three files each stay open, an evicted stream's are closed at once (not
    at some later write), and closing the journal closes every one."""
    journal = CaptureJournal(tmp_path)
    for n in range(100):
        await journal.append(record(f"s{n}", [1, n], [2]))
        assert descriptors_under(tmp_path) == 3 * min(n + 1, 64)
    assert descriptors_under(tmp_path / "s99") == 3 and descriptors_under(tmp_path / "s0") == 0
    journal.close()
    assert descriptors_under(tmp_path) == 0


@pytest.mark.parametrize("fsync", [False, True])
async def test_a_stream_written_again_is_the_last_to_lose_its_open_files(tmp_path: Path, fsync: bool):
    """Least recently *written* first out, whichever path the write took (the event loop's append to open files,
    or the writer thread's with fsync): a busy stream keeps its descriptors while idle ones are closed."""
    journal = CaptureJournal(tmp_path, fsync=fsync)
    await journal.append(record("hot", [1], [2]))
    for n in range(63):
        await journal.append(record(f"s{n}", [1, n], [2]))
    await journal.append(record("hot", [1, 2, 3], [4]))  # 64 open: "hot" is now the newest, s0 the oldest
    await journal.append(record("s63", [1, 63], [2]))  # one too many: the oldest goes
    assert descriptors_under(tmp_path / "hot") == 3
    assert descriptors_under(tmp_path / "s0") == 0
    assert [r.response_ids for r in await journal.records("hot")] == [[2], [4]]
    journal.close()


async def test_files_removed_under_an_open_stream_are_closed_when_it_reopens_them(tmp_path: Path):
    """A removed stream's old descriptors are not kept alive next to the new ones (a leak per removed session)."""
    journal = CaptureJournal(tmp_path)
    await journal.append(record("gone", [1, 2], [3]))
    shutil.rmtree(tmp_path / "gone")
    await journal.append(record("gone", [7, 8, 9], [4]))
    assert descriptors_under(tmp_path / "gone") == 3  # the new files only, none of the deleted ones
    journal.close()
    assert descriptors_under(tmp_path) == 0


def test_descriptors_given_up_by_the_loop_are_closed_by_the_next_write_on_the_writer_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The open-file cache alone: a failed append on the event loop hands the stream's descriptors to the writer
    thread, whose next write closes them, whichever stream it writes."""
    files = capture._OpenFiles()
    payloads = (b"\x01\x00\x00\x00", b"\x00\x00\x00\x00", b"{}\n")
    files.write(tmp_path / "a", payloads, False)
    files.write(tmp_path / "b", payloads, False)
    real_append = capture._append
    monkeypatch.setattr(capture, "_append", disk_full())
    with pytest.raises(OSError, match="No space"):
        files.write_if_open(tmp_path / "a", payloads)
    monkeypatch.setattr(capture, "_append", real_append)
    assert files.write_if_open(tmp_path / "a", payloads) is False  # no longer open: the writer thread reopens it
    files.write(tmp_path / "b", payloads, False)  # b is still open: no open happens, the pending closes do
    assert descriptors_under(tmp_path / "a") == 0 and descriptors_under(tmp_path / "b") == 3
    files.close()
    assert descriptors_under(tmp_path) == 0


async def test_journal_files_are_created_private_and_not_executable(tmp_path: Path):
    """Created 0600 whatever the umask (they hold prompts and completions: issue 35), never executable."""
    umask = os.umask(0o002)
    try:
        journal = CaptureJournal(tmp_path)
        await journal.append(record("m", [1, 2], [3]))
        journal.close()
    finally:
        os.umask(umask)
    for name in ("tokens.bin", "logprobs.bin", "records.jsonl"):
        assert stat.S_IMODE((tmp_path / "m" / name).stat().st_mode) == 0o600, name


def test_an_on_disk_stream_is_never_written_past_the_open_file_cache(tmp_path: Path):
    """A write that would bypass the cache (and the lock that keeps it apart from a close) is refused."""
    stream = capture._Session("s", tmp_path / "s", DigestMemo())
    with pytest.raises(ValueError, match="open files"):
        stream.write(b"{}\n", b"", b"", False)
    assert not (tmp_path / "s").exists()


# -- fsync ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fsync", [False, True])
async def test_fsync_syncs_every_file_of_every_record_on_the_writer_thread_and_only_when_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool):
    synced: list[tuple[str, str]] = []
    real_fsync = os.fsync

    def recorded(fd: int) -> None:
        synced.append((threading.current_thread().name, os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    monkeypatch.setattr(capture.os, "fsync", recorded)
    journal = CaptureJournal(tmp_path, fsync=True) if fsync else CaptureJournal(tmp_path)  # the default: no fsync
    for n in range(3):
        await journal.append(record("f", list(range(n + 2)), [n]))
    journal.close()
    expected = [("polar-capture-writer", name) for name in ("tokens.bin", "logprobs.bin", "records.jsonl")] * 3
    assert synced == (expected if fsync else [])


# -- failing writes ---------------------------------------------------------------------------------------------

async def test_a_write_failing_on_the_writer_thread_reaches_the_call_and_its_descriptors_are_closed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """With fsync every write goes through the writer thread: a failure there raises in the waiting call, the
    stream's descriptors are closed at once (the next append opens fresh ones), and the torn part is cut."""
    journal = CaptureJournal(tmp_path, fsync=True)
    first = record("w", [1, 2], [3])
    await journal.append(first)
    real_append = capture._append
    monkeypatch.setattr(capture, "_append", disk_full(torn=5))  # a torn token write, then the disk is full
    with pytest.raises(OSError, match="No space"):
        await asyncio.wait_for(journal.append(record("w", [1, 2, 3, 4], [5])), 30)
    assert descriptors_under(tmp_path / "w") == 0
    monkeypatch.setattr(capture, "_append", real_append)
    await journal.append(record("w", [1, 2, 3, 6], [7]))
    assert descriptors_under(tmp_path / "w") == 3
    back = await CaptureJournal(tmp_path).records("w")
    assert [(r.index, r.prompt_ids, r.response_ids) for r in back] == [(0, [1, 2], [3]), (1, [1, 2, 3, 6], [7])]
    journal.close()
    assert descriptors_under(tmp_path) == 0


async def test_a_failing_append_on_the_loop_leaves_no_descriptor_behind(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    """The event loop gives up the failed stream's descriptors; the writer thread closes them when it next opens
    files, so a disk that fills up now and then does not leak three descriptors each time."""
    journal = CaptureJournal(tmp_path)
    await journal.append(record("l", [1, 2], [3]))
    real_append = capture._append
    monkeypatch.setattr(capture, "_append", disk_full())
    with pytest.raises(OSError, match="No space"):
        await journal.append(record("l", [1, 2, 3, 4], [5]))
    monkeypatch.setattr(capture, "_append", real_append)
    await journal.append(record("l", [1, 2, 3, 6], [7]))
    assert descriptors_under(tmp_path / "l") == 3
    journal.close()
    assert descriptors_under(tmp_path) == 0


async def test_a_stream_whose_files_cannot_all_be_opened_leaks_none_of_them(tmp_path: Path):
    """tokens.bin and logprobs.bin open, records.jsonl does not: the two already open are closed again, each
    time the call fails."""
    journal = CaptureJournal(tmp_path)
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "records.jsonl").symlink_to(tmp_path / "missing" / "records.jsonl")  # cannot be created
    for _ in range(3):
        with pytest.raises(OSError):
            await asyncio.wait_for(journal.append(record("o", [1, 2], [3])), 30)
        assert descriptors_under(tmp_path) == 0
    journal.close()


async def test_reading_an_open_on_disk_stream_happens_off_the_event_loop(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    """Reading a journal's files can take a while (a long session, a network disk): never on the event loop,
    whose other calls would stall meanwhile. An in-memory stream is read where it is."""
    threads: list[str] = []
    real_read = capture.read_session

    def recorded(directory: Path) -> Any:
        threads.append(threading.current_thread().name)
        return real_read(directory)

    monkeypatch.setattr(capture, "read_session", recorded)
    journal = CaptureJournal(tmp_path)
    await journal.append(record("r", [1, 2], [3]))
    assert [r.response_ids for r in await journal.records("r")] == [[3]]
    assert threads and threading.main_thread().name not in threads
    journal.close()


# -- shutdown and back-pressure ---------------------------------------------------------------------------------

def test_a_journal_never_closed_does_not_keep_the_process_alive(tmp_path: Path):
    """The writer is a daemon thread: a program that forgets ``close()`` still exits."""
    journal = CaptureJournal(tmp_path)
    writers = [t for t in threading.enumerate() if t.name == "polar-capture-writer" and t.is_alive()]
    assert writers and all(t.daemon for t in writers)
    journal.close()


def stuck_pointer_writes(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[str]]:
    """Make the writer thread's attempt-pointer writes wait for the returned event (a hung network disk)."""
    release, entered = threading.Event(), []

    def write_pointer(base: Path, attempt: str) -> None:
        entered.append(attempt)
        assert release.wait(60), "the test never released the writer"

    monkeypatch.setattr(capture, "_write_pointer", write_pointer)
    return release, entered


async def test_a_journal_closing_behind_a_stuck_writer_refuses_new_writes_at_once(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch):
    """While ``close()`` waits for a stuck writer, a new append fails at once: queued behind the shutdown it would
    never be written, and its call would wait forever."""
    release, entered = stuck_pointer_writes(monkeypatch)
    journal = CaptureJournal(tmp_path)
    stuck = asyncio.create_task(journal.begin_attempt("s", "a1"))
    await until(lambda: entered, what="the writer to take the first job")
    closing = asyncio.create_task(asyncio.to_thread(journal.close))
    assert journal._writer is not None
    await until(lambda: journal._writer._closed, timeout=10, what="close() to begin")
    try:
        with pytest.raises(RuntimeError, match="closed"):
            await asyncio.wait_for(journal.append(record("s", [1], [2])), 10)
    finally:
        release.set()
    await asyncio.wait_for(asyncio.gather(stuck, closing), 30)


async def test_a_full_write_queue_makes_calls_wait_without_blocking_the_event_loop(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch):
    """Back-pressure: with the writer stuck and its queue full, a further call waits, and other coroutines (here
    the one that unsticks the writer) keep running; then every write goes through, none dropped."""
    release, entered = stuck_pointer_writes(monkeypatch)
    journal = CaptureJournal(tmp_path, max_pending=1)
    first = asyncio.create_task(journal.begin_attempt("s0", "a0"))
    await until(lambda: entered, what="the writer to take the first job")
    waiting = [asyncio.create_task(journal.begin_attempt(f"s{n}", f"a{n}")) for n in (1, 2, 3)]
    for _ in range(5):
        await asyncio.sleep(0)  # the queued call and the ones waiting for room run; the loop stays ours
    assert not any(t.done() for t in waiting)
    release.set()
    await asyncio.wait_for(asyncio.gather(first, *waiting), 30)
    assert sorted(entered) == ["a0", "a1", "a2", "a3"]
    journal.close()


# -- streams and attempts held in memory -------------------------------------------------------------------------

def test_at_least_one_stream_must_be_kept():
    with pytest.raises(ValueError, match="max_open"):
        CaptureJournal(max_open=0)


@pytest.mark.parametrize("on_disk", [False, True])
async def test_the_default_bounds_on_streams_in_memory(tmp_path: Path, on_disk: bool):
    """256 streams on disk (the others read back from their files), 10,000 in memory (an evicted in-memory stream
    is gone, so that bound is generous)."""
    journal = CaptureJournal(tmp_path if on_disk else None)
    bound = 256 if on_disk else 10_000
    for n in range(bound + 1):
        await journal.append(record(f"s{n}", [1], [2]))
    assert journal.open_streams() == bound
    assert [r.response_ids for r in await journal.records("s0")] == ([[2]] if on_disk else [])
    journal.close()


async def test_eviction_keeps_exactly_max_open_and_drops_the_least_recently_used():
    journal = CaptureJournal(max_open=3)
    for name in ("a", "b", "c"):
        await journal.append(record(name, [1], [2]))
    await journal.append(record("a", [1, 2, 3], [4]))  # "a" used again: "b" is now the oldest
    await journal.append(record("d", [1], [2]))
    assert journal.open_streams() == 3
    assert journal.sessions() == ["a", "c", "d"]
    assert [r.response_ids for r in await journal.records("a")] == [[2], [4]]


async def test_a_stream_being_read_is_counted_as_used_only_while_it_is_read():
    """Reading a stream holds it against eviction during the read, and not afterwards: read streams still leave
    memory when newer ones come."""
    journal = CaptureJournal(max_open=2)
    for name in ("a", "b"):
        await journal.append(record(name, [1], [2]))
        assert len(await journal.records(name)) == 1
    for name in ("c", "d"):
        await journal.append(record(name, [1], [2]))
    assert journal.sessions() == ["c", "d"]


async def test_a_released_in_memory_stream_stays_readable_until_newer_ones_push_it_out():
    journal = CaptureJournal(max_open=2)
    await journal.append(record("a", [1], [2]))
    await journal.append(record("b", [1], [3]))
    journal.release("b")
    assert [r.response_ids for r in await journal.records("b")] == [[3]]  # not dropped at once: in memory only
    await journal.append(record("c", [1], [4]))  # the released one is first out, not the older "a"
    assert journal.sessions() == ["a", "c"]


async def test_a_released_in_memory_attempt_is_still_what_its_session_reads():
    journal = CaptureJournal()
    await journal.begin_attempt("s", "a1")
    await journal.append(record("s", [1], [2]), "a1")
    journal.release("s", "a1")
    assert [r.response_ids for r in await journal.records("s")] == [[2]]
    assert await journal.latest_attempt("s") == "a1"


async def test_releasing_an_on_disk_attempt_forgets_its_pointer_in_memory_but_not_on_disk(tmp_path: Path):
    """A finished gateway session leaves no attempt pointer in memory (thousands of sessions would pile up); its
    latest attempt is still known from the pointer file. Releasing an older attempt keeps the current one's."""
    journal = CaptureJournal(tmp_path)
    for n in range(5):
        await journal.begin_attempt(f"s{n}", "a1")
        await journal.append(record(f"s{n}", [1], [n]), "a1")
        journal.release(f"s{n}", "a1")
    assert journal._latest == {}
    assert [r.response_ids for r in await journal.records("s3")] == [[3]]
    await journal.begin_attempt("s0", "a2")
    journal.release("s0", "a1")
    assert journal._latest == {"s0": "a2"}
    journal.close()


async def test_only_the_latest_attempts_of_max_open_sessions_are_remembered_in_memory():
    """The latest-attempt map is bounded like the streams, least recently begun first out; a session begun again
    counts as recent."""
    journal = CaptureJournal(max_open=2)
    for sid, attempt in (("s1", "a1"), ("s2", "b1"), ("s1", "a2"), ("s3", "c1")):
        await journal.begin_attempt(sid, attempt)
        await journal.append(record(sid, [1], [len(attempt)]), attempt)
    assert await journal.latest_attempt("s1") == "a2"
    assert await journal.latest_attempt("s3") == "c1"
    assert await journal.latest_attempt("s2") is None  # forgotten: an in-memory journal has no pointer file
    assert [r.response_ids for r in await journal.records("s3")] == [[2]]


async def test_an_in_memory_journal_lists_a_sessions_attempts_with_their_record_counts():
    journal = CaptureJournal()
    await journal.append(record("s", [1], [2]))  # the session's own stream: not an attempt
    await journal.append(record("s", [1], [2]), "a1")
    await journal.append(record("s", [1, 2, 3], [4]), "a1")
    await journal.append(record("s", [1], [2]), "a2")
    await journal.append(record("other", [1], [2]), "a3")
    assert await journal.attempts("s") == {"a1": 2, "a2": 1}
    assert await journal.attempts("nobody") == {}


@pytest.mark.parametrize("on_disk", [False, True])
async def test_append_returns_the_record_with_its_index(tmp_path: Path, on_disk: bool):
    journal = CaptureJournal(tmp_path if on_disk else None)
    for n in range(3):
        appended = await journal.append(record("i", list(range(n + 1)), [n]))
        assert appended is not None and appended.index == n
    journal.close()


@pytest.mark.parametrize("on_disk", [False, True])
async def test_an_unknown_session_stores_nothing(tmp_path: Path, on_disk: bool):
    journal = CaptureJournal(tmp_path if on_disk else None)
    assert journal.stored_bytes("nobody") == 0
    assert journal.stored_bytes("nobody", "a1") == 0
    journal.close()
