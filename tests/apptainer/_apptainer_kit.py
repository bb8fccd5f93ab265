"""Fixtures for the apptainer tests: a fake ``apptainer``/``singularity`` on PATH (``fake_apptainer.py``)."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

FAKE = Path(__file__).with_name("fake_apptainer.py")


@dataclass
class FakeApptainer:
    """The fake CLI's bin directory, state directory and argv log."""

    bin_dir: Path
    state: Path

    def calls(self) -> list[list[str]]:
        log = self.state / "argv.log"
        if not log.exists():
            return []
        return [json.loads(line)["args"] for line in log.read_text().splitlines()]

    def verbs(self) -> list[str]:
        """Each call reduced to its verb (``--version``, ``instance start``, ``exec``, ...), global flags dropped."""
        out = []
        for args in self.calls():
            args = [a for a in args if a not in ("--quiet", "--debug")]
            out.append(" ".join(args[:2]) if args[0] in ("instance", "overlay") else args[0])
        return out

    def instances(self) -> list[dict]:
        """The live instances (a record whose process died is a crashed instance, not a running one)."""
        docs = [json.loads(p.read_text()) for p in self.state.glob("*.json")]
        return [d for d in docs if _alive(d["pid"])]

    def kill_instance(self, name: str) -> None:
        """Simulate a crash: the instance's process dies and its record goes."""
        doc = json.loads((self.state / f"{name}.json").read_text())
        os.kill(doc["pid"], signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def make_fake(root: Path, names: tuple[str, ...] = ("singularity", "apptainer")) -> FakeApptainer:
    bin_dir, state = root / "bin", root / "state"
    bin_dir.mkdir(parents=True)
    state.mkdir(parents=True)
    for name in names:
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nFAKE_ARGV0={name} exec "{sys.executable}" "{FAKE}" "$@"\n')
        shim.chmod(0o755)
    return FakeApptainer(bin_dir, state)


@pytest.fixture(autouse=True)
def fake_switches_reach_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend starts apptainer with a fixed environment of its own plus the operator's ``APPTAINER_*``
    settings (issue 35); the fake's state directory and switches (``FAKE_*``) travel the same way."""
    from polar_gym.apptainer import commands

    monkeypatch.setattr(commands, "HOST_PREFIXES", (*commands.HOST_PREFIXES, "FAKE_"))


@pytest.fixture
def fake_apptainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeApptainer]:
    """Both names on PATH (as Apptainer installs them); every instance left running is killed afterwards."""
    fake = make_fake(tmp_path / "fake")
    monkeypatch.setenv("PATH", f"{fake.bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_APPTAINER_STATE", str(fake.state))
    yield fake
    for doc in fake.instances():
        try:
            os.kill(doc["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
