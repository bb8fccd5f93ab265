"""Files only their owner may read: tokens, server info, resolved configs that may hold a key."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_secret"]


def write_secret(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable by its owner only: mode 600 also when the file existed with a wider one,
    and atomically (a reader polling for the file never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file left behind by a crash
        f.write(text)
    os.replace(tmp, path)
    return path
