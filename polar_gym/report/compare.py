"""``python -m polar_gym.report.compare RUN_DIR [RUN_DIR ...] [--out compare.html] [--name NAME=RUN_DIR]``: training
runs on the same axes, one page (issue 36: a claim of learning is read against a control, treatment seeds and the
shuffled-reward control drawn together with their 95 % bands).

Each RUN_DIR is a training run's out_dir (``+trainer=...``: ``trainer/train_metrics.jsonl``, ``config.yaml``), e.g.
the jobs of one sweep: ``python -m polar_gym.report.compare runs/arms/*``. A run is named by what differs between
the runs' configs (``seed=1 shuffle_rewards=true``; where they run and log is not a difference), or by ``--name``.
The page: the curves of :data:`KEYS` (:func:`polar_gym.plots.arm_panels`), a table of each run's first and last
step and how many of its steps trained, and the config keys that differ. Its own command rather than a mode of
``python -m polar_gym.report``: that one rebuilds one run's report.html from its sessions (results.jsonl), this one
reads only the training metrics of several runs.

Exit codes: 0 the page was written; 2 a RUN_DIR that is missing, holds no train_metrics.jsonl or no rows, or a bad
``--name``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from polar_gym.plots import arm_panels
from polar_gym.private_files import open_private
from polar_gym.report.files import read_jsonl
from polar_gym.report.render import _CSS, CSP, _e, _table
from polar_gym.report.training import trained_summary
from polar_gym.settings import flat_items

__all__ = ["IGNORED_KEYS", "KEYS", "CompareError", "Run", "arm_names", "compare_html", "differences", "load_runs",
           "main", "steps_trained"]

#: the curves compared, in this order (a key no run has gets no panel)
KEYS = ["eval/share_right", "eval/p_right", "reward_mean", "eval/greedy_success"]
#: config keys (and the keys under them) that say where and how a run ran, not what it trained: never an arm's name
IGNORED_KEYS = ("out_dir", "state_dir", "resume", "launcher", "inference.upstreams", "inference.await_upstreams",
                "logging", "telemetry")
METRICS = Path("trainer") / "train_metrics.jsonl"


class CompareError(Exception):
    """A run that cannot be compared (exit 2), the message naming the folder and what is missing."""


@dataclass
class Run:
    """One training run: its folder, train_metrics.jsonl's rows, its flattened config.yaml, and its name."""

    out_dir: Path
    rows: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    name: str = ""



def _config(out_dir: Path) -> dict[str, Any]:
    path = out_dir / "config.yaml"
    if not path.is_file():
        return {}
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as exc:  # not YAML: the run is still compared, named by its folder
        print(f"polar_gym.report.compare: {path} cannot be read ({type(exc).__name__}); its run is named by its "
              "folder", file=sys.stderr)
        return {}
    return dict(flat_items(data))


def load_runs(out_dirs: Sequence[Path]) -> list[Run]:
    """Each folder's rows and config; a CompareError naming every folder that is missing or holds no rows."""
    runs, problems = [], []
    for out_dir in out_dirs:
        metrics = out_dir / METRICS
        if not out_dir.is_dir():
            problems.append(f"{out_dir}: no such folder")
        elif not metrics.is_file():
            problems.append(f"{out_dir}: no {METRICS} (the out_dir of a training run: python -m polar_gym.launch "
                            "+trainer=grpo|sft ...)")
        else:
            try:
                rows = [r for r in read_jsonl(metrics) if isinstance(r, dict)]
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                problems.append(f"{metrics}: cannot be read ({type(exc).__name__}: {exc})")
                continue
            if rows:
                runs.append(Run(out_dir, rows, _config(out_dir)))
            else:
                problems.append(f"{metrics}: no rows (did the run train a step?)")
    if problems:
        raise CompareError("; ".join(problems))
    return runs


def _ignored(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in IGNORED_KEYS)


def _text(value: Any) -> str:
    """A config value as YAML writes it (true, null, 0.1, [a, b])."""
    return value if isinstance(value, str) else json.dumps(value)


