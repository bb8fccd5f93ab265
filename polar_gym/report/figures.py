"""The report's plots, each an inline ``<svg>`` string drawn by matplotlib (:mod:`polar_gym.plots`).

Every figure has a title and axis labels; every string from the run (task ids, causes) goes through
:func:`polar_gym.plots.label` (printable, cut) and matplotlib's own XML escaping. Big runs stay small files: a
strip plot shows at most a few hundred points per stage (a fixed sample), a bar chart at most 40 tasks."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from matplotlib.ticker import FuncFormatter

from polar_gym.plots import PALETTE, figure, label, line_panels, svg_of
from polar_gym.report.model import (
    RunData,
    SessionRow,
    cause_counts,
    reward_per_task,
    slot_use,
    status_counts,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["FIGURES", "fidelity_figure", "figures", "reward_figure", "reward_histogram", "slot_figure",
           "stage_figure", "status_figure", "thin_steps"]

#: the figure ids, in page order (the training figure only when the run trained)
FIGURES = ("status", "rewards", "reward-histogram", "stages", "slots", "fidelity", "training")
_STATUS_COLOURS = {"COMPLETED": PALETTE["green"], "ERROR": PALETTE["red"], "TIMEOUT": PALETTE["orange"],
                   "CANCELLED": PALETTE["grey"]}
_MAX_TASKS = 40
_MAX_POINTS = 300
_MAX_STEPS = 2000


def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color=PALETTE["grey"])
    ax.set_xticks([])
    ax.set_yticks([])


def _count_bars(ax: Axes, counts: Mapping[str, int], *, title: str, xlabel: str, empty: str,
                colour: Callable[[str], str], infra: frozenset[str] = frozenset()) -> None:
    """Horizontal bars of counts by name, largest first from the top (names in ``infra`` hatched and marked)."""
    if counts:
        names = list(counts)[::-1]
        bars = ax.barh([label(n) + (" (infra)" if n in infra else "") for n in names], [counts[n] for n in names],
                       color=[colour(n) for n in names], hatch=["//" if n in infra else "" for n in names],
                       edgecolor="white")
        ax.bar_label(bars, padding=2)
    else:
        _empty(ax, empty)
    ax.set_title(title)
    ax.set_xlabel(xlabel)


def status_figure(sessions: Sequence[SessionRow], infra: frozenset[str]) -> str:
    """Sessions by status (left) and errors by cause (right; infrastructure causes red and hatched)."""
    statuses, causes = status_counts(sessions), cause_counts(sessions)
    with figure("status", 8.0, 0.6 + 0.35 * max(len(statuses), len(causes), 3), ncols=2) as (fig, (left, right)):
        _count_bars(left, statuses, title="Sessions by status", xlabel="sessions", empty="no sessions",
                    colour=lambda n: _STATUS_COLOURS.get(n, PALETTE["blue"]))
        _count_bars(right, causes, title="Errors by cause (red: infrastructure)", xlabel="sessions",
                    empty="no errors", colour=lambda n: PALETTE["red"] if n in infra else PALETTE["orange"],
                    infra=infra)
        return svg_of(fig)


def reward_figure(sessions: Sequence[SessionRow]) -> str:
    """Mean reward per task (the first 40 tasks), each bar labelled with its scored sessions."""
    tasks = reward_per_task(sessions)[:_MAX_TASKS]
    with figure("rewards", 6.4, 0.8 + 0.28 * max(len(tasks), 3)) as (fig, ax):
        scored = [t for t in tasks if t.mean is not None]
        if scored:
            names = [label(t.task_id) for t in scored][::-1]
            bars = ax.barh(names, [t.mean or 0.0 for t in scored][::-1], color=PALETTE["blue"])
            ax.bar_label(bars, labels=[f"{t.mean:.2f} (n={t.scored})" for t in scored][::-1], padding=2)
            ax.set_xlim(min(0.0, *(t.mean or 0.0 for t in scored)), max(1.0, *(t.mean or 0.0 for t in scored)) * 1.25)
        else:
            _empty(ax, "no scored sessions")
        ax.set_title("Mean reward per task" + (f" (first {_MAX_TASKS} tasks)" if len(tasks) == _MAX_TASKS else ""))
        ax.set_xlabel("mean reward")
        return svg_of(fig)


def reward_histogram(sessions: Sequence[SessionRow]) -> str:
    """The distribution of session rewards (scored sessions only: an unscored error is not a 0)."""
    rewards = [s.reward for s in sessions if s.reward is not None]
    with figure("reward-histogram", 6.4, 2.6) as (fig, ax):
        distinct = sorted(set(rewards))
        if rewards and len(distinct) <= 10:  # a few reward levels (pass/fail): one bar each, with its count
            gaps = [b - a for a, b in itertools.pairwise(distinct)]
            counts = [rewards.count(v) for v in distinct]
            bars = ax.bar(distinct, counts, width=0.6 * min(gaps) if gaps else 0.1, color=PALETTE["blue"])
            ax.bar_label(bars, padding=2)
            ax.set_xticks(distinct, [f"{v:g}" for v in distinct])
            ax.margins(x=0.1, y=0.15)
            if len(distinct) == 1:
                ax.set_xlim(distinct[0] - 0.5, distinct[0] + 0.5)
        elif rewards:
            ax.hist(rewards, bins=20, color=PALETTE["blue"], edgecolor="white")
        else:
            _empty(ax, "no scored sessions")
        ax.set_title(f"Reward distribution ({len(rewards)} scored of {len(sessions)} sessions)")
        ax.set_xlabel("reward")
        ax.set_ylabel("sessions")
        return svg_of(fig)


def stage_figure(sessions: Sequence[SessionRow], stages: Sequence[str]) -> str:
    """Seconds per stage: a box per stage and the sessions as points (log scale: stages differ by orders)."""
    data = [[max(s.timings[st], 1e-4) for s in sessions if st in s.timings] for st in stages]
    with figure("stages", 6.4, 3.0) as (fig, ax):
        if any(data):
            shown = [(st, d) for st, d in zip(stages, data, strict=True) if d]
            ax.boxplot([d for _, d in shown], tick_labels=[st for st, _ in shown], showfliers=False,
                       medianprops={"color": PALETTE["red"]})
            pick = random.Random(0)
            for i, (_, d) in enumerate(shown, start=1):
                points = d if len(d) <= _MAX_POINTS else pick.sample(d, _MAX_POINTS)
                ax.scatter([i + pick.uniform(-0.15, 0.15) for _ in points], points, s=6, alpha=0.5,
                           color=PALETTE["blue"], zorder=3)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # not mathtext: math parsing is off
        else:
            _empty(ax, "no stage timings")
        ax.set_title("Seconds per stage (box: quartiles; points: sessions)")
        ax.set_xlabel("stage")
        ax.set_ylabel("seconds (log scale)")
        return svg_of(fig)


def thin_steps(times: Sequence[float], counts: dict[str, list[int]],
               limit: int = _MAX_STEPS) -> tuple[list[float], dict[str, list[int]]]:
    """At most ``limit`` points of a step series: the most sessions of each stage within each of ``limit`` equal
    slices of the run (peaks survive; a 100k-session run stays a small plot)."""
    if len(times) <= limit:
        return list(times), counts
    span = (times[-1] - times[0]) or 1.0
    slots = [times[0] + span * i / limit for i in range(limit)]
    thinned = {stage: [0] * limit for stage in counts}
    for i, t in enumerate(times):
        slot = min(int((t - times[0]) / span * limit), limit - 1)
        for stage, values in counts.items():
            thinned[stage][slot] = max(thinned[stage][slot], values[i])
    return slots, thinned


def slot_figure(sessions: Sequence[SessionRow]) -> str:
    """Sessions in each stage over the run's wall time (from the status histories)."""
    use = slot_use(sessions)
    times, series = thin_steps(use.times, use.counts)
    colours = {"queued": PALETTE["grey"], "init": PALETTE["orange"], "ready": PALETTE["sky"],
               "run": PALETTE["blue"], "postrun": PALETTE["green"]}
    with figure("slots", 6.4, 3.0) as (fig, ax):
        if times:
            for stage, counts in series.items():
                if any(counts):
                    ax.step(times, counts, where="post", label=stage, color=colours.get(stage),
                            linewidth=2.2 if stage == "run" else 1.2)
            ax.legend(loc="upper right", fontsize=8)
            ax.yaxis.get_major_locator().set_params(integer=True)
        else:
            _empty(ax, "no status history")
        ax.set_title("Sessions per stage over time (run-slot use)")
        ax.set_xlabel("seconds since the first session was registered")
        ax.set_ylabel("sessions")
        return svg_of(fig)


