"""Every block the docs mark runnable (``<!-- run -->``, docs/writing-docs.md) runs here, one test per block named by
its page and line, so a page cannot show a command that no longer works. Blocks with a ``harness`` option need the
harness CLIs and run in tests/docs/test_harness_pages.py."""

from __future__ import annotations

import pytest

from tests.docs._blocks import Block, run_block, runnable_blocks

BLOCKS = [block for block in runnable_blocks() if "harness" not in block.options]


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_the_command_shown_runs(block: Block) -> None:
    run_block(block)
