"""benchmarks/journal_cost.py (bench_proxy.py --journal-only), short: a Claude Code session built from the recorded
request is journaled within 1.1x its unique content and every request reads back byte for byte (the benchmark
asserts it)."""

from __future__ import annotations

from types import ModuleType

from tests._benchmarks import load_benchmark


def _bench() -> ModuleType:
    return load_benchmark("journal_cost")


def test_a_claude_code_session_is_journaled_within_its_unique_content() -> None:
    result = _bench().bench_journal(turns=40)
    assert result["ratio_to_unique"] <= 1.1, result
    assert result["raw_ratio_to_unique"] > 10 * result["ratio_to_unique"]  # what storing each call whole costs
