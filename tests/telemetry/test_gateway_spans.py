"""A real gateway (curl harness in a bubblewrap sandbox, oracle engine) with telemetry on: the spans of its sessions
are in the span file once it drains, the failing harness's session span says so, and a journal that cannot be read
for the spans costs the spans, never the session."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from polar_gym.schema import SessionStatus
from polar_gym.telemetry import TelemetrySettings
from tests.gateway._gateway_kit import MakeGateway
from tests.telemetry._readers import file_spans


async def test_a_gateway_emits_the_spans_of_its_sessions(make_gateway: MakeGateway, tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    gw = await make_gateway(run_slots=2, telemetry=TelemetrySettings(file=str(path), resource={"k": "v"}))
    ok, failed = await gw.node.run([gw.spec("ok", calls=3), gw.spec("failed", calls=1, exit_code=4)])
    await gw.node.drain()  # flushes the spans
    assert ok.status is SessionStatus.COMPLETED
    spans = file_spans(path)
    roots = {s.attributes["polar_gym.session_id"]: s for s in spans if s.name == "session"}
    assert set(roots) == {"ok", "failed"}
    assert roots["ok"].attributes["polar_gym.completions"] == 3 and roots["ok"].resource["k"] == "v"
    assert roots["failed"].attributes["polar_gym.status"] == failed.status.value
    runs = {s.attributes["polar_gym.session_id"]: s for s in spans if s.name == "run"}
    calls = [s for s in spans if s.attributes.get("gen_ai.operation.name") == "chat"]
    assert sorted(c.attributes["polar_gym.session_id"] for c in calls) == ["failed", "ok", "ok", "ok"]
    assert all(c.parent_id == runs[c.attributes["polar_gym.session_id"]].span_id for c in calls)
    assert all(runs[s].parent_id == roots[s].span_id for s in roots)


async def test_spans_that_cannot_be_made_never_touch_the_session(make_gateway: MakeGateway, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    gw = await make_gateway(telemetry=TelemetrySettings(file=str(tmp_path / "spans.jsonl")))
    assert gw.node.telemetry is not None

    async def unreadable(session_id: str, attempt: str) -> list:
        raise OSError("the journal's disk went away")

    gw.node.telemetry.records = unreadable
    with caplog.at_level(logging.WARNING, logger="polar_gym.gateway"):
        (result,) = await gw.node.run([gw.spec("s", calls=1)])
    assert result.status is SessionStatus.COMPLETED
    assert "could not make the spans of session s" in caplog.text
