"""The issue-13 builder fixes through ``python -m polar_gym.merge`` on a journal written by CaptureJournal: two
conversations from one prompt, a retry sent while the first attempt still ran (that attempt finishing last), and
an answer captured without logprobs."""

from __future__ import annotations

import asyncio
from pathlib import Path

from polar_gym.proxy.capture import CaptureJournal
from tests.merge._sessions import EOT, rec
from tests.merge.test_cli import rows, run

P2 = [1, 10, EOT, 50]
RECORDS = [
    rec(0, [1], [10, EOT], started=0),
    rec(1, P2, [21, EOT], started=15, seconds=2),  # the retry, sent when the client gave up on c4
    rec(2, [*P2, 21, EOT, 51], [22, EOT], started=18, response_logprobs=[]),  # an engine without logprobs
    rec(3, [5, 6], [30, EOT], started=20, seconds=1),  # sub-agent 1
    rec(4, P2, [20, EOT], started=10, seconds=30),  # the abandoned attempt, journaled last but one
    rec(5, [5, 6], [31, EOT], started=22, seconds=1),  # sub-agent 2: the same task prompt, after 1 answered
    rec(6, [5, 6, 30, EOT, 40], [32, EOT], started=24),  # sub-agent 1 goes on
    rec(7, [5, 6, 31, EOT, 41], [33, EOT], started=26),  # sub-agent 2 goes on
]


def test_retries_forks_and_missing_logprobs_from_a_journal(tmp_path: Path) -> None:
    async def write() -> None:
        journal = CaptureJournal(tmp_path / "captures")
        try:
            for r in RECORDS:
                await journal.append(r.model_copy(update={"session_id": "sess"}))
        finally:
            journal.close()

    asyncio.run(write())
    for config in (f'{{"end_of_turn_ids": [{EOT}]}}', f'{{"end_of_turn_ids": [{EOT}], "on_rerender": "merge"}}'):
        out = tmp_path / "traces.jsonl"
        proc = run("--builder", "prefix_merging", tmp_path / "captures", "--out", out, "--config", config)
        assert proc.returncode == 0, proc.stderr
        traces = rows(out)
        assert sorted(t["metadata"]["completion_ids"] for t in traces) == [["c0", "c1", "c2"], ["c3", "c6"],
                                                                          ["c5", "c7"]]
        main = next(t for t in traces if t["metadata"]["completion_ids"][0] == "c0")
        assert main["metadata"]["has_logprobs"] is False and main["response_logprobs"] == []
        assert all(t["metadata"]["has_logprobs"] for t in traces if t is not main)
        assert "compaction" not in proc.stdout
