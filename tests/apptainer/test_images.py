"""The image builder: golden definition files and Dockerfiles, cache-key behaviour, the build flow with an injected
runner, and the dry-run CLI. Regenerate the golden files with ``UPDATE_GOLDEN=1 pytest tests/apptainer``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from polar_gym.apptainer.__main__ import main
from polar_gym.apptainer.images import (
    ImageRecipe,
    apptainer_build_argv,
    build,
    cache_key,
    oci_build_argv,
    plan,
    render_definition,
    render_dockerfile,
    render_setup,
    reusable,
    split_base,
)
from polar_gym.harness.install import PINS

GOLDEN = Path(__file__).with_name("golden")
KEY = "0" * 64

RECIPES = {
    "claude_node_base": ImageRecipe(harness="claude_code", apt=("python3",), pip=("pytest==8.3.4",),
                                    env=(("LANG", "C.UTF-8"), ("QUOTED", 'a "b" $HOME'))),
    "codex_swebench": ImageRecipe(base="docker://swebench/sweb.eval.x86_64.astropy__astropy-12907:latest",
                                  harness="codex", workdir="/testbed", post=("git -C /testbed status",)),
    "bare_sif": ImageRecipe(base="/images/base.sif", install_node=False),
}


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; rerun with UPDATE_GOLDEN=1 and review the diff"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_golden_definitions(name: str) -> None:
    check_golden(f"{name}.def", render_definition(RECIPES[name], key=KEY))


@pytest.mark.parametrize("name", ["claude_node_base", "codex_swebench"])
def test_golden_dockerfiles(name: str) -> None:
    check_golden(f"{name}.Dockerfile", render_dockerfile(RECIPES[name], key=KEY))
    check_golden(f"{name}.setup.sh", render_setup(RECIPES[name]))


def test_definition_and_dockerfile_share_the_setup_script() -> None:
    recipe = RECIPES["codex_swebench"]
    setup = render_setup(recipe)
    definition = render_definition(recipe, key=KEY)
    assert all(f"    {line}" in definition for line in setup.splitlines() if line)
    assert "COPY polar-setup.sh" in render_dockerfile(recipe, key=KEY)


def test_pins_come_from_the_harness_installer() -> None:
    for harness, pin in PINS.items():
        text = render_definition(ImageRecipe(harness=harness), key=KEY)
        assert f"npm install -g --no-audit --no-fund --no-update-notifier {pin.package}@{pin.version}" in text
        assert f"org.polar_gym.harness.version {pin.version}" in text


def test_node_is_installed_only_when_the_base_lacks_it() -> None:
    assert not ImageRecipe(base="docker://node:22-bookworm").install_node
    assert ImageRecipe(base="docker://debian:bookworm").install_node
    assert "nodejs.org/dist/v22.12.0" in render_setup(ImageRecipe(base="docker://debian:bookworm"))
    assert "nodejs.org" not in render_setup(ImageRecipe(base="docker://node:22"))
    assert "apt-get" not in render_setup(ImageRecipe(base="docker://node:22"))


def test_split_base() -> None:
    assert split_base("docker://node:22") == ("docker", "node:22")
    assert split_base("oras://ghcr.io/x/y:1") == ("oras", "ghcr.io/x/y:1")
    assert split_base("/images/a.sif") == ("localimage", "/images/a.sif")
    assert split_base("ubuntu:24.04") == ("docker", "ubuntu:24.04")
    with pytest.raises(ValueError, match="OCI build"):
        render_dockerfile(RECIPES["bare_sif"])
    with pytest.raises(ValueError, match="unknown harness"):
        ImageRecipe(harness="nope")


def test_versioned_key_changes_with_what_goes_into_the_image() -> None:
    base = RECIPES["claude_node_base"]
    key = cache_key(base)
    for changed in (replace(base, base="docker://node:22-slim"), replace(base, harness="codex"),
                    replace(base, apt=("python3", "make")), replace(base, pip=("pytest==8.3.5",)),
                    replace(base, env=()), replace(base, post=("true",)), replace(base, workdir="/w"),
                    replace(base, install_node=True)):
        assert cache_key(changed) != key, changed


def test_versioned_key_ignores_order_duplicates_and_labels() -> None:
    a = ImageRecipe(harness="pi", apt=("b", "a"), pip=("y", "x"))
    b = ImageRecipe(harness="pi", apt=("a", "b", "a"), pip=("x", "y"), labels=(("owner", "me"),))
    assert cache_key(a) == cache_key(b)
    # Node's version only matters when Node is installed
    assert cache_key(replace(a, node_version="20.0.0")) == cache_key(a)
    c = ImageRecipe(harness="pi", base="docker://debian:bookworm")
    assert cache_key(replace(c, node_version="20.0.0")) != cache_key(c)


def test_lock_key_is_the_lock_bytes_only() -> None:
    a, b = RECIPES["claude_node_base"], RECIPES["codex_swebench"]
    assert cache_key(a, mode="lock", lock_bytes=b"x==1\n") == cache_key(b, mode="lock", lock_bytes=b"x==1\n")
    assert cache_key(a, mode="lock", lock_bytes=b"x==1\n") != cache_key(a, mode="lock", lock_bytes=b"x==1 \n")
    with pytest.raises(ValueError, match="lock file"):
        cache_key(a, mode="lock")


def test_build_argv() -> None:
    assert apptainer_build_argv(Path("/b/apptainer.def"), Path("/o/x.sif")) == [
        "apptainer", "build", "--fakeroot", "--force", "/o/x.sif", "/b/apptainer.def"]
    assert oci_build_argv(Path("/ctx"), "localhost/polar-gym/pi:abc", engine="docker") == [
        "docker", "build", "-t", "localhost/polar-gym/pi:abc", "-f", "/ctx/Dockerfile", "/ctx"]


class Recorder:
    """A builder stand-in: records argv and writes the output a real ``apptainer build`` would."""

    def __init__(self, code: int = 0) -> None:
        self.calls: list[list[str]] = []
        self.code = code

    def __call__(self, argv: Sequence[str]) -> int:
        self.calls.append(list(argv))
        if self.code == 0 and argv[1] == "build" and argv[0] != "podman":
            Path(argv[-2]).write_bytes(b"SIF")
        return self.code


def test_versioned_build_is_reused_until_the_recipe_changes(tmp_path: Path) -> None:
    runner = Recorder()
    recipe = RECIPES["claude_node_base"]
    first = plan(recipe, tmp_path)
    image = build(first, runner=runner)
    assert image == tmp_path / f"claude_code-{first.key[:12]}.sif" and Path(image).read_bytes() == b"SIF"
    assert (first.work_dir / "apptainer.def").read_text() == render_definition(recipe, key=first.key)
    sidecar = json.loads(first.sidecar.read_text())
    assert sidecar["key"] == first.key and sidecar["recipe"]["harness"] == "claude_code"
    assert build(plan(recipe, tmp_path), runner=runner) == image and len(runner.calls) == 1
    build(plan(replace(recipe, pip=("pytest==8.3.5",)), tmp_path), runner=runner)
    assert len(runner.calls) == 2


def test_scratch_always_builds_and_lock_reuses_identical_bytes(tmp_path: Path) -> None:
    runner = Recorder()
    recipe = RECIPES["codex_swebench"]
    build(plan(recipe, tmp_path, mode="scratch"), runner=runner)
    build(plan(recipe, tmp_path, mode="scratch"), runner=runner)
    assert len(runner.calls) == 2
    lock = plan(recipe, tmp_path, mode="lock", lock_bytes=b"numpy==2.0.0\n")
    build(lock, runner=runner)
    other_base = replace(recipe, base="docker://debian:bookworm", pip=("numpy",))  # the lock alone decides
    build(plan(other_base, tmp_path, mode="lock", lock_bytes=b"numpy==2.0.0\n"), runner=runner)
    assert len(runner.calls) == 3
    build(plan(recipe, tmp_path, mode="lock", lock_bytes=b"numpy==2.0.1\n"), runner=runner)
    assert len(runner.calls) == 4


def test_failed_or_interrupted_builds_are_not_reused(tmp_path: Path) -> None:
    p = plan(RECIPES["claude_node_base"], tmp_path)
    with pytest.raises(RuntimeError, match="exit code 2"):
        build(p, runner=Recorder(code=2))
    assert not reusable(p) and not p.sidecar.exists()
    build(p, runner=Recorder())
    Path(p.image).unlink()  # the SIF went away: the sidecar alone is not enough
    assert not reusable(p)


def test_oci_plan_writes_the_context(tmp_path: Path) -> None:
    runner = Recorder()
    p = plan(RECIPES["codex_swebench"], tmp_path, fmt="oci", engine="docker")
    tag = build(p, runner=runner)
    assert tag == f"localhost/polar-gym/codex:{p.key[:12]}"
    assert runner.calls == [["docker", "build", "-t", tag, "-f", str(p.work_dir / "Dockerfile"), str(p.work_dir)]]
    assert (p.work_dir / "polar-setup.sh").read_text() == render_setup(RECIPES["codex_swebench"])


def test_cli_dry_run_prints_definition_and_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["build", "--harness", "claude_code", "--apt", "python3", "--out", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "Bootstrap: docker\nFrom: node:22-bookworm\n" in out
    assert "@anthropic-ai/claude-code@2.1.197" in out
    assert out.rstrip().splitlines()[-1].startswith("apptainer build --fakeroot --force ")
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


def test_cli_dry_run_oci_and_lock(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lock = tmp_path / "requirements.lock"
    lock.write_text("x==1\n")
    args = ["build", "--base", "docker://debian:bookworm", "--format", "oci", "--engine", "docker",
            "--cache", "lock", "--lock", str(lock), "--out", str(tmp_path / "o"), "--dry-run"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "FROM debian:bookworm" in out and "(lock)" in out
    assert out.rstrip().splitlines()[-1].startswith("docker build -t localhost/polar-gym/base:")


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["build", "--cache", "lock", "--out", str(tmp_path)]) == 2
    assert main(["build", "--env", "NOEQUALS", "--out", str(tmp_path)]) == 2
    assert main(["build", "--base", "/x.sif", "--format", "oci", "--out", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err


def test_cli_build_fails_cleanly_without_the_builder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["build", "--binary", str(tmp_path / "no-such-apptainer"), "--out", str(tmp_path)])
    assert code == 1 and "error:" in capsys.readouterr().err


def _podman_image(tag: str) -> bool:
    return shutil.which("podman") is not None and subprocess.run(
        ["podman", "image", "exists", tag], capture_output=True, check=False).returncode == 0


@pytest.mark.slow
def test_podman_builds_the_rendered_dockerfile(tmp_path: Path) -> None:
    """Optional: the rendered Dockerfile really builds (podman, the busybox test image of the docker backend)."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed")
    try:
        from polar_gym.runtime.testimage import TEST_IMAGE, ensure_test_image

        ensure_test_image(("podman",))
    except Exception as exc:  # the set-up may be missing on this machine: say why and skip
        pytest.skip(f"the busybox test image is unavailable: {exc}")
    if not _podman_image(TEST_IMAGE):
        pytest.skip(f"{TEST_IMAGE} is missing")
    recipe = ImageRecipe(base=f"docker://{TEST_IMAGE}", install_node=False, env=(("GREETING", "hi there"),),
                         post=('echo "built $GREETING" > /built.txt',))
    p = plan(recipe, tmp_path, fmt="oci", mode="scratch", engine="podman",
             extra=["--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"])
    tag = build(p, runner=lambda argv: subprocess.run(list(argv), check=False).returncode)
    try:
        out = subprocess.run(["podman", "run", "--rm", "--runtime", "runc", "--ulimit", "nofile=1024:1024",
                              "--ulimit", "nproc=1024:1024", str(tag), "cat", "/built.txt"],
                             capture_output=True, text=True, check=True, timeout=120).stdout
        assert out == "built hi there\n"
    finally:
        subprocess.run(["podman", "rmi", "-f", str(tag)], capture_output=True, check=False)
