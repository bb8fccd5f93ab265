"""``python -m polar_gym.report OUT_DIR``: rebuild report.html from a finished run's files (a Slurm run, an older
run, or after editing nothing but wanting the page)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from polar_gym.report.files import load_run, write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m polar_gym.report", description=__doc__)
    parser.add_argument("out_dir", type=Path, help="the run's folder (results.jsonl, trajectories.jsonl, config.yaml)")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default OUT_DIR/report.html)")
    parser.add_argument("--title", default=None, help="the page's title")
    args = parser.parse_args(argv)
    if not (args.out_dir / "results.jsonl").exists():
        print(f"polar_gym.report: no results.jsonl in {args.out_dir}", file=sys.stderr)
        return 2
    started = time.monotonic()
    run = load_run(args.out_dir, args.title)
    path = write_report(run, args.out or args.out_dir / "report.html")
    print(f"report: {path} ({len(run.sessions)} sessions, {path.stat().st_size / 1024:.0f} KiB, "
          f"{time.monotonic() - started:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
