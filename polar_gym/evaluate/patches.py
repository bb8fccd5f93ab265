"""Moving an agent's work between runtimes as a patch: extract it, filter it, apply it with fallbacks.

Why: evaluating in a fresh runtime (the paper's ``refresh_runtime``) keeps whatever the agent did to its sandbox
(installed packages, edited tests outside the repo, background processes) out of the verdict; only the diff of the
repository crosses over. Splitting and filtering are pure functions of the patch text; extraction and application
are thin shells around commands run in a runtime.
"""

from __future__ import annotations

import codecs
import fnmatch
import posixpath
import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from polar_gym.evaluate.errors import SandboxFailure
from polar_gym.runtime.base import ExecResult, ExecStatus, Runtime

__all__ = [
    "APPLY_STRATEGIES",
    "DEFAULT_EXCLUDES",
    "DEFAULT_PATCH_PATH",
    "TEST_FILE_GLOBS",
    "ApplyOutcome",
    "FilePatch",
    "FilteredPatch",
    "PatchConfig",
    "PatchExtractionError",
    "apply_patch",
    "check_ran",
    "extract_patch",
    "filter_patch",
    "join_patch",
    "output_tail",
    "patch_command",
    "patch_paths",
    "split_patch",
]

#: build products that show up in a diff once tests ran in the live runtime, never part of a solution
DEFAULT_EXCLUDES: tuple[str, ...] = ("*.pyc", "__pycache__/*", "*/__pycache__/*", "*.egg-info/*", ".pytest_cache/*")
#: what counts as a test file when an evaluator is told to drop the agent's changes to tests
TEST_FILE_GLOBS: tuple[str, ...] = ("test_*.py", "*/test_*.py", "*_test.py", "*/tests/*", "tests/*", "*/test/*",
                                     "test/*", "conftest.py", "*/conftest.py", "*/testing/*")
#: where the patch file is written inside the evaluation runtime
DEFAULT_PATCH_PATH = "/tmp/polar_eval/patch.diff"


class PatchConfig(BaseModel):
    """The config keys of evaluators that carry the agent's repository diff into a fresh runtime."""

    model_config = ConfigDict(extra="forbid")

    patch_command: str | list[str] | None = Field(default=None, description="prints the agent's patch; default: "
                                                  "the live repo's diff (untracked files too)")
    patch_path: str = Field(default=DEFAULT_PATCH_PATH, description="where the patch is written in the fresh "
                            "runtime")
    exclude: list[str] = Field(default_factory=lambda: list(DEFAULT_EXCLUDES), description="globs of files left "
                               "out of the patch")
    exclude_binary: bool = Field(default=False, description="leave binary files out of the patch")
    exclude_tests: bool = Field(default=False, description="also drop the agent's changes to test files")


#: applied in order; between attempts the tree is reset, since a failed ``--3way`` or ``--reject`` leaves debris
APPLY_STRATEGIES: tuple[tuple[str, str], ...] = (
    ("git_apply", "git apply --verbose --whitespace=nowarn {patch}"),
    ("git_apply_3way", "git apply --verbose --whitespace=nowarn --3way {patch}"),
    ("git_apply_reject", "git apply --verbose --whitespace=nowarn --reject {patch}"),
    ("patch_fuzz", "patch --batch --forward --fuzz=5 -p1 -i {patch}"),
)
_RESET = "git checkout -q -- . 2>/dev/null; git clean -fdq"
_OUTPUT_LIMIT = 4000


class PatchExtractionError(RuntimeError):
    """The patch command failed in the live runtime (e.g. the agent removed the repository)."""


def patch_command(base: str = "HEAD") -> str:
    """A POSIX sh command printing the working tree's diff against ``base``, untracked files included.

    It stages into a throwaway copy of the index so the session's own index is left alone (``cp -p``: the copy must
    keep the index's mtime, or git's racy-entry check misses a same-size edit made in the second of the last
    commit), and ``--binary`` keeps binary changes applicable (filtering decides later whether to keep them).
    """
    b = shlex.quote(base)
    return (
        'gd="$(git rev-parse --absolute-git-dir)" || exit 1; idx="$gd/polar_eval_index"; rm -f "$idx"; '
        '{ cp -p "$gd/index" "$idx" 2>/dev/null || true; }; '
        f'GIT_INDEX_FILE="$idx" git add -A . && GIT_INDEX_FILE="$idx" git -c core.fileMode=false diff --cached '
        f'--binary --no-color --no-ext-diff {b}; rc=$?; rm -f "$idx"; exit $rc'
    )


