"""The sbatch scripts under slurm/ are the renderer's output, document their variables and are valid bash."""

from __future__ import annotations

import re
import runpy
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from polar_gym.launch import slurm
from polar_gym.launch.slurm import SbatchResources, render_all, render_gateway, render_server, render_sglang, write_all

SLURM_DIR = Path(__file__).resolve().parents[2] / "slurm"

DOCUMENTED = {
    "gateway.sbatch": ["POLAR_SERVER_URL", "POLAR_ADMIN_TOKEN", "POLAR_ADMIN_TOKEN_FILE", "POLAR_ENGINE",
                       "POLAR_UPSTREAM", "MODEL_PATH", "PORT", "POLAR_CAPACITY", "POLAR_WORKDIR", "POLAR_STATE_DIR",
                       "POLAR_ADVERTISE_HOST", "POLAR_PYTHON"],
    "server.sbatch": ["POLAR_ADMIN_TOKEN", "POLAR_ADMIN_TOKEN_FILE", "PORT", "POLAR_DB", "POLAR_STATE_DIR",
                      "POLAR_ADVERTISE_HOST", "POLAR_PYTHON"],
    "sglang.sbatch": ["MODEL_PATH", "PORT", "TP_SIZE", "SGLANG_ARGS", "SGLANG_PYTHON", "POLAR_SERVER_URL",
                      "POLAR_ADMIN_TOKEN", "POLAR_ADMIN_TOKEN_FILE", "POLAR_ADVERTISE_HOST", "POLAR_STATE_DIR",
                      "POLAR_PYTHON"],
}


@pytest.mark.parametrize("name", sorted(render_all()))
def test_committed_file_is_rendered_output(name: str) -> None:
    committed = SLURM_DIR / name
    assert committed.read_text() == render_all()[name], f"regenerate with `python -m polar_gym.launch.slurm`: {name}"


def test_renderers_are_pure() -> None:
    assert render_all() == render_all()
    assert render_gateway() == render_all()["gateway.sbatch"]


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_header_documents_every_variable_it_reads(name: str) -> None:
    text = render_all()[name]
    header = text.split("\nset -euo pipefail", 1)[0]
    assert header.startswith("#!/bin/bash\n#SBATCH --job-name=")
    for var in DOCUMENTED[name]:
        assert re.search(rf"^#   {var}\s+\S", header, re.M), f"{name} does not document {var}"
    body = text.split("\nset -euo pipefail", 1)[1]
    read = set(re.findall(r"\$\{(POLAR_[A-Z_]+|MODEL_PATH|PORT|TP_SIZE|SGLANG_[A-Z]+)\b", body))
    assert read <= set(DOCUMENTED[name]), f"undocumented: {read - set(DOCUMENTED[name])}"


def test_gateway_golden_details() -> None:
    text = render_gateway()
    assert "#SBATCH --output=/dev/null" in text  # the job writes its log under POLAR_STATE_DIR itself
    assert 'POLAR_ADMIN_TOKEN="$TOKEN" "$PY" -m polar_gym.gateway "${args[@]}" "$@" &' in text
    assert '/gateway/health" 300\n' in text
    assert text.index("\nforward_signals\n") < text.index("\nwait_http ")  # scancel while starting stops it too
    assert 'args+=(--server-url "$POLAR_SERVER_URL")' in text  # the gateway registers and heartbeats itself
    assert text.index("\npreflight\n") < text.rindex("-m polar_gym.gateway")  # checked before anything starts


def test_server_and_sglang_golden_details() -> None:
    server = render_server()
    assert '"$PY" -m polar_gym.server --host 0.0.0.0 --port "$PORT" "$@" &' in server
    # the store is POLAR_DB, read by the server from its environment: a postgresql:// URL may hold a password
    assert 'export POLAR_DB' in server and '--db "$POLAR_DB"' not in server
    sglang = render_sglang()
    assert "#SBATCH --gres=gpu:1" in sglang
    assert sglang.index("\npreflight\n") < sglang.rindex("-m sglang.launch_server")
    assert '"${POLAR_SERVER_URL%/}/backends"' in sglang


def test_resources_render_into_the_header() -> None:
    text = render_server(SbatchResources("srv", cpus=2, mem="1G", time="1:00:00", gpus=2, extra=("--partition=h100",)))
    lines = text.splitlines()
    for expected in ("#SBATCH --job-name=srv", "#SBATCH --cpus-per-task=2", "#SBATCH --mem=1G",
                     "#SBATCH --time=1:00:00", "#SBATCH --gres=gpu:2", "#SBATCH --partition=h100",
                     "#SBATCH --output=/dev/null"):
        assert expected in lines


def test_write_all(tmp_path: Path) -> None:
    paths = write_all(tmp_path / "out")
    assert sorted(p.name for p in paths) == sorted(render_all())
    for p in paths:
        assert p.read_text() == render_all()[p.name]
        assert p.stat().st_mode & 0o111


@pytest.mark.parametrize("name", sorted(render_all()))
def test_valid_bash(name: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_text(render_all()[name])
    subprocess.run(["bash", "-n", str(path)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(path)], check=True)


def test_default_resources_ask_for_a_modest_cpu_only_job() -> None:
    """A bare SbatchResources (a custom script's header) asks for one task, 4 CPUs, 8G and a day, and no GPU."""
    assert SbatchResources("job").header().splitlines() == [
        "#SBATCH --job-name=job", "#SBATCH --nodes=1", "#SBATCH --ntasks=1", "#SBATCH --cpus-per-task=4",
        "#SBATCH --mem=8G", "#SBATCH --time=24:00:00", "#SBATCH --output=/dev/null"]


def test_write_all_creates_the_directory_and_rewrites_in_place(tmp_path: Path) -> None:
    """Regenerating works into a fresh nested folder and over an earlier copy; each script is the rendered text,
    executable as committed (``./slurm/gateway.sbatch`` runs)."""
    target = tmp_path / "a" / "b"
    write_all(target)
    for path in write_all(target):
        assert path.read_text() == render_all()[path.name]
        assert stat.S_IMODE(path.stat().st_mode) == 0o755 == stat.S_IMODE((SLURM_DIR / path.name).stat().st_mode)


def test_main_writes_to_the_directory_given_else_to_the_clones_slurm_dir(tmp_path: Path, capsys, monkeypatch) -> None:
    """``python -m polar_gym.launch.slurm [DIR]``, the regenerate command slurm/README.md gives."""
    assert slurm.SLURM_DIR == SLURM_DIR
    assert slurm.main([str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(render_all())
    assert capsys.readouterr().out.split() == [str(tmp_path / "out" / name) for name in render_all()]
    monkeypatch.setattr(slurm, "SLURM_DIR", tmp_path / "default")  # never rewrite the clone's own scripts here
    assert slurm.main([]) == 0
    assert sorted(p.name for p in (tmp_path / "default").iterdir()) == sorted(render_all())


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
def test_python_m_runs_main_with_the_command_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("sys.argv", ["slurm.py", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("polar_gym.launch.slurm", run_name="__main__")
    assert exited.value.code == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(render_all())
