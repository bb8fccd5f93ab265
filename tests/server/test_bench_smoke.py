"""benchmarks/bench_server.py at a tiny size: it must run end to end (server, baseline, restart recovery) and
every session must finish COMPLETED, so the benchmark's numbers are about finished work. No wall-time asserts."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests._benchmarks import load_benchmark

pytestmark = pytest.mark.slow

def _bench() -> ModuleType:
    return load_benchmark("bench_server")


def test_bench_server_smoke(tmp_path: Path) -> None:
    results = _bench().main(["--sessions", "50", "--gateways", "2", "--concurrency", "8", "--stored", "80",
                             "--inflight", "20", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "bench_server.json").read_text())
    assert written.keys() == results.keys() >= {"config", "server", "baseline", "throughput_ratio", "recovery"}

    server, baseline = written["server"], written["baseline"]
    assert server["sessions"] == baseline["sessions"] == 50
    assert server["statuses"] == {"COMPLETED": 50} and baseline["statuses"] == {"COMPLETED": 50}
    assert server["callbacks"] == server["tasks"] == 50
    for key in ("sessions_per_second", "scheduling_latency", "session_latency", "seconds"):
        assert key in server
    assert {"p50_ms", "p99_ms"} <= server["scheduling_latency"].keys()
    assert written["throughput_ratio"] > 0

    recovery = written["recovery"]
    assert recovery["layout"] == {"stored_tasks": 80 + 20 + 2, "inflight_live": 20, "inflight_dead": 2}
    for name in ("stored", "empty"):
        assert {"open_store_s", "start_s", "api_s", "first_redispatch_s", "all_inflight_finished_s"} \
            <= recovery[name].keys()
    stored = recovery["stored"]
    assert stored["statuses"] == {"COMPLETED": 102}  # every in-flight session, watched or re-dispatched, ended
    assert stored["redispatched"] == 2 and stored["first_redispatch_s"] is not None
    assert {"start_ratio", "api_ratio"} <= recovery.keys()
