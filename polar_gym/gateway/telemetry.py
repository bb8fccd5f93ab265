"""The gateway's OpenTelemetry spans (``telemetry`` settings): when a session's result is final, its session,
stage and model-call spans are made from its status history and its journal's per-call records
(:class:`polar_gym.telemetry.SessionTracer`) in a worker thread, after the result and the callback went out, and
exported in the background. Nothing here can fail or hold up a session: errors are logged."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable

from polar_gym.gateway.session import Session
from polar_gym.schema import CompletionRecord, SessionResult
from polar_gym.telemetry import SessionTracer, TelemetrySettings

__all__ = ["GatewayTelemetry", "RecordReader"]

log = logging.getLogger("polar_gym.gateway")

#: reads one attempt's journal records (``CaptureJournal.records``)
RecordReader = Callable[[str, str], Awaitable[list[CompletionRecord]]]


class GatewayTelemetry:
    def __init__(self, settings: TelemetrySettings, records: RecordReader) -> None:
        self.tracer = SessionTracer(settings)
        self.records = records
        self._closed = threading.Event()

    async def finished(self, s: Session, result: SessionResult) -> None:
        try:
            records = await self.records(s.session_id, s.attempt_id)
            await asyncio.to_thread(self.tracer.session, result, harness=s.spec.agent.harness, records=records,
                                    teardown_seconds=s.timings.get("teardown", 0.0))
        except Exception:
            log.warning("could not make the spans of session %s", s.session_id, exc_info=True)

    async def close(self) -> None:
        """Flush the queued spans (bounded by the export timeout) and stop; idempotent."""
        if not self._closed.is_set():
            self._closed.set()
            await asyncio.to_thread(self.tracer.close)
