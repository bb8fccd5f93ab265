"""Pinned installs of the Python harnesses (mini-swe-agent, aider, Hermes, the OpenHands SDK), one venv each.

Python agents pin conflicting dependencies (aider pins every package exactly; the OpenHands SDK needs Python 3.12
and a newer litellm than aider's), so each gets its own venv, in ``<cache>/harness-py-<name>-<hash of its pin>/``,
made with a base interpreter of the minor version it needs: Debian's ``/usr/bin/python3.11`` where that suffices
(the sandbox already sees ``/usr``), else the first ``python3.X`` on PATH (pyenv's shims resolve to the real
interpreter), else one pyenv installed but did not select. A marker written after a successful install makes the
call idempotent. The ``local`` sandbox binds the venv and, when it is not under ``/usr``, the base interpreter's
prefix, read-only at the same paths (:func:`installed_cli`): venvs are not relocatable, their scripts name the
venv's python by absolute path.

``python -m polar_gym.harness.pyinstall [NAME...]`` installs the named Python harnesses (default: all) and prints
their binaries; one that cannot be installed here (no interpreter of its version) is reported and skipped.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from polar_gym.assets import cache_root as assets_cache_root
from polar_gym.harness.install import PINS, HarnessInstallError, cli_paths, install_dir

__all__ = ["PY_PINS", "InstalledCli", "PyPin", "base_prefix", "ensure_py_installed", "find_python",
           "installed_cli", "main", "py_install_dir"]


@dataclass(frozen=True)
class PyPin:
    """One Python harness: its PyPI package and exact version, the console script it installs, the minor Python
    version it needs, and the other requirements pinned with it (a litellm the package leaves open)."""

    package: str
    version: str
    binary: str
    python: str = "3.11"
    requires: tuple[str, ...] = field(default_factory=tuple)
    #: the name the harness is run by where it is on PATH (an image): ``binary``, unless that name is taken (the
    #: OpenHands SDK runs with its venv's ``python``, which must not shadow the image's)
    command: str = ""

    @property
    def on_path(self) -> str:
        return self.command or self.binary

    def requirements(self) -> list[str]:
        return [f"{self.package}=={self.version}", *self.requires]


#: the versions seen working here (shared/REFERENCE.md; docs/harnesses/<name>.md)
PY_PINS: dict[str, PyPin] = {
    "mini_swe_agent": PyPin("mini-swe-agent", "2.4.6", "mini", requires=("litellm==1.81.10",)),
    "aider": PyPin("aider-chat", "0.86.2", "aider"),
    "hermes": PyPin("hermes-agent", "0.19.0", "hermes"),
    # an SDK, no CLI: the adapter's runner script runs with the venv's python; the tools are pinned in lockstep
    # (openhands-tools alone would move the SDK back to 1.49.1, whose tools then fail to import)
    "openhands": PyPin("openhands-sdk", "1.58.2", "python", python="3.12", requires=("openhands-tools==1.58.2",),
                       command="openhands-python"),
}

_MARKER = ".polar_gym-installed"


@dataclass(frozen=True)
class InstalledCli:
    """A harness binary on the host and the directories the ``local`` sandbox must bind read-only for it to run."""

    binary: Path
    binds: tuple[Path, ...]


def _pin_text(pin: PyPin) -> str:
    return json.dumps({"requirements": pin.requirements(), "python": pin.python}, sort_keys=True)


def py_install_dir(name: str, pin: PyPin | None = None, cache_root: str | Path | None = None) -> Path:
    """``<cache_root>/harness-py-<name>-<hash>``; the cache root defaults to ``$POLAR_CACHE``, else
    ~/.cache/polar_gym (as for the npm CLIs)."""
    pin = pin or PY_PINS[name]
    digest = hashlib.sha256(_pin_text(pin).encode()).hexdigest()[:12]
    root = Path(cache_root) if cache_root is not None else assets_cache_root()
    return root / f"harness-py-{name.replace('_', '-')}-{digest}"


@cache
def find_python(minor: str) -> Path | None:
    """An interpreter of Python ``minor`` (``"3.12"``): Debian's ``/usr/bin/python3.X`` first, else ``python3.X``
    on PATH resolved to the real binary (a pyenv shim is a script); None when the machine has none."""
    debian = Path(f"/usr/bin/python{minor}")
    if debian.is_file():
        return debian
    found = shutil.which(f"python{minor}")
    if found is not None:
        try:
            out = subprocess.run([found, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True,
                                 timeout=60, check=True).stdout.strip()
            if out:
                return Path(out)
        except (OSError, subprocess.SubprocessError):
            pass  # a pyenv shim of a version that is installed but not selected: look for it below
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    installed = sorted(pyenv.glob(f"{minor}.*/bin/python{minor}"), key=lambda p: p.parent.parent.name)
    return installed[-1] if installed else None


def base_prefix(venv: Path) -> Path | None:
    """The prefix of the interpreter ``venv`` was made from (``home`` in its pyvenv.cfg, one level up)."""
    try:
        lines = (venv / "pyvenv.cfg").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition("=")
        if key.strip() == "home" and value.strip():
            return Path(value.strip()).parent
    return None


def _installed(directory: Path, pin: PyPin) -> bool:
    marker = directory / _MARKER
    return marker.is_file() and marker.read_text() == _pin_text(pin) and (directory / "venv" / "bin" / pin.binary
                                                                          ).exists()


def ensure_py_installed(name: str, pin: PyPin | None = None, cache_root: str | Path | None = None, *,
                        timeout: float = 1800.0, quiet: bool = True) -> Path:
    """Install one Python harness (once; safe to call concurrently) and return its binary. HarnessInstallError
    when the machine has no interpreter of the version it needs, or pip fails."""
    pin = pin or PY_PINS[name]
    python = find_python(pin.python)
    if python is None:
        raise HarnessInstallError(f"{pin.package} {pin.version} needs Python {pin.python}, and this machine has no "
                                  f"python{pin.python} (neither /usr/bin/python{pin.python} nor on PATH)")
    directory = py_install_dir(name, pin, cache_root)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _installed(directory, pin):
            _install(directory, pin, python, timeout, quiet)
    return directory / "venv" / "bin" / pin.binary


def _install(directory: Path, pin: PyPin, python: Path, timeout: float, quiet: bool) -> None:
    (directory / _MARKER).unlink(missing_ok=True)
    venv = directory / "venv"
    if venv.exists():
        shutil.rmtree(venv)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    env.pop("VIRTUAL_ENV", None)
    steps = [[str(python), "-m", "venv", str(venv)],
             [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *pin.requirements()]]
    for cmd in steps:
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout, text=True, capture_output=quiet, check=False)
        except subprocess.TimeoutExpired as exc:
            raise HarnessInstallError(f"{' '.join(cmd[:4])} did not finish within {timeout:.0f} s") from exc
        if proc.returncode != 0:
            tail = (proc.stderr or "")[-4000:] if quiet else ""
            raise HarnessInstallError(f"installing {pin.package}=={pin.version} failed (exit code {proc.returncode}"
                                      f" of {' '.join(cmd[:5])})\n{tail}")
    if not (venv / "bin" / pin.binary).exists():
        raise HarnessInstallError(f"{pin.package}=={pin.version} installed no {pin.binary} in {venv / 'bin'}")
    (directory / _MARKER).write_text(_pin_text(pin))


def installed_cli(pin_name: str, cache_root: str | Path | None = None) -> InstalledCli | None:
    """Where set-up installed the harness pinned as ``pin_name`` (npm or Python), with what a sandbox must bind;
    None when it is not installed."""
    if pin_name in PY_PINS:
        directory = py_install_dir(pin_name, cache_root=cache_root)
        binary = directory / "venv" / "bin" / PY_PINS[pin_name].binary
        if not binary.exists():
            return None
        prefix = base_prefix(directory / "venv")
        extra = (prefix,) if prefix is not None and not prefix.is_relative_to("/usr") else ()
        return InstalledCli(binary, (directory, *extra))
    npm = install_dir(cache_root=cache_root)
    path = cli_paths(npm).get(pin_name)
    return InstalledCli(path, (npm,)) if path is not None and path.exists() else None


def main(argv: list[str] | None = None, pins: Mapping[str, PyPin] = PY_PINS) -> int:
    parser = argparse.ArgumentParser(prog="python -m polar_gym.harness.pyinstall", description=__doc__)
    parser.add_argument("harness", nargs="*", help=f"Python harnesses to install (default: all of {', '.join(pins)})")
    parser.add_argument("--cache-root", help="parent of the harness-py-<name>-<hash> directories")
    parser.add_argument("--verbose", action="store_true", help="show pip's output")
    args = parser.parse_args(argv)
    unknown = [h for h in args.harness if h not in pins]
    if unknown:
        parser.error(f"unknown Python harness {', '.join(unknown)}; known: {', '.join(pins)}")

    def install(name: str) -> Path | HarnessInstallError:
        try:
            return ensure_py_installed(name, pins[name], args.cache_root, quiet=not args.verbose)
        except HarnessInstallError as exc:
            return exc

    # two at a time: a fresh machine spends ~1.5 min a venv, half of it waiting on the index and downloads
    names = list(args.harness or pins)
    with ThreadPoolExecutor(max_workers=2) as pool:
        outcomes = list(pool.map(install, names))
    failed = 0
    for name, outcome in zip(names, outcomes, strict=True):
        if isinstance(outcome, HarnessInstallError):
            print(f"skipped {name}: {outcome}", file=sys.stderr)
            failed += 1
        else:
            print(f"{name}\t{pins[name].package}=={pins[name].version}\t{outcome}")
    return 1 if failed and args.harness else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


assert not set(PY_PINS) & set(PINS), "a harness is pinned on npm or on PyPI, not both"
