"""The apptainer runtime against a real Apptainer (on a cluster node or a workstation with Apptainer >= 1.1).

Skipped when neither ``apptainer`` nor ``singularity`` is on PATH. The image is ``$POLAR_APPTAINER_IMAGE`` (a .sif
path, or any URI Apptainer accepts) or, by default, ``docker://busybox:1.36`` pulled by Apptainer itself (so the
node needs registry access or a warm cache). How to run: docs/apptainer.md.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from polar_gym.apptainer.runtime import ApptainerRuntime
from polar_gym.runtime.base import ExecStatus
from polar_gym.schema import RuntimeSpec
from tests._waiting import until

BINARY = shutil.which("apptainer") or shutil.which("singularity")
IMAGE = os.environ.get("POLAR_APPTAINER_IMAGE", "docker://busybox:1.36")
OVERLAY = os.environ.get("POLAR_APPTAINER_OVERLAY", "dir")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(BINARY is None, reason="needs a real `apptainer`/`singularity` on PATH (not installable on "
                       "this machine; see docs/apptainer.md for running these on a cluster)"),
]


def make(tmp_path: Path, network: str = "none") -> ApptainerRuntime:
    spec = RuntimeSpec(backend="apptainer", image=IMAGE, network=network)  # type: ignore[arg-type]
    return ApptainerRuntime(spec, tmp_path / "session", options={"binary": BINARY, "overlay": OVERLAY})


async def _runs(rt: ApptainerRuntime, command: str) -> bool:
    return command in (await rt.exec("ps -o args")).text


async def test_end_to_end(tmp_path: Path) -> None:
    rt = make(tmp_path)
    async with rt:
        hello = await rt.exec("echo hello $WHO; id -u; pwd", env={"WHO": "apptainer"})
        assert hello.ok, hello.stderr
        lines = hello.text.splitlines()
        assert lines == ["hello apptainer", "0", "/workspace"]  # --fakeroot: root inside
        # no network: only loopback
        links = await rt.exec("tail -n +3 /proc/net/dev | cut -d: -f1")
        assert links.text.split() == ["lo"]
        # writes go to the overlay in the session dir
        big = await rt.exec("dd if=/dev/zero of=/workspace/big bs=1M count=100 && echo ok")
        assert big.ok and big.text.strip().endswith("ok"), big.stderr
        blob = os.urandom(1 << 20)
        await rt.upload(blob, "/workspace/blob.bin")
        await rt.download("/workspace/blob.bin", tmp_path / "blob.bin")
        assert (tmp_path / "blob.bin").read_bytes() == blob
        slow = await rt.exec("echo partial; sleep 60 & sleep 60", timeout=10)  # room for a loaded machine
        assert slow.status is ExecStatus.TIMEOUT and slow.stdout == b"partial\n"
        left = await rt.exec("ps -o pid,args | grep 'sleep 60' | grep -v grep || true")
        assert "sleep 60" not in left.text
        task = asyncio.create_task(rt.exec("sleep 60"))
        await until(lambda: _runs(rt, "sleep 60"), what="the command to run")
        await rt.cancel()
        assert (await task).status is ExecStatus.CANCELLED
    await rt.stop()  # idempotent
    listed = await asyncio.to_thread(subprocess.run, [str(BINARY), "instance", "list", "--json"],
                                     capture_output=True, text=True, check=False)
    assert rt.instance not in listed.stdout
    assert not (tmp_path / "session" / "overlay").exists()


async def test_crash_is_reported(tmp_path: Path) -> None:
    async with make(tmp_path) as rt:
        await asyncio.to_thread(subprocess.run, [str(BINARY), "instance", "stop", "--force", rt.instance],
                                capture_output=True, check=False)
        result = await asyncio.wait_for(rt.exec("echo hi"), 60)
        assert result.status is ExecStatus.CRASHED


def test_the_offline_harness_sif_builds_and_runs_its_cli(tmp_path: Path) -> None:
    """``build --offline --format sif``: the recipe runtime=docker's image comes from, as a SIF (Bootstrap:
    debootstrap from the host's apt mirror, so the build node needs debootstrap and, unless root, --fakeroot)."""
    import sys

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "polar_gym.apptainer", "build", "--offline", "--format", "sif",
                           "--harness", "pi", "--binary", str(BINARY), "--out", str(tmp_path)], cwd=root,
                          capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    sif = Path(done.stdout.strip().splitlines()[-1])
    assert sif.suffix == ".sif" and sif.is_file()
    for command in (["pi", "--version"], ["git", "--version"], ["python3", "--version"]):
        ran = subprocess.run([str(BINARY), "exec", "--containall", str(sif), *command], capture_output=True,
                             text=True, timeout=300)
        assert ran.returncode == 0, (command, ran.stderr[-2000:])
