"""``python -m polar_gym.launch``: compose conf/ with Hydra, validate it against the wire types, hand the job to the
configured launcher (``launcher._target_``) and exit non-zero if any session errored.

Exit codes: 0 every session completed; 1 a session ended ERROR or CANCELLED (a task the source refused, say a Harbor
task with a link out of its directory, is one such session, ``invalid_task``; the other tasks run); 2 a configuration
error (any: Hydra's, OmegaConf's, a settings model's or ours, each naming its key; every task of the set refused; an
out_dir holding an earlier run without ``resume=true``); 3 an infrastructure failure: an inference upstream failed
the check before the first session (the message names the URL and what it answered), or a session's model calls
failed for infrastructure reasons (see ``outputs.INFRA_CAUSES``).

    python -m polar_gym.launch                                   # pi on the demo tasks, oracle engine, local sandbox
    python -m polar_gym.launch +harness=codex +builder=prefix_merging num_samples=2 out_dir=runs/codex
    python -m polar_gym.launch +trainer=sft trainer.data=[runs/demo/datagen/sft/train.jsonl] out_dir=runs/sft
    python -m polar_gym.launch -m +trainer=grpo trainer.seed=0,1 trainer.shuffle_rewards=false,true out_dir=runs/arms

A sweep (``-m``, Hydra's multirun) runs each combination in ``out_dir/<its swept overrides>`` after validating
every one (:mod:`polar_gym.launch.sweep`), and exits with the highest exit code of its jobs.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from polar_gym.causes import INVALID_TASK
from polar_gym.fleet.upstreams import UpstreamCheckFailed
from polar_gym.launch.config import (
    ConfigError,
    InferenceSettings,
    LaunchJob,
    TaskTemplate,
    build_job,
    build_launcher,
    load_target,
)
from polar_gym.launch.config_errors import CONFIG_ERRORS, Composition, config_error
from polar_gym.launch.earlier_run import check_earlier_run
from polar_gym.launch.relaunch import relay_for
from polar_gym.launch.sweep import Sweep

__all__ = ["CONF_DIR", "ConfigError", "InferenceSettings", "LaunchJob", "TaskTemplate", "UpstreamCheckFailed",
           "build_job", "build_launcher", "load_target", "main", "run"]

#: the Hydra config directory (conf/ at the repository root; the project runs from its clone)
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def run(cfg: DictConfig) -> int:
    """Validate ``cfg``, build its launcher and run the job; the process exit code."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll would drown the live display
    try:
        job = build_job(cfg)  # every key of every group, before anything starts
        resumed = check_earlier_run(job)  # an earlier run in out_dir: refused, or resumed when asked for
    except CONFIG_ERRORS as exc:
        print(f"polar_gym.launch: configuration error: {config_error(exc)}", file=sys.stderr)
        return 2
    if resumed is not None:
        print(f"polar_gym.launch: {resumed}", file=sys.stderr)
    if _SWEEP is None:  # a sweep's jobs share one Slurm job: none of them hands over
        try:
            job.relay, line = relay_for(job.relaunch, job.out_dir, sys.argv[1:])
        except ValueError as exc:
            print(f"polar_gym.launch: configuration error: relaunch.enabled: {exc}", file=sys.stderr)
            return 2
        if job.relay is not None and job.trainer is not None and job.trainer.algorithm != "grpo":
            job.relay, line = None, "relaunch off: an SFT run does not hand over (it cannot be resumed)"
        if line is not None:
            print(f"polar_gym.launch: {line}", file=sys.stderr)
    for task in job.refused:  # each is an ERROR session (invalid_task) of the run; the others run
        print(f"polar_gym.launch: task {task.task_id} refused ({INVALID_TASK}), the run goes on without it: "
              f"{task.problem}", file=sys.stderr)
    assert job.launcher is not None
    try:
        if job.trainer is not None:
            from polar_gym.launch.training import train

            code = train(job)
        else:
            code = int(job.launcher.launch(job))
        if job.handover is not None:
            print(f"polar_gym.launch: {job.handover}: it resumes this run in {job.out_dir} when this job ends "
                  f"({job.out_dir / 'relaunches.jsonl'})", file=sys.stderr)
            return 0
        return code
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C, or SIGTERM
        print(f"polar_gym.launch: interrupted; the unfinished tasks were cancelled (files so far in {job.out_dir})",
              file=sys.stderr)
        return 130
    except ConfigError as exc:
        print(f"polar_gym.launch: configuration error: {exc}", file=sys.stderr)
        return 2
    except UpstreamCheckFailed as exc:
        print(f"polar_gym.launch: {exc}", file=sys.stderr)
        return 3


#: Hydra's composition errors reach main() (exit 2) instead of Hydra's own report (exit 1)
_COMPOSITION = Composition()
#: the sweep main() was asked for (``-m``): Hydra runs its jobs through _hydra_main, which files each in its folder
_SWEEP: Sweep | None = None


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:  # pragma: no cover - process glue
    _COMPOSITION.composed()  # the run's own errors are Hydra's to report again
    if _SWEEP is not None:  # one job of a sweep: its own out_dir; its exit code is kept, the next job runs
        from hydra.core.hydra_config import HydraConfig

        job = HydraConfig.get().job
        _SWEEP.run_job(cfg, list(HydraConfig.get().overrides.task), int(job.num), run)
        return
    code = run(cfg)
    if code:
        sys.exit(code)


def main() -> None:  # pragma: no cover - process glue
    """The console entry point (Hydra parses sys.argv); a config Hydra cannot compose exits 2 naming the key. A
    sweep validates all its jobs first (exit 2 naming each bad one, nothing created) and exits with the highest
    exit code of its jobs."""
    global _SWEEP
    try:
        with _COMPOSITION:
            _SWEEP = Sweep.parse(sys.argv[1:])
            if _SWEEP is not None and (problems := _SWEEP.problems(CONF_DIR)):
                print("polar_gym.launch: configuration error: " + "\n  ".join(["nothing was run:", *problems]),
                      file=sys.stderr)
                sys.exit(2)
            _hydra_main()
    except CONFIG_ERRORS as exc:
        if _COMPOSITION.done:  # raised by the run (the user's HYDRA_FULL_ERROR=1), not by composing
            raise
        print(f"polar_gym.launch: configuration error: {config_error(exc)}", file=sys.stderr)
        sys.exit(2)
    if _SWEEP is not None:
        print(_SWEEP.summary(), file=sys.stderr)
        if _SWEEP.code:
            sys.exit(_SWEEP.code)
