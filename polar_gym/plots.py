"""Plots as SVG text, drawn by matplotlib (Agg-free: a bare ``Figure``, no pyplot, no global backend state).

Why SVG text: report.html inlines every plot so the file opens offline, and ``train_metrics.svg`` is a file a
researcher opens in a browser. Text stays text (``svg.fonttype=none``: small files, the page's own font); math
parsing is off, so a ``$`` in a task id is just a character; ids are salted per figure, so figures inlined in one
page never share an id. matplotlib is imported on first use only: a launch validates its config without it.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["PALETTE", "figure", "label", "line_panels", "svg_of"]

#: the colours every plot of ours uses (colour-blind safe, after Okabe & Ito)
PALETTE = {"blue": "#0072b2", "orange": "#e69f00", "green": "#009e73", "red": "#d55e00", "purple": "#cc79a7",
           "sky": "#56b4e9", "yellow": "#f0e442", "grey": "#7f7f7f"}
_GROUP_ID = re.compile(r'<g id="[^"]*"')
_RC = {"svg.fonttype": "none", "text.parse_math": False, "font.size": 9.0, "axes.titlesize": 10.0,
       "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
       "figure.dpi": 96.0}


@contextlib.contextmanager
def figure(name: str, width: float = 6.4, height: float = 3.2, **subplots: Any) -> Iterator[tuple[Figure, Any]]:
    """A figure with its axes (``subplots`` as for ``Figure.subplots``), under our style; ``name`` salts the SVG
    ids. Use with :func:`svg_of` inside the block."""
    import matplotlib
    from matplotlib.figure import Figure

    rc: dict[Any, Any] = {**_RC, "svg.hashsalt": name}  # matplotlib types its keys as a Literal of every name
    with matplotlib.rc_context(rc):
        fig = Figure(figsize=(width, height), layout="constrained")
        axes = fig.subplots(**subplots)
        yield fig, axes


def svg_of(fig: Figure) -> str:
    """The figure as one ``<svg>`` element (no XML prolog, doctype or metadata): inlinable in HTML (ids unique per
    figure), and still a valid stand-alone SVG file."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    text = buf.getvalue()
    # matplotlib names its groups figure_1, axes_1...: the same in every figure, and nothing refers to them
    return _GROUP_ID.sub("<g", text[text.index("<svg"):])


def label(text: str, limit: int = 40) -> str:
    """A run's string made safe for a plot label: printable only (XML cannot carry control characters), cut to
    ``limit`` characters. matplotlib escapes ``<`` and ``&`` itself."""
    kept = "".join(c if c.isprintable() else "\N{REPLACEMENT CHARACTER}" for c in text)
    return kept if len(kept) <= limit else kept[:limit - 1] + "…"


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def line_panels(rows: Sequence[Mapping[str, Any]], keys: Sequence[str], title: str = "",
                name: str = "lines") -> str:
    """One panel per key that has a finite value somewhere (its value against ``step``), stacked, as SVG."""
    panels = [k for k in keys if any(_finite(r.get(k)) for r in rows)]
    if not panels:
        with figure(name, 6.4, 1.2) as (fig, ax):
            ax.axis("off")
            ax.text(0.5, 0.5, "no values to plot yet", ha="center", va="center")
            if title:
                fig.suptitle(label(title, 80))
            return svg_of(fig)
    with figure(name, 6.4, 1.9 * len(panels) + 0.4, nrows=len(panels), squeeze=False, sharex=True) as (fig, axes):
        for ax, key in zip(axes[:, 0], panels, strict=True):
            points = [(float(r.get("step", i)), float(r[key])) for i, r in enumerate(rows) if _finite(r.get(key))]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3,
                    color=PALETTE["blue"], linewidth=1.5)
            ax.set_ylabel(label(key, 30))
            ax.set_title(label(key, 60), loc="left")
        axes[-1, 0].set_xlabel("step")
        axes[-1, 0].xaxis.get_major_locator().set_params(integer=True)
        if title:
            fig.suptitle(label(title, 80))
        return svg_of(fig)
