"""Where ``launcher=slurm`` puts its jobs: #SBATCH options per kind of job (the rollout server, inference servers,
gateways), and ``spread``, which keeps the kinds on different nodes.

The launcher submits the kinds in order and waits for each to be up before the next (server, then inference, then
gateways), so ``spread`` needs no scheduler feature: a kind's jobs exclude the nodes the earlier kinds run on. Which
node each job ran on is read from ``squeue`` once it runs and written to ``jobs.json``.

With the rollout server in the launcher's process (``server=local``), the jobs must reach this host: its FQDN is the
default, unless it resolves to a loopback address (``127.0.1.1 host`` in a Debian /etc/hosts), which on a compute
node means that node itself; then the address this host uses toward the Slurm controller is taken instead."""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
import subprocess
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["JobKind", "PlacementSettings", "controller_address", "job_kind", "launcher_host", "placement_parameters",
           "route_address", "running_nodes"]

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


def launcher_host(controller: tuple[str, int] | None = None) -> str:
    """How jobs on other nodes reach this host: its FQDN, or if that name is loopback here, this host's address
    toward ``controller`` (default: the Slurm controller's, from ``scontrol show config``)."""
    fqdn = socket.getfqdn()
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(fqdn)).is_loopback
    except (OSError, ValueError):
        loopback = True
    if not loopback:
        return fqdn
    controller = controller or controller_address()
    address = route_address(*controller) if controller else None
    return address or fqdn


def controller_address() -> tuple[str, int] | None:
    """The first SlurmctldHost's address (or name) and SlurmctldPort, from ``scontrol show config``."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    host = re.search(r"^SlurmctldHost\[0\]\s*=\s*([^\s(]+)(?:\(([^)]+)\))?", out, re.M)
    port = re.search(r"^SlurmctldPort\s*=\s*(\d+)", out, re.M)
    if not host:
        return None
    return host.group(2) or host.group(1), int(port.group(1)) if port else 6817


def route_address(host: str, port: int) -> str | None:
    """The local address the kernel would send from to reach ``host`` (a UDP connect sends no packet)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])
    return None
