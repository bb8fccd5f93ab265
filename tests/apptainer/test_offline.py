"""The offline harness image recipe (issue 16): apt source parsing, the npm closure, keys and tags, both renderings,
the context staged from a cached install, the base made once, and the default image conf/runtime/docker.yaml names."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from polar_gym.apptainer.__main__ import main
from polar_gym.apptainer.offline import (
    ALL_HARNESSES,
    OfflineRecipe,
    apt_source,
    build_oci,
    build_sif,
    debootstrap_argv,
    default_image,
    image_pins_hash,
    npm_closure,
    render_offline_definition,
    render_offline_dockerfile,
    stage_context,
)
from polar_gym.harness.install import PINS
from polar_gym.harness.pyinstall import py_install_dir

ROOT = Path(__file__).resolve().parents[2]

DEB822 = """Types: deb
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
"""


def test_apt_source_reads_deb822_and_one_line_files_and_skips_security() -> None:
    assert apt_source([DEB822]) == ("http://mirror.example/debian", "bookworm")
    one_line = ("deb http://sec.example/debian-security bookworm-security main\n"
                "deb [arch=amd64] http://m.example/d trixie main\n")
    assert apt_source(["# nothing\n", one_line]) == ("http://m.example/d", "trixie")
    with pytest.raises(ValueError, match="no Debian archive"):
        apt_source(["# empty\n"])


def test_npm_closure_resolves_nearest_node_modules_and_skips_absent_optionals() -> None:
    packages = {
        "": {"dependencies": {"cli": "1"}},
        "node_modules/cli": {"dependencies": {"a": "1", "@s/b": "1"}, "optionalDependencies": {"other-os": "1"}},
        "node_modules/a": {"dependencies": {"c": "2"}},
        "node_modules/a/node_modules/c": {},  # a's own c shadows the top-level one
        "node_modules/c": {},
        "node_modules/@s/b": {"dependencies": {"c": "1"}},
        "node_modules/unrelated": {},
    }
    assert npm_closure(packages, ["cli"]) == ["node_modules/@s/b", "node_modules/a", "node_modules/a/node_modules/c",
                                              "node_modules/c", "node_modules/cli"]


def test_keys_and_tags_follow_the_base_packages_and_pins() -> None:
    everything, pi = OfflineRecipe(), OfflineRecipe(harnesses=("pi",))
    assert everything.harnesses == ALL_HARNESSES
    assert everything.tag == f"localhost/polar-gym/harnesses:{image_pins_hash()}"
    assert pi.tag == f"localhost/polar-gym/pi:{image_pins_hash()}" and pi.base_tag == everything.base_tag
    assert OfflineRecipe(harnesses=("pi", "codex")).name == "codex-pi"
    reordered = OfflineRecipe(packages=tuple(reversed(everything.packages)))
    assert reordered.base_tag == everything.base_tag and reordered.key == everything.key
    more = OfflineRecipe(packages=(*everything.packages, "ripgrep"))
    assert more.base_tag != everything.base_tag and more.key != everything.key
    with pytest.raises(ValueError, match="unknown harness"):
        OfflineRecipe(harnesses=("nope",))
    argv = debootstrap_argv(everything, Path("/r"))
    assert argv[:2] == ["debootstrap", "--variant=minbase"] and "git" in argv[2] and "python3" in argv[2]


def test_a_cli_moved_to_another_node_rebuilds_the_image_under_the_same_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    """The node a CLI runs with is part of the image's key (a cached image would otherwise run pi on the image's
    default node after its pin moved to Node 24), not of its tag, which conf/runtime/docker.yaml names."""
    recipe = OfflineRecipe(harnesses=("pi",))
    key, tag = recipe.key, recipe.tag
    monkeypatch.setitem(PINS, "pi", replace(PINS["pi"], node_major=None))
    assert recipe.key != key and recipe.tag == tag


def test_docker_yaml_names_the_all_cli_image_of_the_current_pins() -> None:
    conf = yaml.safe_load((ROOT / "conf" / "runtime" / "docker.yaml").read_text())
    assert conf["image"] == default_image()


def test_one_recipe_renders_the_dockerfile_and_the_apptainer_definition(tmp_path: Path) -> None:
    recipe = OfflineRecipe(harnesses=("pi",), mirror="http://m.example/debian", suite="bookworm")
    dockerfile = render_offline_dockerfile(recipe)
    assert dockerfile.splitlines()[1] == f"FROM {recipe.base_tag}"
    assert "COPY node /usr/local/bin/node" in dockerfile
    assert "ENV PATH=/opt/polar-harness/bin:/opt/polar-harness/node_modules/.bin:" in dockerfile
    assert "COPY py /opt/polar-harness/py" in dockerfile
    assert f'org.polar_gym.key="{recipe.key[:16]}"' in dockerfile
    definition = render_offline_definition(recipe, tmp_path)
    assert definition.startswith("Bootstrap: debootstrap\nOSVersion: bookworm\nMirrorURL: http://m.example/debian\n")
    assert "Include: bash,ca-certificates,coreutils,git,libstdc++6,procps,python3" in definition
    assert f"{tmp_path}/node_modules /opt/polar-harness/node_modules" in definition


def _fake_install(root: Path) -> Path:
    """A cached install of pi with one dependency and the Node.js 24 it runs with, plus an unrelated package that must
    stay out."""
    pin = PINS["pi"]
    lock = {"packages": {f"node_modules/{pin.package}": {"dependencies": {"dep": "1"}}, "node_modules/dep": {},
                         "node_modules/unrelated": {}}}
    (root / "package-lock.json").parent.mkdir(parents=True)
    (root / "package-lock.json").write_text(json.dumps(lock))
    for rel in (f"node_modules/{pin.package}/dist", "node_modules/dep", "node_modules/unrelated", "node_modules/.bin"):
        (root / rel).mkdir(parents=True)
    (root / f"node_modules/{pin.package}/dist/cli.js").write_text("#!/usr/bin/env node\n")
    (root / "node_modules/dep/index.js").write_text("")
    os.symlink(f"../{pin.package}/dist/cli.js", root / "node_modules/.bin/pi")
    (root / pin.node).parent.mkdir(parents=True)
    (root / pin.node).write_text("node 24")
    return root


def test_stage_context_copies_only_the_closure_and_the_bin_link(tmp_path: Path) -> None:
    npm = _fake_install(tmp_path / "npm")
    node = tmp_path / "node"
    node.write_text("binary")
    ctx = stage_context(OfflineRecipe(harnesses=("pi",)), tmp_path / "ctx", npm_dir=npm, node=str(node))
    assert (ctx / "node").read_text() == "binary"
    assert (ctx / "node_modules/.bin/pi").resolve() == (ctx / f"node_modules/{PINS['pi'].package}/dist/cli.js")
    assert (ctx / "node_modules/dep/index.js").exists() and not (ctx / "node_modules/unrelated").exists()
    assert (ctx / "nodes/node-24/bin/node").read_text() == "node 24"  # pi's, and its wrapper puts it first
    assert "PATH=/opt/polar-harness/nodes/node-24/bin:" in (ctx / "bin" / "pi").read_text()
    with pytest.raises(RuntimeError, match="no cached harness CLIs"):
        stage_context(OfflineRecipe(harnesses=("pi",)), tmp_path / "ctx2", npm_dir=tmp_path / "none", node=str(node))


def test_a_python_harness_is_staged_as_a_venv_at_the_images_path(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Its scripts' ``#!`` lines name the image's venv path, written as new files (the cache's stay as they were);
    its binary is on the image's PATH."""
    monkeypatch.setenv("POLAR_CACHE", str(tmp_path / "cache"))
    venv = py_install_dir("mini_swe_agent") / "venv"
    (venv / "bin").mkdir(parents=True)
    script = venv / "bin" / "mini"
    script.write_text(f"#!{venv}/bin/python\nimport sys\n")
    script.chmod(0o755)
    os.symlink("/usr/bin/python3.11", venv / "bin" / "python")
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    npm, node = _fake_install(tmp_path / "npm"), tmp_path / "node"
    node.write_text("binary")
    ctx = stage_context(OfflineRecipe(harnesses=("pi", "mini_swe_agent")), tmp_path / "ctx", npm_dir=npm,
                        node=str(node))
    staged = ctx / "py" / "mini_swe_agent" / "bin" / "mini"
    assert staged.read_text() == "#!/opt/polar-harness/py/mini_swe_agent/bin/python\nimport sys\n"
    assert os.access(staged, os.X_OK) and script.read_text().startswith(f"#!{venv}/bin/python")
    assert (ctx / "bin" / "mini").read_text().endswith("exec /opt/polar-harness/py/mini_swe_agent/bin/mini \"$@\"\n")
    assert os.readlink(ctx / "py" / "mini_swe_agent" / "bin" / "python") == "/usr/bin/python3.11"
    assert (ctx / "ld.so.conf").read_text() == ""  # Debian's python3 is the image's own


