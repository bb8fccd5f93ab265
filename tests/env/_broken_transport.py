"""Deliberately broken journal transports for the conformance command's negative tests (imported in NeMo Gym's
interpreter by ``python -m polar_gym.env conformance --transport tests.env._broken_transport:NAME``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polar_gym.env.nemo_transport import JournalTokenStore


class VersionlessStore(JournalTokenStore):
    """Writes state without moving the version: a marker after a freeze cannot stale the consumed snapshot."""

    def bump(self, stream: Path, state: dict[str, Any]) -> None:
        state.setdefault("version", 1)
        self.write_state(stream, state)


class NoConflictStore(JournalTokenStore):
    """Accepts a different payload under a call id already captured (stored under another id, silently)."""

    def append(self, stream: Path, entry: Any) -> bool:
        try:
            return super().append(stream, entry)
        except ValueError:
            return super().append(stream, entry.model_copy(update={"model_call_id": entry.model_call_id + "-2"}))
