"""The runnable code blocks of the docs pages: a fenced block right after a ``<!-- run -->`` comment (options inside
the comment: ``<!-- run: timeout=300 harness=codex -->``). See docs/writing-docs.md."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests._waiting import until_sync

__all__ = ["DEFAULT_TIMEOUT", "DOCS", "ROOT", "Block", "BlockFailed", "run_block", "runnable_blocks"]

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: seconds a block may run unless its marker says ``timeout=N``
DEFAULT_TIMEOUT = 600.0
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


class BlockFailed(AssertionError):
    """A runnable block exited non-zero or ran out of time; the message names the page:line, the command and the
    end of its output."""


def _failure(block: Block, why: str, output: str, tail: int = 60) -> BlockFailed:
    lines = output.splitlines()
    shown = "\n".join(lines[-tail:])
    cut = f"(last {tail} of {len(lines)} lines)" if len(lines) > tail else ""
    return BlockFailed(f"docs/{block.name}: {why}\n--- command ---\n{block.code.rstrip()}\n"
                       f"--- output {cut}---\n{shown}")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a reused id of another user's group
        return False
    return True


def _end_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the block's process group (what it left in the background too), SIGKILL what is still there later.
    The shell leads the group: it is reaped on the way, as a zombie leader keeps the group alive."""
    pgid = process.pid

    def ended() -> bool:
        return process.poll() is not None and not _group_alive(pgid)

    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)):
        if ended():
            return
        os.killpg(pgid, sig)
        try:
            until_sync(ended, timeout=grace, what=f"process group {pgid} to end")
            return
        except AssertionError:
            continue


@contextlib.contextmanager
def _folder(cwd: Path | None) -> Iterator[str]:
    if cwd is not None:
        yield str(cwd)
        return
    with tempfile.TemporaryDirectory(prefix="polar-docblock-") as fresh:
        yield fresh


def run_block(block: Block, *, path: Sequence[Path] = (), env: Mapping[str, str] | None = None,
              cwd: Path | None = None) -> str:
    """Run ``block`` as docs/writing-docs.md says: ``bash -euo pipefail`` in a fresh temporary directory (``cwd``:
    in that folder instead, as a reader runs a page's blocks one after the other), POLAR_REPO set, the repository's
    .venv/bin (after ``path``) first on PATH, the marker's ``timeout`` (default 600 s); its process group is ended
    afterwards, so background jobs never outlive it. Returns the output (stdout and stderr together); raises
    :class:`BlockFailed` on a non-zero exit or a timeout."""
    timeout = float(block.options.get("timeout", DEFAULT_TIMEOUT))
    base = dict(os.environ) | dict(env or {})
    search = [str(p) for p in path] + [str(ROOT / ".venv" / "bin"), base.get("PATH", "/usr/bin:/bin")]
    base |= {"POLAR_REPO": str(ROOT), "PATH": os.pathsep.join(search)}
    with _folder(cwd) as folder, tempfile.TemporaryFile("w+", errors="replace") as log:
        # output to a file, not a pipe: a background job holding the pipe open would keep a reader waiting
        process = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block.code], cwd=folder, env=base,
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code: int | None = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _end_group(process)
            process.wait()
        log.seek(0)
        output = log.read()
    if code is None:
        raise _failure(block, f"still running after {timeout:g} s (timeout=N in its marker raises the limit)", output)
    if code != 0:
        raise _failure(block, f"exit code {code}", output)
    return output
