"""Freed memory goes back to the OS after sessions end (polar_gym.proxy.heap.HeapTrimmer): trimmed on the loop's next
turn, then at most once an interval, a release in between trimmed when the interval ends; nothing off glibc."""

from __future__ import annotations

import asyncio
from pathlib import Path

from polar_gym.proxy.heap import HeapTrimmer
from tests._serving import oracle_service
from tests._waiting import until


async def test_releases_are_trimmed_at_most_once_an_interval_and_none_is_missed():
    now = [100.0]
    trimmed: list[float] = []

    def trim(pad: int) -> int:
        assert pad == 0
        trimmed.append(now[0])
        return 1

    heap = HeapTrimmer(5.0, trim=trim, clock=lambda: now[0])
    heap.released()
    assert trimmed == []  # not inside the call that released
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert trimmed == [100.0]
    now[0] = 101.0
    heap.released()
    heap.released()  # a second release in the same interval adds nothing
    await asyncio.sleep(0.01)
    assert trimmed == [100.0]  # due at 105 (the loop's own clock decides when: ~4 s from now)
    heap._run()  # as call_later would at 105
    assert trimmed == [100.0, 101.0] and heap.trims == 2


def test_without_a_loop_a_due_trim_runs_at_once_and_without_glibc_nothing_happens():
    now = [0.0]
    calls: list[int] = []
    heap = HeapTrimmer(5.0, trim=lambda pad: calls.append(pad) or 0, clock=lambda: now[0])
    heap.released()
    heap.released()  # within the interval: left for a later release
    assert calls == [0]
    now[0] = 6.0
    heap.released()
    assert calls == [0, 0]
    absent = HeapTrimmer(trim=None)
    absent._trim = None  # as on a C library without malloc_trim
    absent.released()
    assert absent.trims == 0


async def test_the_real_malloc_trim_runs_when_a_session_is_forgotten(tmp_path: Path):
    service = oracle_service(tmp_path)
    before = service.heap.trims
    service.forget("s1")
    await until(lambda: service.heap.trims > before, what="a trim after a forgotten session")
    service.journal.close()