@dataclass(frozen=True)
class FilePatch:
    """The part of a patch that touches one file."""

    path: str
    text: str
    binary: bool = False
    old_path: str | None = None


@dataclass(frozen=True)
class FilteredPatch:
    text: str
    kept: list[str]
    dropped: dict[str, str]  # path -> why


_DIFF_GIT = re.compile(r"^diff --git ", re.M)
_BINARY = re.compile(r"^(GIT binary patch|Binary files .* differ)$", re.M)


def _unquote(path: str) -> str:
    """git quotes unusual paths C-style (``"a\\tb"``, octal bytes for non-ASCII)."""
    path = path.strip()
    if len(path) >= 2 and path[0] == path[-1] == '"':
        raw: bytes = codecs.escape_decode(path[1:-1].encode())[0]
        path = raw.decode("utf-8", "replace")
    return path


def _strip_prefix(path: str) -> str | None:
    path = _unquote(path.split("\t", 1)[0])
    if path == "/dev/null":
        return None
    return path[2:] if path[:2] in ("a/", "b/") else path


def _file_paths(chunk: str) -> tuple[str, str | None]:
    old = new = None
    for line in chunk.splitlines():
        if line.startswith("--- "):
            old = _strip_prefix(line[4:])
        elif line.startswith("+++ "):
            new = _strip_prefix(line[4:])
            break
        elif line.startswith("rename to ") or line.startswith("copy to "):
            new = _unquote(line.split(" to ", 1)[1])
        elif line.startswith("rename from ") or line.startswith("copy from "):
            old = _unquote(line.split(" from ", 1)[1])
    if new is None and old is None:
        header = chunk.split("\n", 1)[0].removeprefix("diff --git ")
        a, sep, b = header.rpartition(" b/")
        if sep:
            new, old = b, _strip_prefix(a)
        else:
            new = header
    path = new if new is not None else old
    assert path is not None
    return path, (old if old != path else None)


def split_patch(text: str) -> list[FilePatch]:
    """One :class:`FilePatch` per file, for git diffs (``diff --git`` headers) and plain unified diffs."""
    if not text.strip():
        return []
    if _DIFF_GIT.search(text):
        starts = [m.start() for m in _DIFF_GIT.finditer(text)]
    else:
        lines = text.splitlines(keepends=True)
        starts, pos = [], 0
        for i, line in enumerate(lines):
            if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
                starts.append(pos)
            pos += len(line)
        if not starts:
            raise ValueError("not a patch: no 'diff --git' or '---/+++' file headers")
    starts[0] = 0  # keep any preamble with the first file
    chunks = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]
    out = []
    for chunk in chunks:
        path, old = _file_paths(chunk)
        out.append(FilePatch(path=path, text=chunk, binary=bool(_BINARY.search(chunk)), old_path=old))
    return out


def join_patch(files: Iterable[FilePatch]) -> str:
    parts = [f.text if f.text.endswith("\n") else f.text + "\n" for f in files]
    return "".join(parts)


def patch_paths(text: str) -> list[str]:
    """Every path a patch touches (old and new names of renames)."""
    paths: list[str] = []
    for f in split_patch(text):
        paths += [p for p in (f.path, f.old_path) if p and p not in paths]
    return paths


def _matches(path: str, globs: Sequence[str]) -> str | None:
    base = posixpath.basename(path)
    for glob in globs:
        if fnmatch.fnmatchcase(path, glob) or ("/" not in glob and fnmatch.fnmatchcase(base, glob)):
            return glob
    return None


