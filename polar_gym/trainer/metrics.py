"""A run's ``train_metrics.jsonl`` (one object per step) and its plot.

The plot is a small self-written SVG (one panel per metric, step on x): matplotlib is not a dependency of the
project, and a curve of a few dozen points needs no more.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "svg_plot"]


class MetricsLog:
    """Appends one JSON line per step to ``path`` (flushed, so a crash keeps the steps so far)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        self.path.write_text("", encoding="utf-8")

    def write(self, row: Mapping[str, Any]) -> None:
        self.rows.append(dict(row))
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")

    def plot(self, out: str | Path, keys: Sequence[str], title: str = "") -> Path:
        path = Path(out)
        path.write_text(svg_plot(self.rows, keys, title), encoding="utf-8")
        return path


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def svg_plot(rows: Sequence[Mapping[str, Any]], keys: Sequence[str], title: str = "",
             width: int = 420, height: int = 200) -> str:
    """Pure: one line panel per key (its value against ``step``), stacked, as an SVG document."""
    pad, panels = 40, [k for k in keys if any(_finite(r.get(k)) for r in rows)]
    total = 30 + len(panels) * (height + 20)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 2 * pad}" height="{total}" '
             'font-family="sans-serif" font-size="11">',
             f'<text x="{pad}" y="18" font-size="13">{escape(title)}</text>']
    for n, key in enumerate(panels):
        points = [(float(r.get("step", i)), float(r[key])) for i, r in enumerate(rows) if _finite(r.get(key))]
        top = 30 + n * (height + 20)
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1

        def at(x: float, y: float, x0: float = x0, x1: float = x1, y0: float = y0, y1: float = y1,
               top: int = top) -> str:
            return f"{pad + (x - x0) / (x1 - x0) * width:.1f},{top + height - (y - y0) / (y1 - y0) * height:.1f}"

        parts += [f'<rect x="{pad}" y="{top}" width="{width}" height="{height}" fill="none" stroke="#999"/>',
                  f'<text x="{pad + 4}" y="{top + 12}">{escape(key)}</text>',
                  f'<text x="2" y="{top + 10}">{y1:.3g}</text><text x="2" y="{top + height}">{y0:.3g}</text>',
                  f'<text x="{pad}" y="{top + height + 12}">step {x0:g}</text>',
                  f'<text x="{pad + width - 50}" y="{top + height + 12}">step {x1:g}</text>',
                  f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" '
                  f'points="{" ".join(at(x, y) for x, y in points)}"/>']
        parts += [f'<circle cx="{at(x, y).split(",")[0]}" cy="{at(x, y).split(",")[1]}" r="2" fill="#1f77b4"/>'
                  for x, y in points]
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
