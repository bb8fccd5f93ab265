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
    "PINS",
    "HarnessInstallError",
    "Pin",
    "cli_paths",
    "ensure_installed",
    "install_dir",
    "main",
    "pins_hash",
    "render_package_json",
    "render_wrapper",
]


@dataclass(frozen=True)
class Pin:
    """One harness CLI: its npm package, the exact version and the binary it installs."""

    package: str
    version: str
    binary: str


#: the versions seen working on Node 20 (shared/REFERENCE.md, "Harness CLIs")
PINS: dict[str, Pin] = {
    "claude_code": Pin("@anthropic-ai/claude-code", "2.1.197", "claude"),
    "codex": Pin("@openai/codex", "0.169.0", "codex"),
    "qwen_code": Pin("@qwen-code/qwen-code", "0.15.10", "qwen"),
    "gemini_cli": Pin("@google/gemini-cli", "0.61.0", "gemini"),
    "opencode": Pin("opencode-ai", "1.18.33", "opencode"),
    "pi": Pin("@mariozechner/pi-coding-agent", "0.73.1", "pi"),
}

_MARKER = ".polar_gym-installed"
#: where an install made with a Node.js of its own keeps that node (relative to the install directory)
BUNDLED_NODE = Path("node") / "bin" / "node"


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


def install_dir(pins: Mapping[str, Pin] = PINS, cache_root: str | Path | None = None) -> Path:
    """``<cache_root>/harness-npm-<hash>``; the cache root defaults to ``$POLAR_CACHE``, else ~/.cache/polar_gym."""
    if cache_root is None:
        cache_root = os.environ.get("POLAR_CACHE") or Path.home() / ".cache" / "polar_gym"
    return Path(cache_root) / f"harness-npm-{pins_hash(pins)}"


def cli_paths(directory: Path, pins: Mapping[str, Pin] = PINS) -> dict[str, Path]:
    """Where each harness's binary lives in an install directory (whether or not it exists yet): the npm binary,
    or its wrapper when the install carries its own node (:data:`BUNDLED_NODE`)."""
    if (directory / BUNDLED_NODE).is_file():
        return {name: directory / "bin" / pin.binary for name, pin in pins.items()}
    return {name: directory / "node_modules" / ".bin" / pin.binary for name, pin in pins.items()}


def render_wrapper(directory: Path, binary: str) -> str:
    """A CLI's wrapper in an install with its own node (pure): that node first on PATH, then the npm binary."""
    node_bin = shlex.quote(str(directory / BUNDLED_NODE.parent))
    target = shlex.quote(str(directory / "node_modules" / ".bin" / binary))
    return (f"#!/bin/sh\n# polar_gym: the pinned CLI run with the Node.js of this install (no system node)\n"
            f'PATH={node_bin}:"$PATH"\nexport PATH\nexec {target} "$@"\n')


def _installed(directory: Path, pins: Mapping[str, Pin]) -> bool:
    marker = directory / _MARKER
    npm_bins = directory / "node_modules" / ".bin"
    return (marker.exists() and marker.read_text() == render_package_json(pins)
            and all((npm_bins / pin.binary).exists() for pin in pins.values()))


def ensure_installed(pins: Mapping[str, Pin] = PINS, cache_root: str | Path | None = None, *, npm: str = "npm",
            timeout: float = 1800.0, quiet: bool = True, node_dir: Path | None = None) -> dict[str, Path]:
    """Install the pinned CLIs (once) and return each harness's binary path. Safe to call concurrently.
    ``node_dir``: a folder with ``node`` and ``npm`` to use instead of the system's (see the module docstring)."""
    if node_dir is not None and not (node_dir / "node").is_file():
        raise HarnessInstallError(f"no node binary in {node_dir}")
    directory = install_dir(pins, cache_root)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _installed(directory, pins):
            _run_npm(directory, pins, _npm_of(node_dir) if node_dir is not None else npm, timeout, quiet,
                     node_dir)
        if node_dir is not None:  # the node last: cli_paths names the wrappers once it is there
            _write_wrappers(directory, pins)
            _bundle_node(directory, node_dir)
    return cli_paths(directory, pins)


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


def _bundle_node(directory: Path, node_dir: Path) -> None:
    """Copy (hard-link where possible) ``node_dir/node`` to the install's own :data:`BUNDLED_NODE`."""
    source, target = node_dir / "node", directory / BUNDLED_NODE
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


def _write_wrappers(directory: Path, pins: Mapping[str, Pin]) -> None:
    (directory / "bin").mkdir(exist_ok=True)
    for pin in pins.values():
        wrapper = directory / "bin" / pin.binary
        text = render_wrapper(directory, pin.binary)
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
