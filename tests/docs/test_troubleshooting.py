"""Every error message docs/troubleshooting.md quotes still occurs in the code that emits it, so a reworded message
fails here until the page follows.

A quoted message is a heading whose whole text is in double quotes (``### "the message"``); ``…`` stands for a part
the code fills in (a URL, a path, a count). It is found when its literal pieces occur, in order, in one string the
code builds: a Python string literal, f-string or ``+`` of them under polar_gym/ (an f-string's ``{...}`` parts
count as filled-in), or one line of a shell script or C file under polar_gym/, scripts/ or slurm/. Messages of other
tools (Hydra, pydantic, bwrap) go under headings without quotes."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from functools import cache

import pytest

from tests.docs._blocks import DOCS

ROOT = DOCS.parent
PAGE = DOCS / "troubleshooting.md"
FILLED = "…"
#: a quoted message needs this many literal characters, so "…" alone cannot match anything
MIN_LITERAL = 12
_QUOTED = re.compile(r'^#{2,6}\s+"(?P<message>.+)"\s*$')
_HOLE = "\x00"
_ESCAPED = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")


def quoted_messages(text: str) -> list[str]:
    """The messages quoted as headings in a page's markdown, markdown escapes undone (``\\_target\\_`` is
    ``_target_``); headings inside code blocks do not count."""
    found, fence = [], None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            marker = stripped[:3]
            fence = None if fence == marker else (fence or marker)
            continue
        match = _QUOTED.match(line) if fence is None else None
        if match:
            found.append(_ESCAPED.sub(r"\1", match["message"]))
    return found


def _template(node: ast.AST) -> str | None:
    """The text a string expression builds, with ``\\x00`` for each filled-in part (None: not a string)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else _HOLE for part in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left), _template(node.right)
        if left is not None or right is not None:
            return (left if left is not None else _HOLE) + (right if right is not None else _HOLE)
    return None


def python_templates(source: str) -> Iterator[str]:
    """Every string a Python module builds from literals (the outermost ``+`` chains whole, and their parts)."""
    for node in ast.walk(ast.parse(source)):
        text = _template(node)
        if text is not None:
            yield text


@cache
def emitted_texts() -> tuple[str, ...]:
    """What the code can emit: Python string templates under polar_gym/, lines of shell and C files under
    polar_gym/, scripts/ and slurm/."""
    texts: list[str] = []
    for folder in ("polar_gym", "scripts", "slurm"):
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            if path.suffix == ".py":
                texts += python_templates(path.read_text())
            elif path.suffix in {".sh", ".sbatch", ".c"}:
                texts += path.read_text().splitlines()
    return tuple(texts)


def pattern_of(message: str) -> re.Pattern[str]:
    """A quoted message as a pattern: its literal pieces in order, anything in place of each ``…``."""
    pieces = [piece for piece in message.split(FILLED) if piece]
    return re.compile(".*?".join(re.escape(piece) for piece in pieces), re.DOTALL)


def is_emitted(message: str, texts: tuple[str, ...]) -> bool:
    pattern = pattern_of(message)
    return any(pattern.search(text) for text in texts)


def test_the_matcher_allows_filled_in_parts_and_refuses_a_reworded_message():
    texts = tuple(python_templates('x = f"upstream {server} timed out after {t:g} s"\n'
                                   'y = "no answer " + f"within {n} s; " + "giving up"\n'))
    assert is_emitted("upstream … timed out after … s", texts)
    assert is_emitted("no answer within … s; giving up", texts)
    assert not is_emitted("upstream … did not answer after … s", texts)
    assert not is_emitted("giving up … no answer", texts)  # pieces must come in order


def test_quoted_headings_are_found_outside_code_blocks_only():
    page = ('# T\n\n### "a real message"\n\n```text\n### "inside a block"\n```\n\n### Not quoted\n\n'
            '### "needs a \\_target\\_"\n')
    assert quoted_messages(page) == ["a real message", "needs a _target_"]


def test_the_page_quotes_messages():
    messages = quoted_messages(PAGE.read_text())
    assert len(messages) >= 20, "the troubleshooting page should quote the messages users meet"
    assert len(set(messages)) == len(messages), "a message is quoted twice"


@pytest.mark.parametrize("message", quoted_messages(PAGE.read_text()))
def test_every_quoted_message_is_still_emitted_by_the_code(message: str):
    literal = len(message.replace(FILLED, ""))
    assert literal >= MIN_LITERAL, f"too little literal text to check: {message!r}"
    assert is_emitted(message, emitted_texts()), (
        f"docs/troubleshooting.md quotes {message!r}, which no longer occurs in polar_gym/, scripts/ or slurm/: "
        "update the page to the message the code emits now")