def differences(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The config keys whose values are not the same in every config (an absent key counts as a value), in the
    order of the first config; where and how a run ran (:data:`IGNORED_KEYS`) is left out."""
    keys = list(dict.fromkeys(k for c in configs for k in c))
    missing = object()
    return [k for k in keys if not _ignored(k)
            and len({json.dumps(c.get(k, missing), default=repr, sort_keys=True) for c in configs}) > 1]


def arm_names(runs: Sequence[Run], given: Mapping[Path, str] | None = None) -> list[str]:
    """Each run's name: ``given`` (from ``--name``), else ``KEY=VALUE`` for each key that differs between the runs
    (the last part of the key when that is unambiguous: ``seed=1 shuffle_rewards=true``), else its folder's name;
    a name two runs would share gets its folder's name after it."""
    given = given or {}
    keys = differences([r.config for r in runs])
    lasts = [k.rsplit(".", 1)[-1] for k in keys]
    short = {k: last if lasts.count(last) == 1 else k for k, last in zip(keys, lasts, strict=True)}
    names = []
    for run in runs:
        parts = [f"{short[k]}={_text(run.config[k]) if k in run.config else 'unset'}" for k in keys]
        names.append(given.get(run.out_dir) or " ".join(parts) or run.out_dir.name or str(run.out_dir))
    return [f"{n} ({r.out_dir.name})" if names.count(n) > 1 else n for n, r in zip(names, runs, strict=True)]


def steps_trained(rows: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """(steps that trained, steps): the rows of step 1 on; a row without a verdict (``trained``; SFT, an older run)
    counts as trained, as report.html's banner does."""
    steps = [r for r in rows if not (isinstance(r.get("step"), int) and r["step"] < 1)]
    return sum(r.get("trained") is not False for r in steps), len(steps)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _first_last(rows: Sequence[Mapping[str, Any]], key: str) -> str:
    """``first → last`` of ``key`` over the rows that have it, saying the step it starts at when that is not the
    run's first (reward_mean has no step 0: that row only evaluates)."""
    have = [r for r in rows if _finite(r.get(key))]
    if not have:
        return "-"
    text = f"{have[0][key]:.3f} → {have[-1][key]:.3f}"
    return text if have[0] is rows[0] else f"{text} (from step {have[0].get('step', '?')})"


def _runs_table(runs: Sequence[Run], keys: Sequence[str]) -> str:
    shown = [k for k in keys if any(_finite(r.get(k)) for run in runs for r in run.rows)]
    rows = []
    for run in runs:
        trained, steps = steps_trained(run.rows)
        rows.append([run.name, str(run.out_dir), f"{trained} of {steps} steps trained",
                     f"{run.rows[0].get('step', '?')} → {run.rows[-1].get('step', '?')}",
                     *(_first_last(run.rows, k) for k in shown)])
    return _table(["run", "folder", "trained", "steps", *shown], rows, numeric=range(4, 4 + len(shown)))


def _differences_table(runs: Sequence[Run]) -> str:
    keys = differences([r.config for r in runs])
    if not keys:
        return '<p class="note">The runs\' configs do not differ (apart from where they ran).</p>'
    return _table(["key", *(r.name for r in runs)],
                  [[k, *(_text(r.config[k]) if k in r.config else "unset" for r in runs)] for k in keys])


def compare_html(runs: Sequence[Run], keys: Sequence[str] = KEYS, title: str | None = None,
                 generated: datetime.datetime | None = None) -> str:
    """The page (report.html's look: its CSS and Content-Security-Policy, inline SVG, no script)."""
    title = title or f"{len(runs)} training runs compared"
    when = (generated or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%d %H:%M:%S UTC")
    svg = arm_panels({run.name: run.rows for run in runs}, keys, name="compare")
    banners = "".join(f'<p class="banner bad">{_e(run.name)}: {_e(summary)}</p>'
                      for run in runs if (summary := trained_summary(run.rows)))
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_e(title)} · polar_gym comparison</title><style>{_CSS}</style></head>\n<body>"
            f"<header><h1>{_e(title)}</h1><p>{_e(', '.join(r.name for r in runs))} · generated {when}</p></header>"
            f'<main>{banners}<section id="curves"><h2>Curves</h2><figure id="fig-compare">{svg}</figure>'
            '<p class="note">Each run a line in its own colour; shaded: a 95 % interval where the step has one '
            "(reward_mean +- 1.96 reward_se; an evaluation's KEY_lo..KEY_hi). Step 0 is the evaluation before the "
            "first update.</p></section>"
            f'<section id="runs"><h2>Runs</h2>{_runs_table(runs, keys)}'
            '<p class="note">Each key at the first and the last step of the run that has it (step 0: before the first '
            "update).</p></section>"
            f'<section id="differences"><h2>What differs</h2>{_differences_table(runs)}</section>'
            "</main></body></html>\n")


def _named(pairs: Sequence[str]) -> dict[Path, str]:
    named = {}
    for pair in pairs:
        name, sep, folder = pair.partition("=")
        if not sep or not name or not folder:
            raise CompareError(f"--name {pair!r}: give NAME=RUN_DIR")
        named[Path(folder)] = name
    return named


def main(argv: list[str] | None = None) -> int:
    """The command line; the exit code."""
    parser = argparse.ArgumentParser(prog="python -m polar_gym.report.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", type=Path, nargs="*", metavar="RUN_DIR", help="a training run's out_dir")
    parser.add_argument("--out", type=Path, default=Path("compare.html"), help="where to write (default compare.html)")
    parser.add_argument("--name", action="append", default=[], metavar="NAME=RUN_DIR",
                        help="the name of RUN_DIR on the page (added to the runs if not listed); repeat per run")
    parser.add_argument("--title", default=None, help="the page's title")
    args = parser.parse_args(argv)
    try:
        named = _named(args.name)
        folders = list(dict.fromkeys([*args.run_dirs, *named]))
        if not folders:
            raise CompareError("no RUN_DIR given")
        runs = load_runs(folders)
    except CompareError as exc:
        print(f"polar_gym.report.compare: {exc}", file=sys.stderr)
        return 2
    for run, name in zip(runs, arm_names(runs, named), strict=True):
        run.name = name
    with open_private(args.out) as f:
        f.write(compare_html(runs, title=args.title))
    print(f"compare: {args.out} ({len(runs)} runs: {'; '.join(r.name for r in runs)}; "
          f"{args.out.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
