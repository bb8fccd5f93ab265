"""A serving proxy process tunes the cyclic GC once started (issue 18: the collector was on the stack in 16-18 % of
samples at 64 concurrent calls): the start-up heap frozen out of its sight, the youngest generation collected
less often. Checked in a child process: freezing is for serving processes, not the test runner."""

from __future__ import annotations

import subprocess
import sys

from polar_gym.proxy.app import GC_THRESHOLDS


def test_tune_gc_for_serving_freezes_the_start_up_heap_and_raises_the_thresholds() -> None:
    code = ("import gc; from polar_gym.proxy.app import tune_gc_for_serving; tune_gc_for_serving(); "
            "print(gc.get_freeze_count(), *gc.get_threshold())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    frozen, *thresholds = (int(v) for v in out.stdout.split())
    assert frozen > 10_000  # modules, schemas and the app's objects
    assert tuple(thresholds) == GC_THRESHOLDS
