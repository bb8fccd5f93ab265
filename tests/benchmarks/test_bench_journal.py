"""benchmarks/bench_proxy.py's journal section, short: a Claude Code session built from the recorded request is
journaled within 1.1x its unique content and every request reads back byte for byte (the benchmark asserts it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_proxy.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_proxy", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_proxy"] = module
    spec.loader.exec_module(module)
    return module


def test_a_claude_code_session_is_journaled_within_its_unique_content() -> None:
    result = _bench().bench_journal(turns=40)
    assert result["ratio_to_unique"] <= 1.1, result
    assert result["raw_ratio_to_unique"] > 10 * result["ratio_to_unique"]  # what storing each call whole costs
