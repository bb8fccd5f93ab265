"""Leak checks shared by the sandbox, gateway and end-to-end tests: find live host processes by a marker."""

from __future__ import annotations

import os
import signal
from pathlib import Path

__all__ = ["processes_with", "take_ctrl_c"]


def take_ctrl_c() -> None:
    """``preexec_fn`` for a child that must take SIGINT as Ctrl-C: a test run started in the background (bash
    ignores SIGINT in background jobs, as CI may) passes the ignore on to every child it starts."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def processes_with(marker: str) -> list[str]:
    """Every live process on the host whose argv or environment carries ``marker`` (zombies have neither), as
    ``"PID: argv"`` lines."""
    found = []
    needle = marker.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in cmdline or needle in environ:
            argv = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry}: {argv[:200]}")
    return found
