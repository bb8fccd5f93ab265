"""The extractor of runnable docs blocks (tests/docs/_blocks.py) finds what is marked and nothing else."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.docs._blocks import DOCS, ROOT, Block, BlockFailed, run_block, runnable_blocks


def test_marked_blocks_are_found_with_their_options_and_examples_inside_blocks_are_not(tmp_path: Path):
    (tmp_path / "page.md").write_text(
        "# Page\n\n<!-- run -->\n```bash\necho one\n```\n\n```bash\necho shown only\n```\n\n"
        "<!-- run: timeout=30 harness=codex -->\n\n~~~bash\necho two\n~~~\n\n"
        "````markdown\n<!-- run -->\n```bash\necho an example\n```\n````\n")
    blocks = runnable_blocks(tmp_path)
    assert [(b.code, b.options, b.line) for b in blocks] == [
        ("echo one\n", {}, 4), ("echo two\n", {"timeout": "30", "harness": "codex"}, 14)]


@pytest.mark.parametrize("text", ["<!-- run -->\nprose, not a block\n", "<!-- run -->\n```bash\necho never closed\n"])
def test_a_marker_without_a_closed_block_is_an_error(tmp_path: Path, text: str):
    (tmp_path / "page.md").write_text(text)
    with pytest.raises(ValueError, match=r"page\.md"):
        runnable_blocks(tmp_path)


def test_the_docs_pages_parse():
    runnable_blocks(DOCS)  # raises on a malformed marker anywhere in the docs


def _block(tmp_path: Path, code: str, **options: str) -> Block:
    page = DOCS / "page.md"  # a name under docs/ for the message; the code is what runs
    return Block(page, 7, "bash", code, dict(options))


def test_a_block_runs_in_a_fresh_directory_with_the_repository_and_its_venv_at_hand(tmp_path: Path):
    output = run_block(_block(tmp_path, 'pwd; echo "repo=$POLAR_REPO"; command -v python\n'))
    cwd, repo, python = output.splitlines()
    assert Path(cwd).name.startswith("polar-docblock-") and not Path(cwd).exists()
    assert repo == f"repo={ROOT}"
    assert python == str(ROOT / ".venv" / "bin" / "python")


def test_a_failing_block_names_its_page_line_command_and_output(tmp_path: Path):
    with pytest.raises(BlockFailed) as info:
        run_block(_block(tmp_path, "echo before\nfalse | cat\necho never\n"))
    message = str(info.value)
    assert "docs/page.md:7: exit code 1" in message and "false | cat" in message and "before" in message
    assert "\nnever" not in message  # -e and pipefail: the failing pipeline stopped it


def test_background_jobs_do_not_outlive_their_block(tmp_path: Path):
    pid_file = tmp_path / "pid"
    run_block(_block(tmp_path, f"sleep 300 &\necho $! > {pid_file}\n"))
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_block_past_its_timeout_is_ended_and_reported(tmp_path: Path):
    with pytest.raises(BlockFailed, match=r"still running after 1 s"):
        run_block(_block(tmp_path, "echo started\nsleep 300\n", timeout="1"))
