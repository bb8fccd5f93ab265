"""Gateway errors.

    GatewayError
    ├── DuplicateSession     a session with this id was already dispatched here (HTTP 409)
    ├── UnknownSession       no session with this id (HTTP 404)
    ├── GatewayClosed        the node is draining or stopped and takes no new sessions (HTTP 503)
    └── StageError           a stage failed; ``stage`` says which (the session ends in ERROR)
        ├── PrepareFailed    a ``runtime.prepare`` action failed
        └── DeadlineExceeded the session's shared deadline passed (the session ends in TIMEOUT)

Raised by :class:`polar_gym.gateway.client.GatewayClient` (the caller's side of the gateway's API):

    GatewayCallError         a call to a gateway's API did not succeed
    ├── GatewayUnreachable   no HTTP answer; ``connected`` is False when the request never reached the gateway
    ├── GatewayRefused       an HTTP answer other than the route's success: ``status``, ``kind`` (the error
    │                        envelope's type), ``text`` (an excerpt of the body)
    └── GatewayBadReply      a success whose body is not the route's answer
"""

from __future__ import annotations

from typing import Any

__all__ = ["DeadlineExceeded", "DuplicateSession", "GatewayBadReply", "GatewayCallError", "GatewayClosed",
           "GatewayError", "GatewayRefused", "GatewayUnreachable", "PrepareFailed", "StageError", "UnknownSession"]


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


class GatewayCallError(Exception):
    pass


class GatewayUnreachable(GatewayCallError):
    def __init__(self, message: str, *, connected: bool) -> None:
        super().__init__(message)
        self.connected = connected


class GatewayRefused(GatewayCallError):
    def __init__(self, status: int, kind: str, text: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status} ({kind}): {text}")
        #: ``body`` is the answer's JSON when it had one
        self.status, self.kind, self.text, self.body = status, kind, text, body


class GatewayBadReply(GatewayCallError):
    pass
