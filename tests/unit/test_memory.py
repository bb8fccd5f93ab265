"""Fault 9 (issue 11): a long-lived proxy keeps no memory per finished session. Sessions go through the real
ProxyService and on-disk CaptureJournal (benchmarks/bench_memory.py's driver, with fewer sessions); the Python heap
still allocated after 4x more sessions must not grow with them (unbounded: ~22 KB per session, never freed)."""

from __future__ import annotations

import importlib.util
import sys
import tracemalloc
from pathlib import Path

import pytest

from polar_gym.proxy.capture import CaptureJournal

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "benchmarks" / "bench_memory.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_memory"] = bench
_spec.loader.exec_module(bench)

#: heap growth allowed between the two checkpoints, in total (the 300 extra sessions would retain ~5 MB unfixed)
SLACK = 256 * 1024


def retained_growth(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot) -> int:
    """Bytes allocated between two snapshots and still alive, leaving out single big blocks: those are the
    interpreter's tables doubling once (pathlib interns every path part, so the interned-strings table resizes
    as session names pass through), not memory kept per session."""
    grown = 0
    for stat in after.compare_to(before, "traceback"):
        if stat.count_diff <= 1 and stat.size_diff >= 256 * 1024:
            continue
        grown += stat.size_diff
    return grown


@pytest.mark.parametrize("mode", ["gateway", "adhoc"])
async def test_retained_memory_does_not_grow_with_finished_sessions(tmp_path: Path, mode: str) -> None:
    snapshots: list[tracemalloc.Snapshot] = []
    tracemalloc.start(4)
    try:
        # adhoc: nobody says a session ended; the LRU bounds (small here) are what keep memory flat
        await bench.run_sessions(tmp_path, [100, 400], mode=mode, prompt_bytes=8192, keep_files=True, max_open=16,
                                 max_adhoc=16, on_probe=lambda _: snapshots.append(tracemalloc.take_snapshot()))
    finally:
        tracemalloc.stop()
    assert retained_growth(*snapshots) < SLACK
    # what left memory is still on disk: the first session reads back in full
    journal = CaptureJournal(tmp_path)
    sid = "task-0-0-00000000"
    records = await journal.records(sid)
    journal.close()
    assert [r.index for r in records] == [0, 1] and records[0].request["messages"][0]["content"] == "x" * 8192