def test_a_venv_of_an_interpreter_outside_usr_brings_it_along(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pyenv's 3.12 (the OpenHands SDK's): the interpreter goes to the image without its test suite, the venv's
    pyvenv.cfg and python link name it there, and its lib is in the loader's path (its RUNPATH is the host's)."""
    monkeypatch.setenv("POLAR_CACHE", str(tmp_path / "cache"))
    prefix = tmp_path / "pyenv" / "versions" / "3.12.1"
    for rel in ("bin/python3.12", "lib/libpython3.12.so.1.0", "lib/python3.12/os.py", "lib/python3.12/test/t.py"):
        (prefix / rel).parent.mkdir(parents=True, exist_ok=True)
        (prefix / rel).write_text(rel)
    venv = py_install_dir("openhands") / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(f"{prefix}/bin/python3.12", venv / "bin" / "python")
    os.symlink("python", venv / "bin" / "python3")
    (venv / "pyvenv.cfg").write_text(f"home = {prefix}/bin\nexecutable = {prefix}/bin/python3.12\n")
    npm, node = _fake_install(tmp_path / "npm"), tmp_path / "node"
    node.write_text("binary")
    ctx = stage_context(OfflineRecipe(harnesses=("pi", "openhands")), tmp_path / "ctx", npm_dir=npm, node=str(node))
    image = "/opt/polar-harness/pythons/3.12"
    assert (ctx / "pythons/3.12/bin/python3.12").read_text() == "bin/python3.12"
    assert (ctx / "pythons/3.12/lib/python3.12/os.py").exists()
    assert not (ctx / "pythons/3.12/lib/python3.12/test").exists()
    staged = ctx / "py" / "openhands"
    assert (staged / "pyvenv.cfg").read_text() == f"home = {image}/bin\nexecutable = {image}/bin/python3.12\n"
    assert os.readlink(staged / "bin" / "python") == f"{image}/bin/python3.12"
    assert os.readlink(staged / "bin" / "python3") == "python"
    assert (venv / "pyvenv.cfg").read_text().startswith(f"home = {prefix}/bin")  # the cache's venv is untouched
    assert (ctx / "ld.so.conf").read_text() == f"{image}/lib\n"
    # on the image's PATH under its own name: the venv's python must not shadow the image's
    assert "exec /opt/polar-harness/py/openhands/bin/python " in (ctx / "bin" / "openhands-python").read_text()
    assert not (ctx / "bin" / "python").exists()


def test_dry_run_prints_both_renderings_and_the_tag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["build", "--offline", "--harness", "pi", "--out", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "FROM localhost/polar-gym/base:" in out and "Bootstrap: debootstrap" in out
    assert out.splitlines()[-1] == OfflineRecipe(harnesses=("pi",)).tag
    if shutil.which("apptainer") is None:  # a SIF needs Apptainer: the error says what to do instead
        assert main(["build", "--offline", "--format", "sif", "--out", str(tmp_path)]) == 1
        assert "--format oci" in capsys.readouterr().err


def test_a_sif_is_built_from_the_same_recipe_checked_and_reused(tmp_path: Path) -> None:
    """The SIF path's command sequence with a recording runner standing in for Apptainer."""
    npm = _fake_install(tmp_path / "npm")
    node = tmp_path / "node"
    node.write_text("binary")
    calls: list[list[str]] = []
    definitions: list[str] = []
    node_runs = [0]

    def runner(argv: Sequence[str]) -> int:
        calls.append(list(argv))
        if argv[1] == "build":
            definitions.append(Path(argv[-1]).read_text())  # the staged context is still there while it builds
            Path(argv[-2]).write_bytes(b"SIF")
            return 0
        return node_runs[0]

    recipe = OfflineRecipe(harnesses=("pi",))
    sif = build_sif(recipe, tmp_path / "out", "fake-apptainer", runner=runner, npm_dir=npm, node=str(node),
                    fakeroot=True)
    assert sif.read_bytes() == b"SIF" and sif.parent == tmp_path / "out" and sif.name.startswith("pi-")
    assert calls[0][:4] == ["fake-apptainer", "build", "--fakeroot", "--force"]
    assert calls[0][-2].endswith(".sif.partial")
    assert definitions[0] == render_offline_definition(recipe, Path(calls[0][-1]).parent)
    assert calls[1] == ["fake-apptainer", "exec", "--containall", calls[0][-2], "node", "--version"]
    assert not list((tmp_path / "out").glob("*.sif-build")) and not list((tmp_path / "out").glob("*.partial"))
    assert build_sif(recipe, tmp_path / "out", "fake-apptainer", runner=runner, npm_dir=npm) == sif
    assert len(calls) == 2  # reused: same key, nothing rebuilt
    sif.unlink()
    node_runs[0] = 1  # node does not run in the image: no SIF is left to be reused
    with pytest.raises(RuntimeError, match="node does not run"):
        build_sif(recipe, tmp_path / "out", "fake-apptainer", runner=runner, npm_dir=npm, node=str(node))
    assert not list((tmp_path / "out").glob("*.sif*"))


