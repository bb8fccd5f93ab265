"""The hand-run snippet of every harness page (a ``<!-- run: harness=NAME -->`` block under docs/harnesses/) runs
here with the pinned harness CLIs on PATH: it starts ``python -m polar_gym.proxy --engine oracle`` in the background,
runs the unmodified CLI on a tiny task and checks what the task made and what the proxy captured. Each block runs as
docs/writing-docs.md says (``bash -euo pipefail`` in a fresh temporary directory, POLAR_REPO set, the repository's
.venv/bin first on PATH), and its process group is ended afterwards, so the proxy it started never outlives it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from polar_gym.harness.install import PINS, cli_paths, install_dir
from polar_gym.harness.pyinstall import PY_PINS
from polar_gym.registry import HARNESSES
from tests.docs._blocks import DOCS, Block, BlockFailed, run_block, runnable_blocks

PAGES = DOCS / "harnesses"
BLOCKS = [block for block in runnable_blocks(PAGES) if "harness" in block.options]
#: the page of each harness (custom.md is the generic ``shell`` harness: a user's own command)
PAGE_OF = {**{name: f"{name}.md" for name in [*PINS, *PY_PINS]}, "shell": "custom.md"}


def cli_search_path() -> list[Path]:
    """The folders holding the pinned CLIs (the cached npm install scripts/setup.sh made) and the node they run
    with, to put first on PATH."""
    paths = cli_paths(install_dir())
    missing = sorted(name for name, path in paths.items() if not path.exists())
    if missing:
        pytest.fail(f"harness CLIs not installed ({', '.join(missing)}): run `bash scripts/setup.sh`")
    folders = sorted({path.parent for path in paths.values()})
    node = shutil.which("node")  # an install with its own node has wrappers that put it first (install.py)
    return [*folders, *([Path(node).parent] if node else [])]


def run_harness_block(block: Block) -> str:
    """Run ``block`` with the harness CLIs on PATH (tests/docs/_blocks.run_block: its process group ends with it)."""
    return run_block(block, path=cli_search_path())


def test_every_harness_page_has_a_snippet_against_the_oracle_proxy():
    """The pinned CLIs (npm and Python) and the shell harness each have a page whose runnable snippets are marked
    with that registered harness, one of them starting ``python -m polar_gym.proxy --engine oracle``."""
    by_page: dict[str, set[str]] = {}
    against_oracle: set[str] = set()
    for block in BLOCKS:
        by_page.setdefault(block.page.name, set()).add(block.options["harness"])
        if "python -m polar_gym.proxy --engine oracle" in block.code:
            against_oracle.add(block.page.name)
    assert by_page == {page: {name} for name, page in PAGE_OF.items()}
    assert against_oracle == set(PAGE_OF.values())
    assert set(PAGE_OF) <= set(HARNESSES.names())


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_the_hand_run_snippet_works(block: Block) -> None:
    """The block succeeds; each one checks its own result (the file the task made, the captured calls)."""
    run_harness_block(block)


def _block(code: str) -> Block:
    return Block(PAGES / "pi.md", 1, "bash", code, {"harness": "pi", "timeout": "60"})


def test_a_block_s_background_jobs_end_with_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    run_harness_block(_block(f"sleep 600 &\necho $! > {pid_file}\n"))
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_failing_block_fails_naming_its_page_and_output() -> None:
    with pytest.raises(BlockFailed, match=r"(?s)harnesses/pi\.md:1: exit code 3.*shown before"):
        run_harness_block(_block("echo shown before\nexit 3\n"))
