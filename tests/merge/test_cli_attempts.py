"""Offline rebuilds of a gateway capture root skip a session's superseded attempts (issue 11, fault 8): a call of a
dead gateway's attempt is never trained, offline either, unless its directory is named explicitly."""

from __future__ import annotations

from pathlib import Path

from polar_gym.merge.cli import find_journals
from polar_gym.proxy.capture import CaptureJournal
from tests.merge._sessions import EOT, rec


async def test_only_the_latest_attempt_of_a_session_is_found(tmp_path: Path) -> None:
    journal = CaptureJournal(tmp_path)
    for attempt in ("aaaaaaaaaaaa", "bbbbbbbbbbbb"):
        await journal.begin_attempt("sess", attempt)
        await journal.append(rec(0, [1, 2], [3, EOT]).model_copy(update={"session_id": "sess"}), attempt)
    await journal.append(rec(0, [5], [6, EOT]).model_copy(update={"session_id": "adhoc"}))
    journal.close()
    dead = tmp_path / "sess" / "attempts" / "aaaaaaaaaaaa"
    assert find_journals([tmp_path]) == [tmp_path / "adhoc", tmp_path / "sess" / "attempts" / "bbbbbbbbbbbb"]
    assert find_journals([dead]) == [dead]
