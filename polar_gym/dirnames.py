"""One directory name per caller-chosen key (a session id, an attempt id, a log path), collision-free.

Session ids come from requests, so they may hold ``/``, ``..``, NULs or 10 KB of text. A key that is already a
plain name (letters, digits, ``-``, ``_``, ``.``, not starting with a dot, at most 100 characters) is its own name,
so directories stay readable; any other key becomes a readable cleaned prefix, a ``+`` and 128 bits of its
SHA-256. ``+`` never appears in a plain name, so the two kinds cannot meet, and two distinct keys share a name only
if SHA-256 collides: one session can never read or write another's directory (invariant 4).
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["dirname_for"]

_PLAIN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")
_PREFIX = 64


def dirname_for(key: str) -> str:
    """The one directory name (a single path component, at most 97 characters) of ``key``."""
    if _PLAIN.fullmatch(key):
        return key
    prefix = re.sub(r"[^A-Za-z0-9._-]", "_", key)[:_PREFIX].lstrip(".")
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{prefix}+{digest}"
