"""Gateway errors.

    GatewayError
    ├── DuplicateSession     a session with this id was already dispatched here (HTTP 409)
    ├── UnknownSession       no session with this id (HTTP 404)
    ├── GatewayClosed        the node is draining or stopped and takes no new sessions (HTTP 503)
    └── StageError           a stage failed; ``stage`` says which (the session ends in ERROR)
        ├── PrepareFailed    a ``runtime.prepare`` action failed
        └── DeadlineExceeded the session's shared deadline passed (the session ends in TIMEOUT)
"""

from __future__ import annotations

__all__ = ["DeadlineExceeded", "DuplicateSession", "GatewayClosed", "GatewayError", "PrepareFailed", "StageError",
           "UnknownSession"]


class GatewayError(Exception):
    pass


class DuplicateSession(GatewayError):
    pass


class UnknownSession(GatewayError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class GatewayClosed(GatewayError):
    pass


class StageError(GatewayError):
    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.message = message


class PrepareFailed(StageError):
    pass


class DeadlineExceeded(StageError):
    pass
