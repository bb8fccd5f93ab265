"""Every block the docs mark runnable (``<!-- run -->``, docs/writing-docs.md) runs here, so a page cannot show a
command that no longer works. Blocks with a ``harness`` option need the harness CLIs and run in
tests/docs/test_harness_pages.py.

The pages a new user follows in order (:data:`IN_SEQUENCE`: the quick start, then Harbor tasks) run their blocks
one after the other in one folder, as a reader does, and each block's documented result is checked
(:data:`DOCUMENTED`): run in fresh folders, a second launch into the folder of a first one, which returned the old
run's sessions as new ones, went unseen (issue 35). Every other block runs alone, one test per block named by its
page and line."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.docs._blocks import DOCS, Block, run_block, runnable_blocks

BLOCKS = [block for block in runnable_blocks() if "harness" not in block.options]
#: ``needs=engine`` (the tiny Qwen3 model and vLLM's CPU build, made by ``setup.sh --engine``): in the engine tier
NEEDS = {"engine": pytest.mark.engine}
#: pages whose blocks run in sequence in one folder, in this order
IN_SEQUENCE = ("quickstart.md", "harbor.md")


def _page(block: Block) -> str:
    return block.page.relative_to(DOCS).as_posix()


def _param(block: Block) -> object:
    need = block.options.get("needs")
    if need is not None and need not in NEEDS:
        raise ValueError(f"docs/{block.name}: unknown needs={need} (known: {', '.join(NEEDS)})")
    return pytest.param(block, id=block.name, marks=[NEEDS[need]] if need else [])


@pytest.mark.slow
@pytest.mark.parametrize("block", [_param(block) for block in BLOCKS if _page(block) not in IN_SEQUENCE])
def test_the_command_shown_runs(block: Block, tmp_path: Path) -> None:
    output = run_block(block, cwd=tmp_path)
    for documented in _documented(block):
        documented(output, tmp_path)


def _trl_sessions(output: str, folder: Path) -> None:
    """One line per session TRL trained on: the oracle solved the task, and the tool output between the turns is
    context (trained < completion), the model's own tokens are not (trained > 0)."""
    rows = re.findall(r"^step 1 \S+ reward (\S+) prompt (\d+) completion (\d+) trained (\d+)$", output, re.M)
    assert len(rows) == 2, output  # --generations 2
    for reward, prompt, completion, trained in rows:
        assert float(reward) == 1.0 and int(prompt) > 0 and 0 < int(trained) < int(completion), output


# -- the reader's pages, in sequence ------------------------------------------------------------------------------

def _jsonl(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rewards(output: str) -> dict[str, str]:
    """task -> reward of the session rows summary.md shows (``grep '^| '``: the header, the rows, the total)."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in output.splitlines()
            if line.startswith("| ")]
    return {cells[0]: cells[4] for cells in rows if cells[0] != "task" and not cells[0].startswith("**total**")}


def _main_job(output: str, folder: Path) -> None:
    """The main job: pi on the four demo tasks, each to reward 1, and the files the table lists."""
    (run,) = folder.glob("outputs/*/*")
    assert {"trajectories.jsonl", "results.jsonl", "summary.md", "report.html", "config.yaml", "calls.jsonl",
            "capture", "gateway", "server.sqlite", "server.json"} <= {p.name for p in run.iterdir()}
    results = _jsonl(run / "results.jsonl")
    assert len(results) == 4 and all(r["status"] == "COMPLETED" for r in results)
    assert all(isinstance(r["evaluation"], dict) and r["evaluation"]["reward"] == 1.0 for r in results)


def _mistyped_key(output: str, folder: Path) -> None:
    assert "configuration error: num_sampels: not a config key" in output and "exit code 2" in output


def _metrics(output: str, folder: Path) -> None:
    assert int(output.split()[-1]) > 0  # spans.jsonl's lines


def _overrides(output: str, folder: Path) -> None:
    """Two sessions of one task with the per_request builder: results.jsonl has two lines."""
    assert output.split()[-1] == "2"
    results = _jsonl(folder / "run" / "results.jsonl")
    assert [(r["task_id"], r["status"]) for r in results] == [("demo-calc-add", "COMPLETED")] * 2
    assert {t["builder"] for t in _jsonl(folder / "run" / "trajectories.jsonl")} == {"per_request"}


#: the tasks docs/harbor.md runs (tests/data/harbor/tasks), each scored by its own verifier
HARBOR_TASKS = {"count-words", "edit-greeting", "fix-median"}


def _harbor_solved(output: str, folder: Path) -> None:
    assert _rewards(output) == dict.fromkeys(HARBOR_TASKS, "1"), output  # every task reaches reward 1.0


def _harbor_unsolved(output: str, folder: Path) -> None:
    assert _rewards(output) == dict.fromkeys(HARBOR_TASKS, "0"), output  # the task as it is left scores 0


def _harbor_image(output: str, folder: Path) -> None:
    assert "exit code 2" in output


#: (page, a piece of the block's code) -> its documented result: every block of the reader's pages has one, a block
#: that runs alone may
DOCUMENTED: dict[tuple[str, str], Callable[[str, Path], None]] = {
    ("quickstart.md", "ls outputs/*/*/"): _main_job,
    ("quickstart.md", "num_sampels=2"): _mistyped_key,
    ("quickstart.md", "telemetry.file=spans.jsonl"): _metrics,
    ("quickstart.md", "+builder=per_request"): _overrides,
    ("quickstart.md", "scripts/prereqs.sh"): lambda output, folder: None,
    ("harbor.md", "out=$PWD/solved "): _harbor_solved,
    ("harbor.md", "tasks.solution=none"): _harbor_unsolved,
    ("harbor.md", "harbor/image"): _harbor_image,
    # a block that runs alone
    ("trainers/trl.md", "grpo_polar.py"): _trl_sessions,
}


def _documented(block: Block) -> list[Callable[[str, Path], None]]:
    return [check for (page, piece), check in DOCUMENTED.items() if page == _page(block) and piece in block.code]


def test_every_documented_result_belongs_to_one_block() -> None:
    for page, piece in DOCUMENTED:
        assert len([b for b in BLOCKS if _page(b) == page and piece in b.code]) == 1, (page, piece)


def _sequence() -> list[tuple[Block, Callable[[str, Path], None]]]:
    """The reader's blocks in page order, each with its documented result; every block has exactly one."""
    blocks = sorted((b for b in BLOCKS if _page(b) in IN_SEQUENCE), key=lambda b: (IN_SEQUENCE.index(_page(b)),
                                                                                   b.line))
    pairs = []
    for block in blocks:
        checks = _documented(block)
        assert len(checks) == 1, f"docs/{block.name}: {len(checks)} entries of DOCUMENTED match this block"
        pairs.append((block, checks[0]))
    return pairs


def test_every_block_of_the_reader_s_pages_has_one_documented_result_in_page_order() -> None:
    names = [block.name for block, _ in _sequence()]
    assert names[0].startswith("quickstart.md:") and names[-1].startswith("harbor.md:")


@pytest.mark.slow
def test_the_quick_start_and_harbor_pages_run_in_sequence_in_one_folder_with_their_documented_results(
        tmp_path: Path) -> None:
    for block, documented in _sequence():
        output = run_block(block, cwd=tmp_path)
        try:
            documented(output, tmp_path)
        except AssertionError as exc:
            raise AssertionError(f"docs/{block.name}: not the documented result ({exc})\n--- output ---\n"
                                 f"{output[-3000:]}") from None
