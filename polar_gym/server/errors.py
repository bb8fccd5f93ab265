"""The rollout server's refusal: one exception whose ``status`` and ``kind`` the HTTP API answers with."""

from __future__ import annotations

__all__ = ["ServerError"]


class ServerError(Exception):
    """A request the server refuses: ``status`` is the HTTP status the API answers with."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind
