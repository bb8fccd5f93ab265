"""Signed task callbacks. The rollout server POSTs a finished task to the trainer's ``callback_url``; anyone who can
reach that port could post too, and the idempotency key (``polar-task-<id>``) is predictable. So the trainer's
receiver makes a secret, the TaskRequest carries it (``callback_secret``), and the server signs every delivery:

    x-polar-timestamp: <unix seconds>
    x-polar-signature: v1=<hex HMAC-SHA256(secret, "v1:<timestamp>:<len(key)>:<key>:" + body)>

The MAC covers the body (integrity, not just identity), the idempotency key (a signed body cannot be replayed under
another task's key; the key is length-prefixed so no split of key and body is ambiguous) and the timestamp (a
receiver refuses one older or newer than ``max_skew`` seconds, so a captured delivery is only ever a duplicate).
The receiver checks everything but the MAC before it reads a byte of the body, and feeds the MAC chunk by chunk.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping

__all__ = ["MAX_SKEW", "SIGNATURE_HEADER", "TIMESTAMP_HEADER", "BodyVerifier", "SignatureError", "new_secret",
           "sign"]

SIGNATURE_HEADER = "x-polar-signature"
TIMESTAMP_HEADER = "x-polar-timestamp"
#: how far a delivery's timestamp may be from the receiver's clock, in seconds (clock skew plus transfer time)
MAX_SKEW = 300.0
_VERSION = "v1"


class SignatureError(ValueError):
    """A callback that is not signed by the receiver's secret: ``kind`` names why (unsigned_callback,
    stale_signature, bad_signature), the message says it for people (never the secret or the expected MAC)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def new_secret() -> str:
    """A fresh receiver secret (256 random bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def _mac(secret: str, timestamp: str, key: str) -> hmac.HMAC:
    mac = hmac.new(secret.encode(), digestmod=hashlib.sha256)
    mac.update(f"{_VERSION}:{timestamp}:{len(key)}:{key}:".encode())
    return mac


def sign(secret: str, key: str, body: bytes, now: float | None = None) -> dict[str, str]:
    """The headers that sign ``body`` delivered under idempotency ``key`` at ``now`` (default: the clock)."""
    timestamp = str(int(time.time() if now is None else now))
    mac = _mac(secret, timestamp, key)
    mac.update(body)
    return {TIMESTAMP_HEADER: timestamp, SIGNATURE_HEADER: f"{_VERSION}={mac.hexdigest()}"}


class BodyVerifier:
    """Checks one delivery against ``secret``: the headers at once (SignatureError when a header is missing or the
    timestamp is stale), then the body as it streams in (``update``), then the MAC (``verify``, constant time)."""

    def __init__(self, secret: str, headers: Mapping[str, str], key: str, *, now: float | None = None,
                 max_skew: float = MAX_SKEW) -> None:
        timestamp, signature = headers.get(TIMESTAMP_HEADER), headers.get(SIGNATURE_HEADER)
        if not timestamp or not signature:
            raise SignatureError("unsigned_callback", f"the callback is not signed (no {TIMESTAMP_HEADER} and "
                                                      f"{SIGNATURE_HEADER} headers); this receiver takes only "
                                                      "callbacks signed with its secret")
        if not timestamp.isascii() or not timestamp.isdigit() or len(timestamp) > 12:
            raise SignatureError("unsigned_callback", f"malformed {TIMESTAMP_HEADER} header")
        skew = abs((time.time() if now is None else now) - int(timestamp))
        if skew > max_skew:
            raise SignatureError("stale_signature", f"the signature's timestamp is {skew:.0f} s away from this "
                                                    f"receiver's clock (at most {max_skew:g} s)")
        self._claimed = signature.strip().encode()
        self._mac = _mac(secret, timestamp, key)

    def update(self, chunk: bytes) -> None:
        self._mac.update(chunk)

    def verify(self) -> None:
        expected = f"{_VERSION}={self._mac.hexdigest()}".encode()
        if not hmac.compare_digest(expected, self._claimed):
            raise SignatureError("bad_signature", "the callback's signature does not match its body and this "
                                                  "receiver's secret")
