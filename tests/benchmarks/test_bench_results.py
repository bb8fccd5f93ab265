"""benchmarks/bench_results.py at a tiny size (light gateway processes, this tree's server and the baseline
revision's, each as its own process): every session completes exactly once on both, and the packed store holds
fewer bytes a result than the JSON one. No wall-time asserts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.server.postgres_local import postgres_bin
from tests._benchmarks import load_benchmark

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_bench_results_runs_both_servers_and_writes_its_files(tmp_path: Path) -> None:
    if not (tokenizer_dir() / ".complete").exists():
        pytest.fail("the Qwen tokenizer asset is missing: run `bash scripts/setup.sh`")
    bench = load_benchmark("bench_results")
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{bench.BASELINE_REV}^{{commit}}"])
    if known.returncode != 0:
        pytest.skip(f"the baseline revision {bench.BASELINE_REV} is not in this clone's history (a shallow clone)")
    workers = ["--workers", "2"] if postgres_bin() is not None else []  # two server workers on a PostgreSQL too
    bench.main(["--sessions", "24", "--baseline-sessions", "8", "--gateways", "2", "--hold", "1", "--tokens", "3000",
                *workers, "--out", str(tmp_path)])
    res = json.loads((tmp_path / "bench_results.json").read_text())
    assert set(res) >= {"current", "current_small", "baseline", "result", "config"}
    runs = [("current", 24), ("current_small", 8), ("baseline", 8)] + ([("workers", 24)] if workers else [])
    for run, n in runs:
        assert res[run]["exactly_once"] and res[run]["statuses"] == {"COMPLETED": n}, res[run]
        assert res[run]["peak_in_flight"] >= 1 and res[run]["server_cpu_ms_per_session"] >= 0
    if workers:
        assert res["workers"]["workers"] == 2 and res["workers"]["store_cpu_ms_per_session"] > 0
        assert 0 < res["workers"]["busiest_worker_cpu_ms_per_session"] <= res["workers"]["server_cpu_ms_per_session"]
    assert res["current"]["stored_bytes_per_result"] < res["baseline"]["stored_bytes_per_result"]
    assert res["result"]["packed_bytes"] < res["result"]["json_bytes"]
    assert "baseline / current_small" in (tmp_path / "bench_results.md").read_text()
    worktrees = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert "bench-results-" not in worktrees  # the baseline checkout is removed
