"""Read back what the metrics sinks and the span exporters wrote, with the tools' own formats:

- W&B: an offline run's ``run-*.wandb`` record log (a LevelDB-style log of ``wandb_internal_pb2.Record``s: 32 KiB
  blocks, each chunk ``crc32 | length | type``, after a 7-byte ``:W&B`` header). wandb 0.31 ships no Python
  reader (its datastore moved into the Go core), so this decodes the framing and hands each record to wandb's
  own protobuf classes;
- TensorBoard: tensorboard's EventAccumulator;
- OpenTelemetry: a real OTLP/HTTP receiver on loopback decoding ``ExportTraceServiceRequest`` (opentelemetry-proto),
  and the JSON-lines file exporter's lines, both as the same :class:`SpanRow`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

__all__ = ["OtlpReceiver", "SpanRow", "file_spans", "otlp_receiver", "tensorboard_scalars", "wandb_history",
           "wandb_run_dir", "wandb_summary"]

_BLOCK = 32768
_HEADER = 7


def wandb_run_dir(root: Path) -> Path:
    """The one offline run folder under ``root/wandb``."""
    (run,) = sorted((root / "wandb").glob("offline-run-*"))
    return run


def _wandb_records(run_dir: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pos, pending = [], _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        pos += _HEADER
        chunk, pos = data[pos:pos + length], pos + length
        if kind == 0:
            continue
        pending += chunk
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """Every ``run.log`` row, in order (``_step`` is the step)."""
    rows = []
    for record in _wandb_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            rows.append({_key(item): json.loads(item.value_json) for item in record.history.item})
    return rows


def wandb_summary(run_dir: Path) -> dict[str, Any]:
    """The run's summary: every summary update, the last one winning."""
    summary: dict[str, Any] = {}
    for record in _wandb_records(run_dir):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                summary[_key(item)] = json.loads(item.value_json)
    return summary


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of every scalar in the event files under ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


@dataclass
class SpanRow:
    """One span, whichever way it was exported (ids as hex without 0x, times in ns)."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    start: int
    end: int
    attributes: dict[str, Any]
    resource: dict[str, Any] = field(default_factory=dict)
    status: str = "UNSET"


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def _rows_of_request(body: bytes) -> list[SpanRow]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    rows = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope in resource_spans.scope_spans:
            for span in scope.spans:
                rows.append(SpanRow(
                    name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                    parent_id=span.parent_span_id.hex() or None, start=span.start_time_unix_nano,
                    end=span.end_time_unix_nano, attributes={a.key: _value(a.value) for a in span.attributes},
                    resource=resource, status={0: "UNSET", 1: "OK", 2: "ERROR"}[span.status.code]))
    return rows


@dataclass
class OtlpReceiver:
    url: str
    spans: list[SpanRow] = field(default_factory=list)
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@contextlib.contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """A real OTLP/HTTP traces endpoint on loopback (POST /v1/traces, protobuf); yields what it received."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    receiver = OtlpReceiver(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            ok = self.path == "/v1/traces" and self.headers.get("content-type") == "application/x-protobuf"
            if ok:
                rows = _rows_of_request(body)
                with receiver.lock:
                    receiver.spans += rows
                    receiver.requests += 1
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200 if ok else 400)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _ns(text: str) -> int:
    moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return int(moment.timestamp()) * 1_000_000_000 + moment.microsecond * 1000


def file_spans(path: Path) -> list[SpanRow]:
    """The JSON-lines file exporter's spans (its times have microsecond precision)."""
    rows = []
    for line in path.read_text().splitlines():
        span = json.loads(line)
        rows.append(SpanRow(
            name=span["name"], trace_id=span["context"]["trace_id"].removeprefix("0x"),
            span_id=span["context"]["span_id"].removeprefix("0x"),
            parent_id=span["parent_id"].removeprefix("0x") if span.get("parent_id") else None,
            start=_ns(span["start_time"]), end=_ns(span["end_time"]), attributes=span["attributes"],
            resource=span["resource"]["attributes"], status=span["status"]["status_code"]))
    return rows
