"""benchmarks/bench_scale.py at a tiny size (20 sessions, 2 gateway processes, real sandboxes): it runs end to end,
every session completes, and its files carry the fields docs/scaling.md cites. No wall-time asserts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest

from polar_gym.assets import tokenizer_dir
from tests._benchmarks import load_benchmark

pytestmark = pytest.mark.slow

def _bench() -> ModuleType:
    return load_benchmark("bench_scale")


def test_bench_scale_runs_end_to_end_and_writes_what_the_docs_cite(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    if not (tokenizer_dir() / ".complete").exists():
        pytest.fail("the Qwen tokenizer asset is missing: run `bash scripts/setup.sh`")
    _bench().main(["--sessions", "20", "--gateways", "2", "--run-slots", "2", "--time-scale", "0.002",
                   "--calls", "3", "--idle-seconds", "1", "--calib-sessions", "2", "--calib-calls", "2",
                   "--store-sessions", "20", "--baseline-sessions", "8", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "bench_scale.json").read_text())
    # the baseline revision's server ran the same kind of sessions in the same run, side by side
    baseline = summary["baseline"]
    assert baseline["statuses"] == {"COMPLETED": 8} and baseline["completed_once"] == 8
    assert summary["completed_once"] == 20
    for run in (summary, baseline):
        assert run["storage"]["results"] == run["sessions"] and run["storage"]["stored_per_unique_token_byte"] > 0
        assert run["cpu"]["server_ms_per_session"] > 0 and run["latency"]["submitted_to_dispatched"]["p99_ms"] >= 0
    assert "this tree vs the server of" in (tmp_path / "bench_scale.md").read_text()
    assert summary["statuses"] == {"COMPLETED": 20} and summary["gateways"] == 2 and summary["total_slots"] == 4
    assert summary["model_calls"] == 20 * 3
    for key in ("makespan_s", "ideal_makespan_s", "makespan_ratio", "sessions_per_minute", "real_turns_per_session"):
        assert summary[key] > 0
    for window in ("makespan", "while_queued"):
        use = summary["slot_use"][window]
        assert 0 < use["mean"] <= 1 and use["p10"] is not None and len(use["per_gateway"]) == 2
    for name in ("submitted_to_running", "submitted_to_dispatched", "dispatched_to_running",
                 "slot_freed_to_next_running"):
        assert {"p50_ms", "p90_ms", "p99_ms", "n"} <= summary["latency"][name].keys()
    cpu = summary["cpu"]
    assert cpu["server_ms_per_session"] > 0 and cpu["gateway_ms_per_session"] > 0
    assert cpu["server_idle_ms_per_heartbeat"] is not None
    assert summary["calibration"]["gateway_cpu_ms_per_call"] is not None
    assert summary["memory"]["server_rss_mb_max"] > 0 and summary["memory"]["gateway_rss_mb_max"] > 0
    assert (tmp_path / "bench_scale_samples.jsonl").read_text().count("rss_mb") > 0
    store = summary["store"]
    assert store["sessions"] == 20 and store["writes_per_session"] >= 2 and store["commits_per_session"] >= 1
    assert store["server_cpu_ms_per_session"] > 0
    results = summary["results"]  # packed: about the unique token bytes, read on the loop without decoding
    assert results["result_kb_mean"] > 0 and results["largest_json_kb"] > results["largest_kb"]
    assert results["bytes_per_unique_token_byte"] >= 1.0  # these results are tiny: metadata weighs; 30k tokens: 1.0x
    assert results["loop_ms_packed"] > 0 and results["loop_ms_json"] > 0
    assert summary["cpu"]["server_ms_per_session_net_of_heartbeats"] is not None

    sessions = [json.loads(line) for line in (tmp_path / "bench_scale_sessions.jsonl").read_text().splitlines()]
    assert len(sessions) == 20 and all(s["running_at"] and s["postrun_at"] and s["dispatched"] for s in sessions)
    slots = [json.loads(line) for line in (tmp_path / "bench_scale_slots.jsonl").read_text().splitlines()]
    assert slots and all(0 <= busy <= 2 for p in slots for busy in p["busy"].values())  # never over its run slots
    # a gateway is handed more sessions than it has run slots, so the next one is prepared while a harness runs (one
    # that registered only its run slots left each slot empty through its last session's scoring and the next
    # one's dispatch and INIT)
    def held(gateway: str, at: float) -> int:
        return sum(1 for s in sessions if s["gateway"] == gateway and s["dispatched"] <= at < s["finished"])

    assert max(held(s["gateway"], s["dispatched"]) for s in sessions) > 2
    assert all(c > 2 for c in summary["registered_capacity"].values())
    assert (tmp_path / "bench_scale.md").read_text().count("slot use, ") == 2  # both windows in the main table
    assert (tmp_path / "bench_scale_slots.svg").read_text().startswith("<svg")
