"""A lease a detached sandbox watches, so it ends itself when its gateway dies without clean-up (SIGKILL, OOM).

The gateway rewrites a counter in a directory of its own, which the sandbox sees read-only: the sandbox's PID 1
exits once the value stops changing. The directory is outside the session directory on purpose: there the agent
could write the counter itself (and outlive its gateway), or plant a symlink under the name the gateway writes next
(and have a root gateway write through it onto any host file).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["LEASE_FILE", "LEASE_LOOKS", "Lease"]

log = logging.getLogger(__name__)

#: the counter's file name in the lease directory
LEASE_FILE = "lease"
#: looks the sandbox makes per lease period; it ends after this many in a row without a renewal
LEASE_LOOKS = 3


class Lease:
    """The gateway's side: create, keep renewing (twice per look of the sandbox), release."""

    def __init__(self, seconds: float, name: str) -> None:
        self.every = seconds / LEASE_LOOKS
        self.name = name
        self.directory = Path(tempfile.mkdtemp(prefix="polar-lease-"))
        self.directory.chmod(0o755)  # the sandbox's PID 1 may run as any uid: it only reads
        self._task: asyncio.Task[None] | None = None

    def _renew(self, n: int) -> None:
        tmp = self.directory / f".{LEASE_FILE}.{n}"
        tmp.write_text(f"{n}\n")
        tmp.chmod(0o644)
        os.replace(tmp, self.directory / LEASE_FILE)  # the sandbox never reads a half-written value

    async def start(self) -> None:
        await asyncio.to_thread(self._renew, 0)

        async def keep() -> None:
            for n in itertools.count(1):
                await asyncio.sleep(self.every / 2)
                try:
                    await asyncio.to_thread(self._renew, n)
                except OSError as exc:  # the disk is full or the dir is gone: the sandbox then ends on its own
                    log.warning("cannot renew the lease of %s: %s", self.name, exc)

        self._task = asyncio.create_task(keep(), name=f"lease-{self.name}")

    def release(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        with contextlib.suppress(OSError):
            shutil.rmtree(self.directory)
