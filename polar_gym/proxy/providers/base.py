"""What every front end provides: parse a request into the normalized chat form, render a result back, and
describe a synthetic stream as typed events. All pure; the service does the I/O and the serialization.

A provider also declares what the service needs to know of its protocol: the shape of its errors
(``error_style``, ``stream_error``), the prefix of its response ids (``id_prefix``), and whether it has a
token-counting call (``parse_count`` / ``render_count``). What rendering an answer needs to remember of the request
(whether thinking was asked for, which tool names stand for custom tools...) is the provider's own typed render
state, carried in :attr:`Inbound.render_state`.
"""

from __future__ import annotations

import abc
import functools
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Generic, TypeVar

import orjson
import pydantic

from polar_gym.known_json import CONVERSATION_FIELDS, KNOWN
from polar_gym.proxy.chat import ChatRequest, ChatResult
from polar_gym.proxy.errors import (
    ErrorStyle,
    ProxyError,
    RequestError,
    UnsupportedRoute,
    error_body,
    validation_message,
)
from polar_gym.proxy.images import RequestImage

M = TypeVar("M", bound=pydantic.BaseModel)
T = TypeVar("T")
#: a provider's render state (a small frozen dataclass of its own)
S = TypeVar("S")

__all__ = [
    "Inbound",
    "Provider",
    "RenderContext",
    "Route",
    "SSEEvent",
    "at_place",
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
class Inbound(Generic[S]):
    """A parsed request: the normalized chat request plus what rendering the answer needs to know
    (``render_state``, typed by the provider)."""

    provider: str
    model: str
    stream: bool
    chat: ChatRequest
    render_state: S
    normalizations: list[str] = field(default_factory=list)
    ignored_fields: list[str] = field(default_factory=list)
    #: a streamed answer goes out as one JSON array of the chunks instead of SSE (Google without ``alt=sse``)
    stream_json_array: bool = False
    #: the request's images, checked (:func:`polar_gym.proxy.images.request_images`)
    images: list[RequestImage] = field(default_factory=list)


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


@functools.cache
def _field_validator(model: type[pydantic.BaseModel], key: str) -> tuple[str, pydantic.TypeAdapter[Any]] | None:
    """The name and validator of the field ``key`` names (by name or alias), if the model declares it."""
    for name, info in model.model_fields.items():
        if key in (name, info.alias, info.validation_alias):
            annotation = Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
            return name, pydantic.TypeAdapter(annotation)
    return None


@functools.cache
def _item_validator(model: type[pydantic.BaseModel], key: str) -> pydantic.TypeAdapter[Any] | None:
    """The validator of one item of the field ``key``, when the model declares it a list of one type."""
    for name, info in model.model_fields.items():
        if key in (name, info.alias, info.validation_alias):
            if typing.get_origin(info.annotation) is list:
                return pydantic.TypeAdapter(typing.get_args(info.annotation)[0])
            return None
    return None


def _known_items_validated(model: type[M], body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with the items of its conversation that the session sent before (known items,
    :mod:`polar_gym.known_json`) as their models, validated once: the model takes a model as it is."""
    name = next((n for n in CONVERSATION_FIELDS if isinstance(body.get(n), list)), None)
    if name is None or not body[name] or not KNOWN.known(body[name][0]):
        return body
    adapter = _item_validator(model, name)
    if adapter is None:
        return body
    try:
        items = [KNOWN.derive(item, (model, name), adapter.validate_python) for item in body[name]]
    except pydantic.ValidationError:
        return body  # validated whole, for the error's place in the body
    return {**body, name: items}


def parse_model(model: type[M], body: Any) -> M:
    """Validate ``body`` against a protocol model, turning pydantic's error into a RequestError. A known value
    (:mod:`polar_gym.known_json`: the tools a harness sends on every call, the items of its conversation it sent
    before) is validated once, not on every call."""
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    body = _known_items_validated(model, body)
    try:
        known = [(key, found) for key, value in body.items()
                 if KNOWN.known(value) and (found := _field_validator(model, key)) is not None]
        if not known:
            return model.model_validate(body)
        try:
            known_keys = {key for key, _ in known}
            req = model.model_validate({key: value for key, value in body.items() if key not in known_keys})
            for key, (name, adapter) in known:
                req.__dict__[name] = KNOWN.derive(body[key], (model, name), adapter.validate_python)
                req.__pydantic_fields_set__.add(name)
        except pydantic.ValidationError:
            return model.model_validate(body)  # the whole body's error, as it would be without known values
        return req
    except pydantic.ValidationError as exc:
        raise RequestError(validation_message(exc)) from exc


@functools.lru_cache(maxsize=4096)
def at_place(translate: Callable[..., T], /, **place: Any) -> Callable[[Any], T]:
    """``translate`` with an item's place in the conversation bound (what :meth:`KnownValues.derive
    <polar_gym.known_json.KnownValues.derive>` computes a known item's translation with), made once per place:
    a conversation's places repeat on every call."""
    return functools.partial(translate, **place)


def translated_once(value: Any, kind: str, translate: Callable[[Any, list[str]], T], notes: list[str]) -> T:
    """``translate(value, notes)``, computed once per known ``value`` (the tools a harness sends on every call):
    the result is shared by every call that sent them, so callers never change it; its notes are added again
    (those not given yet)."""
    def compute(v: Any) -> tuple[T, list[str]]:
        own: list[str] = []
        return translate(v, own), own

    result, own = KNOWN.derive(value, kind, compute)
    notes.extend(note for note in own if note not in notes)  # a note is given once, as translating in place does
    return result


class Provider(abc.ABC, Generic[S]):
    """A provider protocol, rendering with its own state type ``S``. ``name`` is the registry key."""

    name: ClassVar[str]
    #: the request field holding the conversation (journal prefix-sharing keys on it)
    conversation_field: ClassVar[str]
    #: the shape of its error bodies (what its SDKs parse)
    error_style: ClassVar[ErrorStyle] = "openai"
    #: the prefix of the response ids it renders (``msg_``, ``chatcmpl-``, ``resp_``)
    id_prefix: ClassVar[str] = ""
    #: what a slow stream is sent while its engine call runs (before any event): an SSE comment
    keepalive: ClassVar[bytes] = b": keepalive\n\n"

    @abc.abstractmethod
    def parse(self, body: dict[str, Any], route: Route) -> Inbound[S]:
        """Validate and translate a request; raise RequestError on bad input."""

    @abc.abstractmethod
    def render(self, result: ChatResult, inbound: Inbound[S], ctx: RenderContext) -> dict[str, Any]:
        """The non-streaming response body."""

    @abc.abstractmethod
    def stream(self, result: ChatResult, inbound: Inbound[S], ctx: RenderContext) -> Iterator[SSEEvent]:
        """The events of a synthetic stream carrying exactly ``result``, in the provider's grammar."""

    def error_body(self, exc: ProxyError) -> tuple[int, dict[str, Any]]:
        """The status and body of ``exc`` as this provider's API answers an error."""
        return error_body(exc, self.error_style)

    def stream_error(self, exc: ProxyError) -> SSEEvent:
        """``exc`` inside a stream that already answered 200, in the provider's stream grammar."""
        return SSEEvent(error_body(exc, self.error_style)[1])

    # -- token counting: optional; a protocol that has it overrides both -------------------------------------

    def parse_count(self, body: dict[str, Any], route: Route) -> Inbound[S]:
        """A token-counting request (Anthropic's count_tokens, Google's countTokens). The default: the protocol
        has none, which the caller gets as a 404 in this provider's error shape."""
        raise UnsupportedRoute(f"the {self.name} protocol has no token counting endpoint")

    def render_count(self, count: int) -> dict[str, Any]:
        """The answer to a token-counting request."""
        raise UnsupportedRoute(f"the {self.name} protocol has no token counting endpoint")
