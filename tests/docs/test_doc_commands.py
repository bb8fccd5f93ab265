"""Every block the docs mark runnable (``<!-- run -->``, docs/writing-docs.md) runs here, one test per block named by
its page and line, so a page cannot show a command that no longer works. Blocks with a ``harness`` option need the
harness CLIs and run in tests/docs/test_harness_pages.py."""

from __future__ import annotations

import pytest

from tests.docs._blocks import Block, run_block, runnable_blocks

BLOCKS = [block for block in runnable_blocks() if "harness" not in block.options]
#: ``needs=engine`` (the tiny Qwen3 model and vLLM's CPU build, made by ``setup.sh --engine``): in the engine tier
NEEDS = {"engine": pytest.mark.engine}


def _param(block: Block) -> object:
    need = block.options.get("needs")
    if need is not None and need not in NEEDS:
        raise ValueError(f"docs/{block.name}: unknown needs={need} (known: {', '.join(NEEDS)})")
    return pytest.param(block, id=block.name, marks=[NEEDS[need]] if need else [])


@pytest.mark.slow
@pytest.mark.parametrize("block", [_param(block) for block in BLOCKS])
def test_the_command_shown_runs(block: Block) -> None:
    run_block(block)
