"""OpenTelemetry spans of finished sessions, made from what the gateway recorded (wall-clock status history, the
capture journal's per-call records), so a session's trace is exact although the proxy and the node are separate
components and nothing is traced on the hot path:

    session                                  (session id, task id, harness, status, reward, cause)
      queued │ init │ ready │ run │ postrun  (one span per stage, from the status history)
                               │        └── build, evaluate
                               └── chat MODEL   one per model call (gen_ai.* usage, completion id, engine, policy
                                                version, route, status/error)

Spans are exported by a BatchSpanProcessor (a background thread; a collector that is down costs a dropped batch,
never a slow or failed session) over OTLP/HTTP and/or to a JSON-lines file.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar_gym.causes import error_cause
from polar_gym.schema import CompletionRecord, SessionResult, SessionStatus
from polar_gym.settings import ConfigError
from polar_gym.telemetry.settings import TelemetrySettings, traces_url

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

__all__ = ["STAGE_OF_STATUS", "SessionTracer", "stage_intervals"]

#: the stage a status starts (terminal statuses end the last one); build and evaluate nest in postrun
STAGE_OF_STATUS = {"REGISTERED": "queued", "INITIALIZING": "init", "READY": "ready", "RUNNING": "run",
                   "POST_RUN": "postrun", "BUILDING": "build", "EVALUATING": "evaluate"}
_NESTED = {"build", "evaluate"}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def stage_intervals(history: Sequence[Mapping[str, Any]]) -> list[tuple[str, float, float]]:
    """Pure: ``(stage, start, end)`` wall-clock seconds from a session's status history. Each status starts its
    stage and lasts until the next; postrun lasts until the session's end (its build and evaluate inside it)."""
    points = [(str(h.get("status")), float(h["at"])) for h in history if "at" in h]
    out: list[tuple[str, float, float]] = []
    end = points[-1][1] if points else 0.0
    for i, (status, at) in enumerate(points):
        stage = STAGE_OF_STATUS.get(status)
        if stage is None:
            continue
        until = end if stage == "postrun" or i + 1 == len(points) else points[i + 1][1]
        out.append((stage, at, until))
    return out


