"""Distinct loopback addresses (127.77.y.z) for sandboxes that share the host's network (``network: host``), so the
servers they start do not collide, across sandboxes and gateway processes of one user: an address is held by an
flock on a file named after it, freed when the holder closes it or dies.

The files live in a directory of the user's own (``$XDG_RUNTIME_DIR``, else ``/tmp``), kept at mode 700: one that is
a link or another user's is refused, and a file is never opened through a link, so another user of the host cannot
make a root gateway create or append to a file of their choosing."""

from __future__ import annotations

import fcntl
import os
import random
import stat
from pathlib import Path
from typing import TextIO

from polar_gym.runtime.errors import SandboxStartError

__all__ = ["LoopbackAllocator"]


class LoopbackAllocator:
    """Distinct 127.x.y.z addresses across sandboxes and processes, held by flock'ed files (freed on crash too)."""

    def __init__(self, directory: Path | None = None, prefix: int = 77) -> None:
        self.directory = directory or Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"polar_gym-lo-{os.getuid()}"
        self.prefix = prefix

    def _own_directory(self) -> None:
        """The lock directory, made 0700 if missing (an older one of ours is narrowed to 0700); refused when it is a
        link or another user's."""
        try:
            os.mkdir(self.directory, 0o700)
        except FileExistsError:
            pass
        info = os.lstat(self.directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise SandboxStartError(f"refusing the loopback lock directory {self.directory}: it must be a directory "
                                    "of this user's own, not a link (remove it, or set XDG_RUNTIME_DIR)")
        if info.st_mode & 0o077:
            os.chmod(self.directory, 0o700)

    def acquire(self) -> tuple[str, TextIO]:
        self._own_directory()
        start = random.randrange(256 * 254)
        for i in range(256 * 254):
            n = (start + i) % (256 * 254)
            ip = f"127.{self.prefix}.{n // 254}.{n % 254 + 1}"
            fd = os.open(self.directory / ip, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            handle = os.fdopen(fd, "a")  # held open (and locked) until release
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            return ip, handle
        raise SandboxStartError("no free loopback address")

    @staticmethod
    def release(handle: TextIO) -> None:
        handle.close()
