"""Where a GRPO run picks up after an earlier job left it (a hand-over before a Slurm time limit, a crash).

After each step the loop writes ``checkpoints/step-N/state/`` next to the weights: ``trainer.pt`` (the optimizer's
state and torch's RNG) and ``loop.json`` (the step, the policy version, the reward-shuffle RNG of the control, and
the feed's groups submitted and not yet trained on). A step counts as done once that folder exists: it is written
after the step's metrics row, by staging and rename, so a job killed halfway through a step leaves the step before
it as the resume point, and the step is redone. A hand-over between steps rewrites ``loop.json`` with the groups
the feed holds at that moment.

The resume (``resume=true``, what a successor job runs) starts at the step after the newest such checkpoint:
it loads the weights and the state, drops the rows of later steps from ``train_metrics.jsonl`` and
``trajectories.jsonl`` (a redone step writes them again), pushes the checkpoint to the fleet (the engines may hold
later weights, or none of the run's) and re-attaches to the groups in ``loop.json``: group ids are deterministic, the
rollout server answers a known one with its stored sessions, so nothing finished runs again.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["STATE", "ResumePoint", "kept_rows", "newest_state", "random_state", "resume_point", "save_state",
           "set_random_state", "update_loop_state"]

#: the state folder inside a step's checkpoint
STATE = "state"


@dataclass(frozen=True)
class ResumePoint:
    """The newest finished step of a run: its number, checkpoint folder, trainer state (``torch.load`` of
    ``trainer.pt``) and loop state (``loop.json``)."""

    step: int
    checkpoint: Path
    trainer: dict[str, Any]
    loop: dict[str, Any]


def save_state(checkpoint: Path, trainer_state: Mapping[str, Any], loop_state: Mapping[str, Any]) -> Path:
    """Write ``checkpoint/state/`` (staging, then rename: a half-written state is never read)."""
    import torch

    staging, final = checkpoint / f"{STATE}.partial", checkpoint / STATE
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    torch.save(dict(trainer_state), staging / "trainer.pt")
    (staging / "loop.json").write_text(json.dumps(loop_state), encoding="utf-8")
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    return final


def update_loop_state(checkpoint: Path, changes: Mapping[str, Any]) -> None:
    """Rewrite ``loop.json`` of a finished step with ``changes`` (the feed's groups at a hand-over), atomically."""
    path = checkpoint / STATE / "loop.json"
    state = {**json.loads(path.read_text(encoding="utf-8")), **changes}
    staging = path.with_name("loop.json.partial")
    staging.write_text(json.dumps(state), encoding="utf-8")
    os.replace(staging, path)


def newest_state(checkpoints: Path) -> tuple[int, Path] | None:
    """The newest step of ``checkpoints`` with complete weights and state, and its folder (nothing loaded)."""
    found = []
    for path in checkpoints.glob("step-*"):
        number = path.name.removeprefix("step-")
        if number.isdigit() and (path / ".complete").exists() and (path / STATE / "loop.json").exists():
            found.append((int(number), path))
    return max(found) if found else None


def resume_point(checkpoints: Path) -> ResumePoint | None:
    """The newest step of ``checkpoints`` with complete weights and state; None when the run has none."""
    import torch

    newest = newest_state(checkpoints)
    if newest is None:
        return None
    step, path = newest
    trainer = torch.load(path / STATE / "trainer.pt", weights_only=True)
    loop = json.loads((path / STATE / "loop.json").read_text(encoding="utf-8"))
    return ResumePoint(step, path, trainer, loop)


def kept_rows(path: Path, last_step: int) -> list[dict[str, Any]]:
    """Rewrite the JSONL file ``path`` keeping the rows of steps up to ``last_step`` (a torn last line goes too);
    the rows kept."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and int(row.get("step", 0)) <= last_step:
            rows.append(row)
    staging = path.with_name(path.name + ".partial")
    staging.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(staging, path)
    return rows


def random_state(rng: random.Random) -> list[Any]:
    """``rng``'s state as JSON."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_random_state(rng: random.Random, state: list[Any]) -> None:
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))
