"""Our own opaque reasoning blobs (Responses' ``encrypted_content``, Gemini's ``thoughtSignature``).

A stateless proxy has nowhere to keep the reasoning a model sampled, yet the next prompt must carry it exactly
(or the chat template renders a different history and prefix merging breaks). Protocols that hand an opaque blob
to the client and expect it back carry the reasoning text itself, recoverable here; foreign blobs are left alone.
"""

from __future__ import annotations

import base64
import binascii

__all__ = ["ENCRYPTED_PREFIX", "decode_reasoning", "decode_signature", "encode_reasoning", "encode_signature"]

#: marks reasoning text we encoded ourselves
ENCRYPTED_PREFIX = "pgr1:"


def encode_reasoning(text: str) -> str:
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()


def decode_reasoning(blob: str | None) -> str | None:
    """The text inside one of our blobs, or None for a foreign or damaged one."""
    if not blob or not blob.startswith(ENCRYPTED_PREFIX):
        return None
    try:
        return base64.b64decode(blob[len(ENCRYPTED_PREFIX):], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def encode_signature(text: str) -> str:
    """A Gemini ``thoughtSignature`` carrying ``text``: SDKs treat signatures as base64 bytes, so the whole blob
    (our marker included) is base64."""
    return base64.b64encode(ENCRYPTED_PREFIX.encode() + text.encode()).decode()


def decode_signature(blob: str | None) -> str | None:
    """The text inside one of our thought signatures, or None for a foreign one (e.g. gemini-cli's placeholder)."""
    if not blob:
        return None
    try:
        raw = base64.b64decode(blob, validate=True)
    except (binascii.Error, ValueError):
        return None
    if not raw.startswith(ENCRYPTED_PREFIX.encode()):
        return None
    try:
        return raw[len(ENCRYPTED_PREFIX):].decode()
    except UnicodeDecodeError:
        return None