def fidelity_figure(run: RunData) -> str:
    """Trainable vs masked tokens, chains per session, new chains by cause."""
    f = run.fidelity
    chains = [s.chains for s in run.sessions if s.chains is not None]
    with figure("fidelity", 9.0, 2.6, ncols=3) as (fig, (tokens, per, breaks)):
        bars = tokens.bar(["trainable", "masked"], [f.trainable_tokens, f.masked_tokens],
                          color=[PALETTE["green"], PALETTE["grey"]])
        tokens.bar_label(bars, padding=2)
        tokens.set_title("Response tokens")
        tokens.set_ylabel("tokens")
        tokens.margins(y=0.15)
        if chains:
            top = max(chains)
            per.hist(chains, bins=range(0, top + 2), align="left", color=PALETTE["blue"], edgecolor="white")
            per.xaxis.get_major_locator().set_params(integer=True)
        else:
            _empty(per, "no trajectories")
        per.set_title("Chains per session")
        per.set_xlabel("chains")
        per.set_ylabel("sessions")
        _count_bars(breaks, f.breaks, title="New chains by cause", xlabel="breaks", empty="no new chains (no breaks)",
                    colour=lambda _: PALETTE["orange"])
        return svg_of(fig)


def figures(run: RunData, stages: Sequence[str]) -> dict[str, str]:
    """Every figure of the page by id (see :data:`FIGURES`)."""
    out = {"status": status_figure(run.sessions, run.infra_causes), "rewards": reward_figure(run.sessions),
           "reward-histogram": reward_histogram(run.sessions), "stages": stage_figure(run.sessions, stages),
           "slots": slot_figure(run.sessions), "fidelity": fidelity_figure(run)}
    if run.train_rows:
        out["training"] = line_panels(run.train_rows, run.train_keys, "Training", name="training")
    return out
