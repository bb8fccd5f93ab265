"""A task directory read as an untrusted archive.

Why: task sets are written by people the user does not know (a public Harbor dataset, an export from elsewhere) and
git keeps symlinks, FIFOs can be made by anyone, and a file can be any size. Whatever polar_gym reads from a task
(task.toml, instruction.md, the Dockerfile, COPY sources, tests/ and solution/, the bytes hashed into an image tag)
goes through :class:`TaskFiles`, which

- follows a symlink only while its target stays inside the directory it reads (the task directory, or the build
  context for a COPY): a link out, absolute or relative, dangling or not, is refused with the path named;
- never opens a FIFO, device or socket (the type is read with ``lstat`` first, and the file is opened with
  ``O_NOFOLLOW | O_NONBLOCK`` and checked again with ``fstat``, so a swap in between cannot make it block or read
  elsewhere);
- bounds every read: one file (:data:`MAX_FILE_BYTES`, :data:`MAX_TEXT_BYTES` for the small text files), all reads
  of one task together (:data:`MAX_TASK_BYTES`) and the entries one walk visits (:data:`MAX_TASK_ENTRIES`);
- walks a directory without following any link (a link inside a walked directory is reported as a link, never read).

Every refusal is a :class:`TaskFileError` (a :class:`~polar_gym.settings.ConfigError`) that names the task and the
path.
"""

from __future__ import annotations

import copy
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from polar_gym.settings import ConfigError

__all__ = [
    "MAX_FILE_BYTES",
    "MAX_TASK_BYTES",
    "MAX_TASK_ENTRIES",
    "MAX_TEXT_BYTES",
    "TaskEntry",
    "TaskFileError",
    "TaskFiles",
]

#: one file of a task (a COPY source, a test, a file hashed into the image tag)
MAX_FILE_BYTES = 256 * 2**20
#: task.toml, instruction.md and the Dockerfile: text a person wrote
MAX_TEXT_BYTES = 2**20
#: everything read from one task together
MAX_TASK_BYTES = 2**30
#: files, directories and links one walk of a task visits
MAX_TASK_ENTRIES = 100_000

_CHUNK = 2**20


class TaskFileError(ConfigError):
    """A task file polar_gym refuses to read (a link out, a FIFO / device / socket, over a cap); the message names
    the task and the path."""


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


@dataclass(frozen=True)
class TaskEntry:
    """One entry of a walk: its path relative to the walked directory (POSIX), its real path, size and executable
    bit; ``link`` is a symlink's target text (such an entry is never read)."""

    rel: str
    path: Path
    size: int = 0
    executable: bool = False
    link: str | None = None


