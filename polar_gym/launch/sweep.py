"""``python -m polar_gym.launch -m KEY=A,B ...``: a Hydra sweep (multirun), one run per combination of the values,
each in a folder of its own under ``out_dir``.

Why this module: every job of a Hydra sweep composes the same ``out_dir`` (the default's ``${now:...}`` is the
sweep's start in every job: Hydra copies its resolver cache), so without it the second job writes over the first
one's files. Here a job's out_dir is ``OUT_DIR/NAME``, NAME the job's swept overrides as Hydra logs the job
(``trainer.seed=1,trainer.shuffle_rewards=True``; the job number when nothing is swept or the name would be too
long): the folder says which arm it holds, ``python -m polar_gym.report.compare OUT_DIR/*`` names the arms the same
way, and the names stay put when the sweep is run again or another value is added, where Hydra's job numbers would
shift. Every job is composed and validated (``build_job``, the earlier-run refusal of its own folder) before the
first one starts: a bad value in one job exits 2 with nothing created and nothing run, as a single run does. A job
that fails does not stop the others (Ctrl-C does); the sweep exits with the highest exit code of its jobs.
"""

from __future__ import annotations

import re
import shlex
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig

from polar_gym.launch.config import build_job
from polar_gym.launch.config_errors import CONFIG_ERRORS, config_error
from polar_gym.launch.earlier_run import check_earlier_run

__all__ = ["INTERRUPTED", "MAX_NAME", "Sweep", "SweepJob"]

#: a job's out_dir name longer than this (bytes) is the job number instead (file names stop at 255)
MAX_NAME = 200
#: the exit code of an interrupted run (Ctrl-C, SIGTERM): it stops the sweep
INTERRUPTED = 130
_UNSAFE = re.compile(r"[^A-Za-z0-9._,=+@-]")


@dataclass
class SweepJob:
    """One job of a sweep as it ended: its number, folder name, out_dir and exit code."""

    num: int
    name: str
    out_dir: Path
    code: int


@dataclass
class Sweep:
    """A multirun command line: its jobs' overrides (Hydra's expansion, in Hydra's order), the keys it sweeps, and
    the jobs run so far."""

    jobs: list[list[str]]
    swept: list[str]
    config_name: str = "config"
    validate: bool = True
    ended: list[SweepJob] = field(default_factory=list)

    @classmethod
    def parse(cls, argv: Sequence[str]) -> Sweep | None:
        """The sweep ``argv`` asks for (Hydra's own parsers), or None: not ``-m``, or a Hydra flag that prints
        instead of running (``--cfg``, ``--info``, ``--help``). With ``--config-dir``/``--config-path`` the jobs are
        validated each when it starts (this module composes from conf/ only)."""
        args = get_args_parser().parse_args(list(argv))
        if not args.multirun or args.help or args.hydra_help or args.cfg or args.info or args.shell_completion \
                or args.experimental_rerun:
            return None
        overrides = OverridesParser.create().parse_overrides(list(args.overrides))
        swept = [o.get_key_element() for o in overrides if o.is_sweep_override()]
        [jobs] = BasicSweeper.split_arguments(overrides, None)
        return cls(jobs=jobs, swept=swept, config_name=args.config_name or "config",
                   validate=args.config_dir is None and args.config_path is None)

    def name(self, overrides: Sequence[str], num: int) -> str:
        """The folder of the job with these overrides: its swept ``KEY=VALUE``s joined by commas (as Hydra's
        override_dirname), characters unsafe in a file name as ``_``; the job number when that is empty or longer
        than :data:`MAX_NAME`."""
        mine = [o for o in overrides if o.partition("=")[0] in self.swept]
        name = _UNSAFE.sub("_", ",".join(mine))
        return name if name and len(name.encode()) <= MAX_NAME and name not in (".", "..") else str(num)

    def out_dir(self, cfg: DictConfig, overrides: Sequence[str], num: int) -> Path:
        """Point ``cfg.out_dir`` (the sweep's folder) at the job's own folder in it; that folder."""
        out = Path(str(cfg.out_dir)) / self.name(overrides, num)
        cfg.out_dir = str(out)
        return out

    def problems(self, conf_dir: Path) -> list[str]:
        """Every job composed and validated as its run will be, before any starts: what is wrong, one line per job
        (empty: all good). Creates nothing."""
        if "out_dir" in self.swept:
            return ["out_dir: a sweep's jobs each get a folder of their own under out_dir (named by their swept "
                    "overrides): give the sweep's folder as one out_dir=DIR, not a list"]
        found: list[str] = []
        names: dict[str, int] = {}
        for num, overrides in enumerate(self.jobs):
            name = self.name(overrides, num)
            if name in names:
                found.append(f"job #{num} ({' '.join(overrides)}): its folder {name!r} is job #{names[name]}'s too "
                             "(the values differ only in characters a file name cannot hold); rename the values")
            names.setdefault(name, num)
            if not self.validate:
                continue
            try:
                with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
                    cfg = compose(self.config_name, overrides=list(overrides))
                self.out_dir(cfg, overrides, num)
                check_earlier_run(build_job(cfg))
            except CONFIG_ERRORS as exc:
                found.append(f"job #{num} ({name}): {config_error(exc)}")
        return found

    def run_job(self, cfg: DictConfig, overrides: Sequence[str], num: int, run: Callable[[DictConfig], int]) -> int:
        """Run one job in its own folder and keep its exit code; an exception is the job's failure (exit 1, its
        traceback printed), not the sweep's end. Interrupted (130): raise SystemExit to stop the sweep."""
        out = self.out_dir(cfg, overrides, num)
        try:
            code = run(cfg)
        except Exception:  # one job's crash; the other jobs still run
            traceback.print_exc()
            print(f"polar_gym.launch: job #{num} ({out}) failed with the error above", file=sys.stderr)
            code = 1
        self.ended.append(SweepJob(num, self.name(overrides, num), out, code))
        if code == INTERRUPTED:
            raise SystemExit(code)
        return code

    @property
    def code(self) -> int:
        """The sweep's exit code: the highest of its jobs' (0: every job's was 0)."""
        return max((job.code for job in self.ended), default=0)

    def summary(self) -> str:
        """The lines printed when the sweep ends: each job's exit code and folder, and how to compare them."""
        lines = [f"polar_gym.launch: sweep of {len(self.ended)} job(s):"]
        lines += [f"  #{job.num} exit {job.code}  {job.out_dir}" for job in self.ended]
        trained = [job.out_dir for job in self.ended if (job.out_dir / "trainer" / "train_metrics.jsonl").exists()]
        if len(trained) > 1:
            lines.append("compare them: python -m polar_gym.report.compare "
                         + " ".join(shlex.quote(str(d)) for d in trained) + " --out compare.html")
        return "\n".join(lines)
