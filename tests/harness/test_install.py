"""The pinned harness install: the rendered package.json, the cache directory's identity, and idempotence (with a
fake npm that only creates the binaries, so no registry is needed)."""

from __future__ import annotations

import json
import stat
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
                        lambda pins, root, quiet: ensure_installed(pins, root, npm=str(npm), quiet=quiet))
    assert main(["pi", "--cache-root", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out.strip().split("\t")
    assert out[:2] == ["pi", "@mariozechner/pi-coding-agent@0.73.1"] and out[2].endswith("/.bin/pi")


def test_package_exports() -> None:
    assert sorted(harness.__all__) == ["Harness", "HarnessContext", "HarnessInstallError", "PINS", "Pin",
                                       "cli_paths", "ensure_installed", "install_dir"]
    for name in harness.__all__:
        assert getattr(harness, name) is not None