class _Budget:
    """The bytes read so far from one task, shared by every reader of it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0


class TaskFiles:
    """The reader of one task directory (or of a directory inside it, with :meth:`under`), with the task's budget.

    ``task`` is what messages call the task (its directory as the user named it); ``root`` the directory reads are
    confined to (default the task directory itself).
    """

    def __init__(self, task: Path, *, scope: str = "the task directory", max_total: int = MAX_TASK_BYTES) -> None:
        self.task = task
        self.root = Path(os.path.realpath(task))
        self._prefix = PurePosixPath()
        self._scope = scope
        self._budget = _Budget(max_total)

    def under(self, rel: str, scope: str) -> TaskFiles:
        """A reader confined to the directory ``rel`` (resolved by the rules here) sharing this task's budget;
        ``scope`` names it in messages (``"the build context"``)."""
        child = copy.copy(self)  # the same budget object
        child.root, child._prefix, child._scope = self.locate(rel), self._prefix / rel, scope
        return child

    # -- paths -------------------------------------------------------------------------------------------------

    def _error(self, rel: str | PurePosixPath, message: str) -> TaskFileError:
        shown = (self._prefix / rel).as_posix() if str(rel) not in ("", ".") else (self._prefix.as_posix() or ".")
        return TaskFileError(f"{self.task}: {shown}: {message}")

    def locate(self, rel: str) -> Path:
        """The real path of ``rel`` (relative to the root): every symlink on the way must resolve inside the root
        (an absolute ``rel``, a ``..`` out or a link out, dangling or not, is refused). It may not exist."""
        if rel.startswith("/"):
            raise self._error(rel, f"is an absolute path; task files are named relative to {self._scope}")
        root = str(self.root)
        here = root
        done = PurePosixPath()
        for part in PurePosixPath(rel).parts:
            done = done / part
            here = os.path.join(here, part)
            if os.path.islink(here):
                target = os.path.realpath(here)
                if not _inside(target, root):
                    raise self._error(done, f"is a symbolic link to {os.readlink(here)!r}, which leaves "
                                            f"{self._scope}; links are followed only inside it")
                here = target
            else:
                here = os.path.normpath(here)
                if not _inside(here, root):
                    raise self._error(rel, f"leaves {self._scope}")
        return Path(here)

    def kind(self, rel: str) -> str:
        """``"file"``, ``"dir"`` or ``"missing"`` for ``rel``; a link out, a FIFO, device or socket is refused."""
        path = self.locate(rel)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return "missing"
        except NotADirectoryError:
            return "missing"
        if stat.S_ISREG(st.st_mode):
            return "file"
        if stat.S_ISDIR(st.st_mode):
            return "dir"
        raise self._error(rel, f"is {_kind(st.st_mode)}; a task's files are read only when they are regular files")

    # -- reading -----------------------------------------------------------------------------------------------

    def _check(self, rel: str | PurePosixPath, size: int) -> None:
        """Refuse reading ``size`` more bytes when the task would go over its budget."""
        if self._budget.used + size > self._budget.limit:
            raise self._error(rel, f"reading it would take the task over {self._budget.limit // 2**20} MiB read "
                                   "(MAX_TASK_BYTES); a task this big belongs in an image")

    def read_bytes(self, rel: str, *, limit: int = MAX_FILE_BYTES) -> bytes:
        """The bytes of the regular file ``rel``, at most ``limit`` of them (TaskFileError over it, or when the file
        is missing, a link out, a FIFO, device or socket; none of those is opened)."""
        path = self.locate(rel)
        try:
            before = os.lstat(path)
        except OSError:
            raise self._error(rel, "no such file") from None
        if not stat.S_ISREG(before.st_mode):
            what = "a directory" if stat.S_ISDIR(before.st_mode) else _kind(before.st_mode)
            raise self._error(rel, f"is {what}, not a regular file; it is not read")
        if before.st_size > limit:
            raise self._error(rel, f"is {before.st_size} bytes, over the {limit} a task file may have")
        self._check(rel, before.st_size)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
                raise self._error(rel, "changed while it was opened; it is not read")
            chunks, size = [], 0
            while chunk := os.read(fd, min(_CHUNK, limit + 1 - size)):
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise self._error(rel, f"grew over the {limit} bytes a task file may have while it was read")
        finally:
            os.close(fd)
        self._budget.used += size
        return b"".join(chunks)

    def read_text(self, rel: str, *, limit: int = MAX_TEXT_BYTES) -> str:
        """:meth:`read_bytes` decoded as UTF-8 (TaskFileError when it is not)."""
        data = self.read_bytes(rel, limit=limit)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self._error(rel, f"is not UTF-8 text ({exc.reason} at byte {exc.start})") from None

    # -- walking -----------------------------------------------------------------------------------------------

    def walk(self, rel: str = "", *, max_file: int = MAX_FILE_BYTES) -> list[TaskEntry]:
        """Every file and link under the directory ``rel`` (sorted by path; directories are not listed), following
        no link; a FIFO, device or socket, a file over ``max_file``, more than :data:`MAX_TASK_ENTRIES` entries or
        files over what the task may still read are refused before anything is read."""
        top = self.locate(rel) if rel else self.root
        base = PurePosixPath(rel) if rel else PurePosixPath()
        entries: list[TaskEntry] = []
        total = 0
        for entry_rel, path, st in self._scan(top, base):
            inner = (base / entry_rel) if entry_rel else base
            if stat.S_ISLNK(st.st_mode):
                entries.append(TaskEntry(entry_rel, path, link=os.readlink(path)))
            elif stat.S_ISREG(st.st_mode):
                if st.st_size > max_file:
                    raise self._error(inner, f"is {st.st_size} bytes, over the {max_file} a task file may have")
                total += st.st_size
                entries.append(TaskEntry(entry_rel, path, st.st_size, bool(st.st_mode & 0o111)))
            else:
                raise self._error(inner, f"is {_kind(st.st_mode)}; a task's files are read only when they are "
                                         "regular files")
        self._check(rel, total)  # all of it at once, before anything is read
        return sorted(entries, key=lambda e: e.rel)

    def _scan(self, top: Path, base: PurePosixPath) -> Iterator[tuple[str, Path, os.stat_result]]:
        """(path relative to ``top``, path, lstat) of everything below ``top``, descending into real directories
        only."""
        pending = [(top, "")]
        seen = 0
        while pending:
            directory, prefix = pending.pop()
            try:
                scanner = os.scandir(directory)
            except NotADirectoryError:
                raise self._error(base, "is not a directory") from None
            except FileNotFoundError:
                raise self._error(base, "no such directory") from None
            with scanner:
                for item in scanner:
                    seen += 1
                    if seen > MAX_TASK_ENTRIES:
                        raise self._error(base, f"holds over {MAX_TASK_ENTRIES} entries (MAX_TASK_ENTRIES)")
                    rel = f"{prefix}{item.name}"
                    st = item.stat(follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        pending.append((Path(item.path), rel + "/"))
                    else:
                        yield rel, Path(item.path), st

    def read_entry(self, entry: TaskEntry, base: str = "", *, limit: int = MAX_FILE_BYTES) -> bytes:
        """The bytes of a file :meth:`walk` listed under ``base``, read by the same rules (the path is resolved
        again: what is read is what is there now)."""
        return self.read_bytes(f"{base.rstrip('/')}/{entry.rel}" if base else entry.rel, limit=limit)