def test_without_offline_one_harness_and_an_out_dir_are_required(tmp_path: Path) -> None:
    assert main(["build", "--harness", "pi"]) == 2
    assert main(["build", "--harness", "pi", "--harness", "codex", "--out", str(tmp_path), "--dry-run"]) == 2




def test_build_makes_the_base_once_then_the_image_and_checks_node_runs(tmp_path: Path) -> None:
    """The build's command sequence with a recording runner and an engine that knows no image (``false``)."""
    if shutil.which("debootstrap") is None:
        pytest.skip("debootstrap not installed (apt-get install debootstrap)")
    npm = _fake_install(tmp_path / "npm")
    calls: list[list[str]] = []

    def runner(argv: Sequence[str]) -> int:
        calls.append(list(argv))
        return 1 if argv[-2:] == ["node", "--version"] and len(calls) > 5 else 0

    recipe = OfflineRecipe(harnesses=("pi",))
    tag = build_oci(recipe, tmp_path / "out", ("false",), runner=runner, npm_dir=npm, run_args=["--ulimit", "x"])
    assert tag == recipe.tag
    assert [c[0] for c in calls] == ["debootstrap", "tar", "false", "false", "false"]
    assert calls[2][1] == "import" and calls[2][-1] == recipe.base_tag
    assert calls[3][1:5] == ["build", "--pull=never", "-t", recipe.tag]
    assert calls[4] == ["false", "run", "--rm", "--network", "none", "--ulimit", "x", recipe.tag, "node", "--version"]
    assert not (tmp_path / "out" / "pi.build").exists()  # the staged context is removed
    with pytest.raises(RuntimeError, match="node does not run"):
        build_oci(recipe, tmp_path / "out", ("false",), runner=runner, npm_dir=npm)
    assert calls[-1] == ["false", "rmi", "-f", recipe.tag]


def test_a_python_harness_this_machine_cannot_carry_is_left_out_saying_why(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's machine without pyenv's 3.12: the default image keeps its tag and goes without the OpenHands SDK."""
    from polar_gym.apptainer import offline

    monkeypatch.setattr(offline, "find_python", lambda minor: None if minor == "3.12" else Path("/usr/bin/python3"))
    recipe = OfflineRecipe(harnesses=("pi", "openhands"))
    assert recipe.left_out() == {"openhands": "needs Python 3.12, which this machine does not have"}
    assert recipe.tag == OfflineRecipe(harnesses=("pi", "openhands")).tag and "openhands" in recipe.labels()[
        "org.polar_gym.left_out"] and "openhands" not in recipe.labels()["org.polar_gym.harnesses"]
    npm, node = _fake_install(tmp_path / "npm"), tmp_path / "node"
    node.write_text("binary")
    ctx = stage_context(recipe, tmp_path / "ctx", npm_dir=npm, node=str(node))
    assert not (ctx / "py" / "openhands").exists() and list((ctx / "pythons").iterdir()) == []
