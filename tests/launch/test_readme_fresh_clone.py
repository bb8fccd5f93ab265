"""The README's Quick start on a fresh clone of this repository: its first code block holds exactly the two
commands, the first (set up + the main job) runs as written and produces the run's files, and the second (set up +
every test) runs as written up to pytest, which is pointed at one small file here (the whole suite cannot run inside
itself). Set-up is warm in CI (the caches under ~/.cache/polar_gym are keyed by pins), so this takes about a minute."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _quick_start() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "the Quick start has no bash code block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_quick_start_block_holds_exactly_the_two_commands() -> None:
    setup_and_run, setup_and_test = _quick_start()
    assert "scripts/setup.sh" in setup_and_run and "python -m polar_gym.launch" in setup_and_run
    assert setup_and_test == "bash scripts/test.sh"
    assert (ROOT / ".ci" / "run").read_text().count("scripts/test.sh") == 1


def test_the_readme_commands_work_on_a_fresh_clone(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.fail("git is needed (bash scripts/setup.sh installs it)")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTEST_ADDOPTS")}
    env.update(COLUMNS="160", PATH=":".join(p for p in env["PATH"].split(":") if ".venv" not in p))
    setup_and_run, setup_and_test = _quick_start()

    run = subprocess.run(["bash", "-c", setup_and_run], cwd=clone, env=env, capture_output=True, text=True,
                         timeout=1800)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    summaries = list((clone / "outputs").glob("*/*/summary.md"))
    assert len(summaries) == 1, "the main job writes one run folder under outputs/"
    folder = summaries[0].parent
    assert "4 completed, 0 errored" in summaries[0].read_text()
    assert {p.name for p in folder.iterdir()} >= {"trajectories.jsonl", "results.jsonl", "config.yaml",
                                                  "server.json", "server.sqlite"}
    # the clone's thin .venv layers the cached packages under this clone's source, never another clone's
    for checkout in (clone, ROOT):  # ROOT: the clone's set-up must not have redirected this checkout's venv
        where = subprocess.run([str(checkout / ".venv" / "bin" / "python"), "-c",
                                "import polar_gym; print(polar_gym.__file__)"], cwd="/", capture_output=True,
                               text=True, timeout=60)
        assert where.stdout.strip() == str(checkout / "polar_gym" / "__init__.py"), where.stderr

    # mypy's cache, like the ones under ~/.cache/polar_gym, is warm in CI: this checkout's (scripts/test.sh ran mypy
    # before the tests) checks the clone's identical files in a second instead of ~35 s of CPU; mypy trusts an entry
    # only when the file's hash matches, so the check is the same
    if (ROOT / ".mypy_cache").is_dir():
        shutil.copytree(ROOT / ".mypy_cache", clone / ".mypy_cache")
    test = subprocess.run(["bash", "-c", f"{setup_and_test} tests/unit/test_schema.py"], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert test.returncode == 0, (test.stdout[-3000:], test.stderr[-3000:])
    assert re.search(r"\d+ passed", test.stdout), test.stdout[-2000:]
