"""benchmarks/bench_view.py at a tiny size runs end to end (the API part; the browser part is the browser tests').
No wall-time asserts: the numbers are the benchmark's to print."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_view.py"


def test_bench_view_smoke(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_view", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_view"] = module
    spec.loader.exec_module(module)
    results = module.main(["--turns", "8", "--baseline", "2", "--repeat", "1", "--out", str(tmp_path)])
    assert (tmp_path / "bench_view.json").is_file()
    assert results["long"]["tokens"] == 2000 + 8 * 200 - 100
    assert results["base"]["tokens"] == 2000 + 2 * 200 - 100
