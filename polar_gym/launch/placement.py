"""Where ``launcher=slurm`` puts its jobs: #SBATCH options per kind of job (the rollout server, inference servers,
gateways), and ``spread``, which keeps the kinds on different nodes.

The launcher submits the kinds in order and waits for each to be up before the next (server, then inference, then
gateways), so ``spread`` needs no scheduler feature: a kind's jobs exclude the nodes the earlier kinds run on. Which
node each job ran on is read from ``squeue`` once it runs and written to ``jobs.json``."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["JobKind", "PlacementSettings", "job_kind", "placement_parameters", "running_nodes"]

JobKind = Literal["server", "inference", "gateway"]
_PREFIXES: dict[str, JobKind] = {"polar-server": "server", "polar-inference": "inference", "polar-gateway": "gateway"}


class PlacementSettings(BaseModel):
    """The ``launcher.placement`` keys."""

    model_config = ConfigDict(extra="forbid")

    spread: bool = Field(default=False, description="keep the kinds apart: the server job, the inference jobs and "
                         "the gateway jobs each on nodes the others do not use (gateways may share nodes with each "
                         "other); needs as many free nodes as kinds, or the later jobs wait in the queue")
    server: dict[str, Any] = Field(default_factory=dict, description="#SBATCH options of the server job "
                                   "(server=job) on top of additional_parameters, e.g. {nodelist: node1}")
    inference: dict[str, Any] = Field(default_factory=dict, description="#SBATCH options of the inference jobs, "
                                      "e.g. {constraint: h100}")
    gateway: dict[str, Any] = Field(default_factory=dict, description="#SBATCH options of the gateway jobs, "
                                    "e.g. {exclude: 'gpu[01-08]'}")


def job_kind(name: str) -> JobKind | None:
    """The kind of a job from the name the launcher gave it (polar-server, polar-inference-0, polar-gateway-3);
    None for any other job (it gets the common options only, and spread does not keep others off its node)."""
    for prefix, kind in _PREFIXES.items():
        if name.startswith(prefix):
            return kind
    return None


def placement_parameters(placement: PlacementSettings, kind: JobKind | None, common: Mapping[str, Any],
                         taken: Mapping[str, JobKind | None]) -> dict[str, Any]:
    """The #SBATCH options (submitit's ``slurm_additional_parameters``) of a job of ``kind``: ``common`` (the
    launcher's additional_parameters), this kind's own on top, and with ``spread`` an ``exclude`` of the nodes the
    other kinds' jobs run on (``taken``: node -> kind), joined to any exclude already given."""
    if kind is None:
        return dict(common)
    params = {**common, **getattr(placement, kind)}
    if placement.spread:
        others = sorted(node for node, other in taken.items() if other not in (kind, None))
        if others:
            given = str(params.get("exclude") or "")
            params["exclude"] = ",".join([given, *others] if given else others)
    return params


def running_nodes(job_ids: list[str]) -> dict[str, str]:
    """job id -> the node(s) squeue lists it on (running jobs only; empty if squeue cannot be asked)."""
    if not job_ids:
        return {}
    try:
        out = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i %N", "-j", ",".join(job_ids)],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    pairs = (line.split(maxsplit=1) for line in out.stdout.splitlines())
    return {pair[0]: pair[1].strip() for pair in pairs if len(pair) == 2}