def _provider(settings: TelemetrySettings) -> tuple[TracerProvider, list[tuple[SpanProcessor, SpanExporter]]]:
    """The tracer provider and its (processor, exporter) pairs, the file's first (it flushes at once)."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise ConfigError("needs the opentelemetry-sdk package: pip install 'polar_gym[metrics]'",
                          key="telemetry") from None
    resource = Resource.create({"service.name": settings.service_name, **settings.resource})
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # SessionTracer.close bounds the flush
    exporters: list[SpanExporter] = []
    if settings.file:
        from polar_gym.telemetry.file_export import JsonLinesSpanExporter

        exporters.append(JsonLinesSpanExporter(Path(settings.file)))
    if settings.otlp_endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.http import trace_exporter
        except ImportError:
            raise ConfigError("needs the opentelemetry-exporter-otlp-proto-http package: "
                              "pip install 'polar_gym[metrics]'", key="telemetry.otlp_endpoint") from None
        # one error line per batch a collector did not take, not a warning per retry
        logging.getLogger(trace_exporter.__name__).setLevel(logging.ERROR)
        exporters.append(trace_exporter.OTLPSpanExporter(endpoint=traces_url(settings.otlp_endpoint),
                                                         timeout=settings.export_timeout_seconds))
    processors: list[tuple[SpanProcessor, SpanExporter]] = []
    for exporter in exporters:
        processor = BatchSpanProcessor(exporter, export_timeout_millis=int(settings.export_timeout_seconds * 1000))
        provider.add_span_processor(processor)
        processors.append((processor, exporter))
    return provider, processors


def _call_attributes(record: CompletionRecord) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat", "gen_ai.system": record.engine,
        "gen_ai.request.model": record.model or "", "gen_ai.response.id": record.completion_id,
        "gen_ai.usage.input_tokens": len(record.prompt_ids), "gen_ai.usage.output_tokens": len(record.response_ids),
        "gen_ai.response.finish_reasons": [record.finish_reason or ""],
        "polar_gym.completion_id": record.completion_id, "polar_gym.session_id": record.session_id,
        "polar_gym.call_index": record.index, "polar_gym.provider": record.provider,
        "polar_gym.route": record.path or "", "polar_gym.engine": record.engine, "polar_gym.status": record.status,
        "polar_gym.stream": record.stream, "polar_gym.side_request": record.side_request,
    }
    if record.policy_version is not None:
        attributes["polar_gym.policy_version"] = str(record.policy_version)
    if record.server:
        attributes["polar_gym.server"] = record.server
    if record.prompt_mode:
        attributes["polar_gym.prompt_mode"] = record.prompt_mode
    if record.error:
        attributes["error.type"] = record.error.split(":", 1)[0]
        attributes["polar_gym.error"] = record.error
    return attributes


class SessionTracer:
    """Spans of finished sessions, exported in the background. ``close`` flushes (bounded by the export timeout)."""

    def __init__(self, settings: TelemetrySettings) -> None:
        self.settings = settings
        self.provider, self._processors = _provider(settings)
        self.tracer: Tracer = self.provider.get_tracer("polar_gym.gateway")
        self._closed = False

    def session(self, result: SessionResult, *, harness: str, records: Sequence[CompletionRecord] = (),
                teardown_seconds: float = 0.0) -> None:
        """The spans of one finished session (a session without a status history has none). The gateway calls it
        in a worker thread and logs what it raises: a span is a report, never a reason for a session to fail."""
        from opentelemetry import trace

        stages = stage_intervals(result.metadata.get("status_history") or [])
        if not stages:
            return
        start, end = stages[0][1], max(s[2] for s in stages) + teardown_seconds
        reward = result.evaluation.reward if result.evaluation is not None else None
        attributes: dict[str, Any] = {"polar_gym.session_id": result.session_id, "polar_gym.task_id": result.task_id,
                                      "polar_gym.harness": harness, "polar_gym.status": result.status.value,
                                      "polar_gym.completions": len(records)}
        if reward is not None:
            attributes["polar_gym.reward"] = float(reward)
        cause = error_cause(result)  # the launch's and the report's rule
        if cause:
            attributes["polar_gym.cause"] = cause
        if result.reason:
            attributes["polar_gym.reason"] = result.reason[:500]
        root = self.tracer.start_span("session", start_time=_ns(start), attributes=attributes)
        if result.status is not SessionStatus.COMPLETED:
            root.set_status(trace.Status(trace.StatusCode.ERROR, result.reason or result.status.value))
        spans: dict[str, Span] = {}
        for stage, at, until in stages:
            parent = spans.get("postrun", root) if stage in _NESTED else root
            spans[stage] = span = self.tracer.start_span(stage, context=trace.set_span_in_context(parent),
                                                         start_time=_ns(at),
                                                         attributes={"polar_gym.stage": stage,
                                                                     "polar_gym.session_id": result.session_id})
            span.end(end_time=_ns(until))
        run = spans.get("run", root)
        for record in records:
            call = self.tracer.start_span(f"chat {record.model or ''}".strip(), context=trace.set_span_in_context(run),
                                          kind=trace.SpanKind.CLIENT, start_time=_ns(record.started_at),
                                          attributes=_call_attributes(record))
            if record.status != "ok":
                call.set_status(trace.Status(trace.StatusCode.ERROR, record.error or "error"))
            call.end(end_time=_ns(record.started_at + record.total_seconds))
        root.end(end_time=_ns(end))

    def close(self) -> None:
        """Export what is queued and stop, once. Each exporter gets the export timeout (plus a second): a collector
        that is down then has its retries cut short and what it still had queued is dropped."""
        if self._closed:
            return
        self._closed = True
        for processor, exporter in self._processors:
            flush = threading.Thread(target=processor.shutdown, name="polar_gym-spans-flush", daemon=True)
            flush.start()
            flush.join(self.settings.export_timeout_seconds + 1.0)
            if flush.is_alive():
                exporter.shutdown()  # interrupts the exporter's retries; the worker then drains at once
                flush.join(1.0)
