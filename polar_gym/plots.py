"""Plots as SVG text, drawn by matplotlib (Agg-free: a bare ``Figure``, no pyplot, no global backend state).

Why SVG text: report.html inlines every plot so the file opens offline, and ``train_metrics.svg`` is a file a
researcher opens in a browser. Text stays text (``svg.fonttype=none``: small files, the page's own font); math
parsing is off, so a ``$`` in a task id is just a character; ids are salted per figure, so figures inlined in one
page never share an id. matplotlib is imported on first use only: a launch validates its config without it.

Confidence bands (:func:`band`): a row gives key ``K`` an interval either explicitly, ``K_lo`` and ``K_hi`` (a
binomial or bootstrap interval, which need not be symmetric), or by a standard error, ``K_se`` (or ``S_se`` for a
key ``S_mean``: ``reward_mean`` and ``reward_se``), drawn as ``K +- 1.96 * se`` (95 % under a normal approximation).
An explicit interval wins over a standard error. A line is drawn shaded between its bands wherever a row has one.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["PALETTE", "Z95", "arm_panels", "band", "figure", "label", "line_panels", "svg_of"]

#: the colours every plot of ours uses (colour-blind safe, after Okabe & Ito)
PALETTE = {"blue": "#0072b2", "orange": "#e69f00", "green": "#009e73", "red": "#d55e00", "purple": "#cc79a7",
           "sky": "#56b4e9", "yellow": "#f0e442", "grey": "#7f7f7f"}
#: the normal quantile of a two-sided 95 % interval: a standard error's band is value +- Z95 * se
Z95 = 1.96
#: the colours of a figure's arms (runs on one axes), in order
_ARM_COLOURS = ("blue", "orange", "green", "red", "purple", "sky", "grey", "yellow")
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


def _finite(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def band(row: Mapping[str, Any], key: str) -> tuple[float, float] | None:
    """The row's interval for ``key`` (see the module's docstring), or None when it gives none."""
    lo, hi = row.get(f"{key}_lo"), row.get(f"{key}_hi")
    if _finite(lo) and _finite(hi):
        return float(lo), float(hi)
    value = row.get(key)
    se = row.get(f"{key}_se")
    if not _finite(se) and key.endswith("_mean"):
        se = row.get(key.removesuffix("_mean") + "_se")
    if _finite(value) and _finite(se):
        return float(value) - Z95 * float(se), float(value) + Z95 * float(se)
    return None


def _line(ax: Any, rows: Sequence[Mapping[str, Any]], key: str, colour: str, name: str | None = None) -> bool:
    """``key`` against ``step`` with its band shaded where the rows give one; False when no row has a value."""
    points = [(float(r.get("step", i)), float(r[key]), band(r, key)) for i, r in enumerate(rows) if _finite(r.get(key))]
    if not points:
        return False
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, color=colour, linewidth=1.5,
            label=name)
    banded = [(x, b) for x, _, b in points if b is not None]
    if banded:
        ax.fill_between([x for x, _ in banded], [b[0] for _, b in banded], [b[1] for _, b in banded], color=colour,
                        alpha=0.18, linewidth=0)
    return True


def _no_values(name: str, title: str) -> str:
    with figure(name, 6.4, 1.2) as (fig, ax):
        ax.axis("off")
        ax.text(0.5, 0.5, "no values to plot yet", ha="center", va="center")
        if title:
            fig.suptitle(label(title, 80))
        return svg_of(fig)


def _panel_title(key: str, banded: bool) -> str:
    return label(key, 60) + (" (band: 95 % interval)" if banded else "")


def line_panels(rows: Sequence[Mapping[str, Any]], keys: Sequence[str], title: str = "",
                name: str = "lines") -> str:
    """One panel per key that has a finite value somewhere (its value against ``step``, with its band where the
    rows give one: :func:`band`), stacked, as SVG."""
    panels = [k for k in keys if any(_finite(r.get(k)) for r in rows)]
    if not panels:
        return _no_values(name, title)
    with figure(name, 6.4, 1.9 * len(panels) + 0.4, nrows=len(panels), squeeze=False, sharex=True) as (fig, axes):
        for ax, key in zip(axes[:, 0], panels, strict=True):
            _line(ax, rows, key, PALETTE["blue"])
            ax.set_ylabel(label(key, 30))
            ax.set_title(_panel_title(key, any(band(r, key) for r in rows)), loc="left")
        axes[-1, 0].set_xlabel("step")
        axes[-1, 0].xaxis.get_major_locator().set_params(integer=True)
        if title:
            fig.suptitle(label(title, 80))
        return svg_of(fig)


def arm_panels(arms: Mapping[str, Sequence[Mapping[str, Any]]], keys: Sequence[str], title: str = "",
               name: str = "arms") -> str:
    """Several runs ("arms": treatment seeds, a shuffled control) on the same axes, one panel per key that some arm
    has, each arm a line in its own colour with its band (:func:`band`) and named in the legend, as SVG: the
    figure a claim of learning is read from, the control beside the treatment."""
    panels = [k for k in keys if any(_finite(r.get(k)) for rows in arms.values() for r in rows)]
    if not panels:
        return _no_values(name, title)
    colours = {arm: PALETTE[_ARM_COLOURS[i % len(_ARM_COLOURS)]] for i, arm in enumerate(arms)}
    with figure(name, 6.4, 2.1 * len(panels) + 0.5, nrows=len(panels), squeeze=False, sharex=True) as (fig, axes):
        for ax, key in zip(axes[:, 0], panels, strict=True):
            drawn = [_line(ax, rows, key, colours[arm], label(arm, 30)) for arm, rows in arms.items()]
            banded = any(band(r, key) for rows in arms.values() for r in rows)
            ax.set_ylabel(label(key, 30))
            ax.set_title(_panel_title(key, banded), loc="left")
            if any(drawn):
                ax.legend(loc="best", fontsize=8)
        axes[-1, 0].set_xlabel("step")
        axes[-1, 0].xaxis.get_major_locator().set_params(integer=True)
        if title:
            fig.suptitle(label(title, 80))
        return svg_of(fig)