def filter_patch(text: str, *, exclude: Sequence[str] = (), exclude_binary: bool = False,
                 exclude_paths: Iterable[str] = ()) -> FilteredPatch:
    """Drop the files of ``text`` that match ``exclude`` globs (a glob without ``/`` also matches a basename),
    are binary, or are listed in ``exclude_paths``; say why each was dropped."""
    banned = set(exclude_paths)
    kept: list[FilePatch] = []
    dropped: dict[str, str] = {}
    for f in split_patch(text):
        names = [p for p in (f.path, f.old_path) if p]
        if exclude_binary and f.binary:
            dropped[f.path] = "binary"
        elif any(n in banned for n in names):
            dropped[f.path] = "excluded path"
        elif glob := next((g for g in (_matches(n, exclude) for n in names) if g), None):
            dropped[f.path] = f"matches {glob!r}"
        else:
            kept.append(f)
    return FilteredPatch(text=join_patch(kept), kept=[f.path for f in kept], dropped=dropped)


def output_tail(data: bytes, limit: int = _OUTPUT_LIMIT) -> str:
    text = data.decode(errors="replace")
    return text if len(text) <= limit else "…" + text[-limit:]


def check_ran(result: ExecResult, what: str) -> ExecResult:
    """Raise :class:`SandboxFailure` when a command did not run to its end for reasons other than a timeout."""
    if result.status in (ExecStatus.CRASHED, ExecStatus.CANCELLED):
        raise SandboxFailure(f"{what}: {result.status.value} ({result.reason or 'no reason given'})")
    return result


async def extract_patch(runtime: Runtime, command: str | list[str], *, cwd: str | None = None,
                        timeout: float = 120.0) -> str:
    """Run the patch command in the live runtime and return its output (a diff, possibly empty)."""
    result = check_ran(await runtime.exec(command, cwd=cwd, timeout=timeout), "patch command")
    if not result.ok:
        raise PatchExtractionError(f"patch command failed ({result.status.value}, exit {result.exit_code}): "
                                   f"{output_tail(result.stderr or result.stdout, 1000)}")
    return result.stdout.decode("utf-8", "surrogateescape")


@dataclass
class ApplyOutcome:
    """How (and whether) a patch went in; ``attempts`` records each strategy's exit code and output."""

    applied: bool
    strategy: str | None = None
    attempts: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {"applied": self.applied, "strategy": self.strategy, "attempts": self.attempts}


async def apply_patch(runtime: Runtime, patch: str, *, cwd: str | None = None, path: str = DEFAULT_PATCH_PATH,
                      strategies: Sequence[tuple[str, str]] = APPLY_STRATEGIES, timeout: float = 120.0
                      ) -> ApplyOutcome:
    """Apply ``patch`` in ``runtime`` (a pristine checkout) trying each strategy in turn.

    The tree is reset (``git checkout -- . ; git clean -fd``) before every attempt but the first, so only use this
    on a tree that holds nothing but the base commit. When every strategy fails, a ``git apply --check --reverse``
    tells whether the patch is in anyway (a chain can leave it applied while each command exited non-zero).
    """
    if not patch.strip():
        return ApplyOutcome(applied=True, strategy="empty")
    await runtime.upload(patch.encode("utf-8", "surrogateescape"), path)
    quoted = shlex.quote(path)
    outcome = ApplyOutcome(applied=False)
    for i, (name, template) in enumerate(strategies):
        if i:
            check_ran(await runtime.exec(_RESET, cwd=cwd, timeout=timeout), "reset before applying the patch")
        result = check_ran(await runtime.exec(template.format(patch=quoted), cwd=cwd, timeout=timeout),
                           f"patch strategy {name}")
        outcome.attempts.append({"strategy": name, "exit_code": result.exit_code,
                                 "output": output_tail(result.stdout + result.stderr, 1000)})
        if result.ok:
            outcome.applied, outcome.strategy = True, name
            return outcome
    reverse = check_ran(await runtime.exec(f"git apply --check --reverse {quoted}", cwd=cwd, timeout=timeout),
                        "reverse check of the patch")
    if reverse.ok:
        outcome.applied, outcome.strategy = True, "already_applied"
    return outcome
