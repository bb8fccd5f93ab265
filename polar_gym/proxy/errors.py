"""Proxy errors and their provider-shaped rendering.

    ProxyError                       (500)
    ├── RequestError                 (400) malformed JSON, wrong types, unknown fields in strict mode
    │   ├── PayloadTooLarge          (413)
    │   ├── SessionMetadataError     (400) a session's metadata the engine needs is invalid (an oracle script)
    │   └── UnsupportedRoute         (404)
    ├── WeightsUnsupported           (409) the engine cannot load new weights (openai: an outside API)
    ├── AuthError                    (401) missing or unknown session key
    └── UpstreamError                (502) the engine answered garbage or an error
        ├── WeightUpdateError        (502) a server did not take a checkpoint (no dev mode, bad path, ...)
        ├── UpstreamUnavailable      (503) no server, connection refused, paused past the wait limit
        └── UpstreamTimeout          (504)

Handlers raise these; ``error_body`` is the one place that turns one into the body and status a harness expects,
in one of three error styles (each provider declares its own), so an SDK surfaces a readable error instead of a
parse failure.
"""

from __future__ import annotations

from typing import Any, Literal

import httpx
import pydantic

__all__ = [
    "AuthError",
    "ErrorStyle",
    "PayloadTooLarge",
    "ProxyError",
    "RequestError",
    "SessionMetadataError",
    "UnsupportedRoute",
    "UpstreamError",
    "UpstreamTimeout",
    "UpstreamUnavailable",
    "WeightUpdateError",
    "WeightsUnsupported",
    "error_body",
    "error_type",
    "translate_upstream_errors",
    "validation_message",
]


class ProxyError(Exception):
    status = 500
    kind = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class RequestError(ProxyError):
    status = 400
    kind = "invalid_request"


class PayloadTooLarge(RequestError):
    status = 413
    kind = "too_large"


class SessionMetadataError(RequestError):
    """Raised by :meth:`Engine.open_session` for metadata it cannot use; a session registration answers 400."""


class UnsupportedRoute(RequestError):
    status = 404
    kind = "not_found"


class WeightsUnsupported(ProxyError):
    """Raised by :meth:`Engine.update_weights` of an engine that has no weights to load into (the admin API: 409)."""

    status = 409
    kind = "invalid_request"


class AuthError(ProxyError):
    status = 401
    kind = "authentication"


class UpstreamError(ProxyError):
    status = 502
    kind = "upstream"


class WeightUpdateError(UpstreamError):
    """An inference server did not take new weights; the message names the server and what it answered.
    ``weights_changed``: the failure came after the server had loaded them (a later step, such as the cache reset)."""

    weights_changed = False


class UpstreamUnavailable(UpstreamError):
    status = 503
    kind = "unavailable"


class UpstreamTimeout(UpstreamError):
    status = 504
    kind = "timeout"


_ANTHROPIC_TYPES = {
    "invalid_request": "invalid_request_error",
    "too_large": "request_too_large",
    "not_found": "not_found_error",
    "authentication": "authentication_error",
    "upstream": "api_error",
    "unavailable": "overloaded_error",
    "timeout": "api_error",
    "internal": "api_error",
}
_OPENAI_TYPES = {
    "invalid_request": "invalid_request_error",
    "too_large": "invalid_request_error",
    "not_found": "invalid_request_error",
    "authentication": "authentication_error",
    "upstream": "api_error",
    "unavailable": "server_error",
    "timeout": "timeout",
    "internal": "server_error",
}
_GOOGLE_STATUS = {
    "invalid_request": "INVALID_ARGUMENT",
    "too_large": "INVALID_ARGUMENT",
    "not_found": "NOT_FOUND",
    "authentication": "UNAUTHENTICATED",
    "upstream": "INTERNAL",
    "unavailable": "UNAVAILABLE",
    "timeout": "DEADLINE_EXCEEDED",
    "internal": "INTERNAL",
}


#: the error body shapes of the provider APIs (a provider declares which one its SDKs parse)
ErrorStyle = Literal["openai", "anthropic", "google"]
_TYPES: dict[ErrorStyle, dict[str, str]] = {"openai": _OPENAI_TYPES, "anthropic": _ANTHROPIC_TYPES,
                                            "google": _GOOGLE_STATUS}


def error_type(exc: ProxyError, style: ErrorStyle) -> str:
    """The error's type name in ``style`` (OpenAI's ``type``, Anthropic's ``error.type``, Google's ``status``)."""
    return _TYPES[style][exc.kind]


def error_body(exc: ProxyError, style: ErrorStyle) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of ``exc`` in the error shape ``style``."""
    if style == "anthropic":
        return exc.status, {"type": "error", "error": {"type": error_type(exc, style), "message": exc.message}}
    if style == "google":
        return exc.status, {
            "error": {"code": exc.status, "message": exc.message, "status": error_type(exc, style)}
        }
    code = "invalid_api_key" if isinstance(exc, AuthError) else None
    return exc.status, {
        "error": {"message": exc.message, "type": error_type(exc, style), "param": None, "code": code}
    }


def validation_message(exc: pydantic.ValidationError) -> str:
    """A one-line, field-addressed summary of a pydantic error, for a 400 a person can act on."""
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


class translate_upstream_errors:
    """``with translate_upstream_errors(server):`` maps transport and decoding failures of an upstream call onto the
    UpstreamError tree. A class, not a generator-based context manager: it is entered twice a model call."""

    __slots__ = ("server",)

    def __init__(self, server: str) -> None:
        self.server = server

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        server = self.server
        if exc is None:
            return
        if isinstance(exc, httpx.TimeoutException):
            raise UpstreamTimeout(f"upstream {server} timed out: {exc.__class__.__name__}") from exc
        if isinstance(exc, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
            raise UpstreamUnavailable(f"upstream {server} unreachable: {exc}") from exc
        if isinstance(exc, (ValueError, LookupError, TypeError, AttributeError, pydantic.ValidationError)):
            raise UpstreamError(f"upstream {server} returned an unusable response: {exc}") from exc
