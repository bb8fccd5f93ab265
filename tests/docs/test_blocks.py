"""The extractor of runnable docs blocks (tests/docs/_blocks.py) finds what is marked and nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs._blocks import DOCS, runnable_blocks


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
