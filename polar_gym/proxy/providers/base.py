"""What every front end provides: parse a request into the normalized chat form, render a result back, and
describe a synthetic stream as typed events. All pure; the service does the I/O and the serialization.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import orjson
import pydantic

from polar_gym.proxy.chat import ChatRequest, ChatResult
from polar_gym.proxy.errors import RequestError, validation_message

M = TypeVar("M", bound=pydantic.BaseModel)

__all__ = [
    "Inbound",
    "Provider",
    "RenderContext",
    "Route",
    "SSEEvent",
    "encode_sse",
    "parse_model",
]


@dataclass(frozen=True)
class Route:
    """What the URL said: the model and action in Google's paths, the query string (``alt=sse``, ``beta``)."""

    path: str
    model: str | None = None
    action: str | None = None
    query: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Inbound:
    """A parsed request: the normalized chat request plus what rendering the answer needs to know."""

    provider: str
    model: str
    stream: bool
    chat: ChatRequest
    normalizations: list[str] = field(default_factory=list)
    ignored_fields: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RenderContext:
    """Identifiers and clock chosen by the I/O shell, so rendering stays a pure function."""

    response_id: str
    created: int


@dataclass(frozen=True)
class SSEEvent:
    """One server-sent event. ``data`` is a JSON-able dict, or a literal string such as ``[DONE]``."""

    data: dict[str, Any] | str
    event: str | None = None


def encode_sse(event: SSEEvent) -> bytes:
    data = event.data if isinstance(event.data, str) else orjson.dumps(event.data).decode()
    if event.event is None:
        return b"data: " + data.encode() + b"\n\n"
    return b"event: " + event.event.encode() + b"\ndata: " + data.encode() + b"\n\n"


def parse_model(model: type[M], body: Any) -> M:
    """Validate ``body`` against a protocol model, turning pydantic's error into a RequestError."""
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise RequestError(validation_message(exc)) from exc


class Provider(abc.ABC):
    """A provider protocol. ``name`` is the registry key and the error style."""

    name: ClassVar[str]
    #: the request field holding the conversation (journal prefix-sharing keys on it)
    conversation_field: ClassVar[str]

    @abc.abstractmethod
    def parse(self, body: dict[str, Any], route: Route) -> Inbound:
        """Validate and translate a request; raise RequestError on bad input."""

    @abc.abstractmethod
    def render(self, result: ChatResult, inbound: Inbound, ctx: RenderContext) -> dict[str, Any]:
        """The non-streaming response body."""

    @abc.abstractmethod
    def stream(self, result: ChatResult, inbound: Inbound, ctx: RenderContext) -> Iterator[SSEEvent]:
        """The events of a synthetic stream carrying exactly ``result``, in the provider's grammar."""
