"""A run's ``train_metrics.jsonl`` (one object per step) and its plot, ``train_metrics.svg`` (one panel per metric
against the step, drawn by matplotlib through :mod:`polar_gym.plots`; run reports inline the same figure)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polar_gym.plots import line_panels

__all__ = ["MetricsLog", "svg_plot"]


class MetricsLog:
    """Appends one JSON line per step to ``path`` (flushed, so a crash keeps the steps so far). A resumed run passes
    the ``rows`` it keeps (the file already holds them)."""

    def __init__(self, path: str | Path, rows: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = [dict(r) for r in rows or ()]
        if rows is None:
            self.path.write_text("", encoding="utf-8")

    def write(self, row: Mapping[str, Any]) -> None:
        self.rows.append(dict(row))
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")

    def plot(self, out: str | Path, keys: Sequence[str], title: str = "") -> Path:
        path = Path(out)
        path.write_text(svg_plot(self.rows, keys, title), encoding="utf-8")
        return path


def svg_plot(rows: Sequence[Mapping[str, Any]], keys: Sequence[str], title: str = "") -> str:
    """One line panel per key (its value against ``step``), stacked, as an SVG document."""
    return line_panels(rows, keys, title, name="train_metrics")
