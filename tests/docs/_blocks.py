"""The runnable code blocks of the docs pages: a fenced block right after a ``<!-- run -->`` comment (options inside
the comment: ``<!-- run: timeout=300 harness=codex -->``). See docs/writing-docs.md."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DOCS", "Block", "runnable_blocks"]

DOCS = Path(__file__).resolve().parents[2] / "docs"
_MARKER = re.compile(r"^<!--\s*run(?::\s*(?P<options>[^>]*?))?\s*-->\s*$")
_FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    options: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(DOCS)}:{self.line}"


def runnable_blocks(root: Path = DOCS) -> list[Block]:
    """Every block marked runnable under ``root`` (markers shown inside other code blocks do not count); a marker not
    followed by a fence, or a fence never closed, is a ValueError naming the page and line, so a typo cannot
    silently drop a command from the tests."""
    blocks = []
    for page in sorted(root.rglob("*.md")):
        lines = page.read_text().splitlines()
        i, marker = 0, None
        while i < len(lines):
            text = lines[i].strip()
            opening = _FENCE.match(text)
            if opening is None:
                if marker is not None and text:
                    raise ValueError(f"{page}:{i}: a run marker must be followed by a fenced code block")
                marker = _MARKER.match(text) or (marker if not text else None)
                i += 1
                continue
            fence, start, body = opening["fence"], i, []
            i += 1
            while i < len(lines) and lines[i].strip() != fence:
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise ValueError(f"{page}:{start + 1}: a code block is never closed")
            i += 1
            if marker is not None:
                options = dict(item.split("=", 1) for item in (marker["options"] or "").split() if "=" in item)
                blocks.append(Block(page, start + 1, opening["lang"] or "bash", "\n".join(body) + "\n", options))
            marker = None
    return blocks
