"""A span exporter to a JSON-lines file (one ``ReadableSpan.to_json`` object per line): spans of offline runs and
tests, readable with nothing but ``json``. Imports opentelemetry: only :mod:`polar_gym.telemetry.spans` loads it,
when ``telemetry.file`` is set."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

__all__ = ["JsonLinesSpanExporter"]


class JsonLinesSpanExporter(SpanExporter):
    """Appends every exported span to ``path`` as one compact JSON line."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(json.loads(span.to_json())) + "\n" for span in spans)
        try:
            with self._lock, self.path.open("a", encoding="utf-8") as f:
                f.write(lines)
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS
