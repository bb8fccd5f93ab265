"""The engine interface: a normalized chat request in, the answer plus its exact token data out.

HTTP engines share one shape: lease a server from the pool, build a body (pure), post it through the one injected
``httpx.AsyncClient``, parse the answer (pure). Subclasses only supply ``build`` and ``parse``.

What callers need to know of an engine it declares here rather than being asked by its class: the token IDs that end
an assistant turn (``end_of_turn_ids``, the builders' default) and per-session state it keeps (``open_session`` /
``close_session``, the oracle's scripts).

New weights (``POST /admin/weights``): an engine says how it takes them (``weight_updates``: "reload" when each
server loads a checkpoint through :meth:`Engine.update_weights`, "stamp" when it has no weights and only the policy
version changes, None when it cannot); :mod:`polar_gym.proxy.weights` pauses the pool around the calls. Any engine
with servers can instead be given servers already restarted on the checkpoint (the update's ``servers``): they are
checked (:meth:`Engine.check_server`) and replace the pool's.

An upstream's HTTP error is mapped by status: 400/413/422 mean the engine refused this request (a prompt longer than
the context, say), which the harness must see as its own 400 rather than retry; 429/503 mean the server is
momentarily unavailable; anything else is an upstream failure (502).
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import httpx
import orjson

from polar_gym.keepalive import client_limits
from polar_gym.known_json import KNOWN
from polar_gym.known_prompt_ids import KnownPromptIds
from polar_gym.proxy.chat import ChatRequest, ChatResult
from polar_gym.proxy.errors import (
    RequestError,
    UpstreamError,
    UpstreamUnavailable,
    WeightsUnsupported,
    WeightUpdateError,
    translate_upstream_errors,
)
from polar_gym.proxy.upstream_http import UpstreamAnswer, UpstreamClient
from polar_gym.proxy.upstreams import UpstreamPool

__all__ = ["Engine", "HttpEngine", "StreamDelta", "StreamPiece", "StreamStart", "WeightUpdateMode", "WholeAnswer",
           "approx_token_count", "upstream_status_error"]

#: how an engine takes new weights (see the module docstring)
WeightUpdateMode = Literal["reload", "stamp"]

_REFUSED = {400, 413, 422}
_BUSY = {429, 503}


def upstream_status_error(server_url: str, status: int, text: str) -> UpstreamError | RequestError:
    """The proxy error for an upstream's HTTP error answer (see the module docstring for the mapping)."""
    detail = text[:500]
    if status in _REFUSED:
        return RequestError(f"the inference server refused the request ({status}): {detail}")
    if status in _BUSY:
        return UpstreamUnavailable(f"upstream {server_url} is busy ({status}): {detail}")
    return UpstreamError(f"upstream {server_url} answered {status}: {detail}")


@dataclass
class StreamStart:
    """The engine has taken a streamed call: the prompt it samples from. None when only the engine knows the
    prompt's IDs (it renders the prompt: chat mode); a second StreamStart brings them with its first chunk."""

    prompt_ids: list[int] | None


@dataclass
class StreamDelta:
    """Tokens sampled since the last piece, with the text they add to the answer's reasoning and content (only
    text the output parser can already tell is plain: it is a prefix of what the whole answer parses to)."""

    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    reasoning: str = ""
    content: str = ""


class WholeAnswer(dict[str, Any]):
    """An answer :meth:`HttpEngine.post_stream` read whole: the server answered without an event stream (it ignored
    ``stream``), so it is read as a non-streamed answer is (with that answer's checks)."""


#: what :meth:`Engine.stream` yields: a StreamStart, StreamDeltas, and last the whole ChatResult
StreamPiece = StreamStart | StreamDelta | ChatResult


def approx_token_count(request: ChatRequest) -> int:
    """A length-based estimate for engines that cannot tokenize (about four characters a token)."""
    size = len(orjson.dumps(request.to_openai()["messages"]))
    if request.tools:
        size += len(orjson.dumps([t.function for t in request.tools]))
    return max(1, size // 4)


class Engine(abc.ABC):
    name: ClassVar[str]
    #: whether the engine reports the exact prompt and sampled token IDs
    token_faithful: ClassVar[bool] = True
    #: how the engine takes new weights; None: it cannot (an update is refused before the pool pauses)
    weight_updates: ClassVar[WeightUpdateMode | None] = None

    #: whether the engine can pass a stream through as it samples (:meth:`stream`); others are synthesized
    can_stream: ClassVar[bool] = False
    #: pass streams through (set from ``can_stream`` by ``__init__``; off for an engine that never calls it)
    stream_passthrough: bool = False
    #: the model's image placeholder token, which its processor repeats once per image patch (set from the
    #: tokenizer, when the proxy has one of the model: records then say where each image sits in the prompt)
    image_token_id: int | None = None

    def __init__(self, pool: UpstreamPool | None = None) -> None:
        self.pool = pool if pool is not None else UpstreamPool()
        #: stream a harness's streamed calls as the engine samples (the ``stream_passthrough`` setting); off, or
        #: for an engine that cannot, streams are synthesized from the whole answer
        self.stream_passthrough = self.can_stream

    @abc.abstractmethod
    async def complete(self, request: ChatRequest, session_id: str) -> ChatResult:
        """Answer one request, never streaming."""

    def stream(self, request: ChatRequest, session_id: str) -> AsyncGenerator[StreamPiece, None]:
        """Answer one request as the engine samples it: a StreamStart, StreamDeltas, then the ChatResult, which
        is exactly what :meth:`complete` answers for the same sampled tokens. Only engines with ``can_stream``."""
        raise NotImplementedError(f"the {self.name} engine cannot stream")

    async def count_tokens(self, request: ChatRequest, session_id: str) -> int:
        return approx_token_count(request)

    @property
    def end_of_turn_ids(self) -> tuple[int, ...] | None:
        """The token IDs that end an assistant turn of the served model (the trajectory builders' default); None
        when the engine does not know them (it holds no tokenizer)."""
        return None

    def open_session(self, session_id: str, metadata: Mapping[str, Any]) -> None:
        """A session starts being served; ``metadata`` is its task metadata. Raises
        :class:`~polar_gym.proxy.errors.SessionMetadataError` when the metadata the engine reads is invalid."""
        return None

    def close_session(self, session_id: str) -> None:
        """The session is over: drop what the engine keeps for it."""
        return None

    async def update_weights(self, server_url: str, checkpoint: str, version: int | str) -> dict[str, float]:
        """Make the server at ``server_url`` serve the weights in ``checkpoint`` (a directory as the server's host
        sees it), tagged ``version``; answers the seconds each step took. Called only while the pool is paused and
        drained. Raises WeightsUnsupported, or WeightUpdateError naming the server."""
        raise WeightsUnsupported(f"the {self.name} engine cannot load new weights")

    async def check_server(self, server_url: str) -> None:
        """Raise WeightUpdateError unless ``server_url`` serves this engine's model (before it joins the pool in a
        weight update that replaces servers); WeightsUnsupported for an engine without servers."""
        raise WeightsUnsupported(f"the {self.name} engine has no inference servers to replace")

    async def started_checkpoint(self, server_url: str) -> str | None:
        """The checkpoint ``server_url`` was started on, if it says (a weight update that fails half way loads it
        back into the servers that had taken the new weights); None when unknown."""
        return None

    async def aclose(self) -> None:
        return None


class HttpEngine(Engine):
    #: path appended to the server URL
    path: ClassVar[str] = "/v1/chat/completions"
    #: how prompts reach the server (recorded on every capture record): the engine renders chat messages
    prompt_mode: ClassVar[str] = "chat"

    def __init__(self, pool: UpstreamPool | None = None, client: httpx.AsyncClient | None = None,
                 timeout: float = 600.0, *, upstream_model: str | None = None) -> None:
        super().__init__(pool)
        #: the model name the inference server serves; harnesses ask for their own names (claude-…, gemini-…),
        #: which a server started with one ``--served-model-name`` would refuse
        self.upstream_model = upstream_model
        self._own_client = client is None
        #: the hot call's client (aiohttp; an engine given its own httpx client, as tests do, posts through that)
        self.fast = UpstreamClient(timeout=timeout) if client is None else None
        #: each session's last prompt IDs: an answer's are parsed past what they share (an agent's prompt grows)
        self.prompt_ids = KnownPromptIds()
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0),
                                                  limits=client_limits(max_connections=1024,
                                                                       max_keepalive_connections=256))

    def close_session(self, session_id: str) -> None:
        self.prompt_ids.forget(session_id)

    @abc.abstractmethod
    def build(self, request: ChatRequest) -> dict[str, Any]:
        """The upstream body for ``request``."""

    @abc.abstractmethod
    def parse(self, body: dict[str, Any]) -> ChatResult:
        """A ChatResult from the upstream's JSON answer; raise ValueError / KeyError on a malformed one."""

    async def prepare(self, request: ChatRequest) -> dict[str, Any]:
        """The body to send; engines whose ``build`` is CPU-heavy (prompt rendering) move it off the loop."""
        return self.build(request)

    def parse_for(self, body: dict[str, Any], sent: dict[str, Any]) -> ChatResult:
        """Parse ``body``, answering ``sent``; only engines whose answer does not echo the prompt need ``sent``."""
        return self.parse(body)

    async def post(self, server_url: str, path: str, body: dict[str, Any], session_id: str | None = None
                   ) -> dict[str, Any]:
        """POST ``body``, the JSON answer parsed (the prompt IDs past what the session's last answer shared)."""
        with translate_upstream_errors(server_url):
            resp: httpx.Response | UpstreamAnswer
            data = orjson.dumps(KNOWN.as_fragments(body))  # repeated tools: their JSON, not serialized again
            if self.fast is not None:
                resp = await self.fast.post(server_url + path, data)
            else:
                resp = await self.client.post(server_url + path, content=data,
                                              headers={"content-type": "application/json"})
            if resp.status_code >= 400:
                raise upstream_status_error(server_url, resp.status_code, resp.text)
            data = self.prompt_ids.loads(resp.content, session_id)
            if not isinstance(data, dict):
                raise ValueError("upstream answer is not a JSON object")
            return data

    async def post_stream(self, server_url: str, path: str, body: dict[str, Any],
                          session_id: str | None = None) -> AsyncGenerator[dict[str, Any] | None, None]:
        """POST ``body`` and yield None once the server has accepted it (its answer's head), then each JSON object
        of the server-sent-event answer as it arrives (until ``[DONE]``); an answer that is not an event stream is
        yielded whole; an HTTP error answer raises as :meth:`post` does, before anything is yielded. Through the
        hot client, as :meth:`post` (an engine given its own httpx client, as tests do, streams through that)."""
        payload = orjson.dumps(body)
        if self.fast is not None:
            async with self.fast.stream(server_url + path, payload) as (head, pieces):
                async with contextlib.aclosing(self._events(server_url, head.status_code, head.content_type,
                                                            pieces, session_id)) as events:
                    async for event in events:
                        yield event
            return
        with translate_upstream_errors(server_url):
            async with self.client.stream("POST", server_url + path, content=payload,
                                          headers={"content-type": "application/json"}) as resp:
                async with contextlib.aclosing(self._events(server_url, resp.status_code,
                                                            resp.headers.get("content-type", ""),
                                                            resp.aiter_bytes(), session_id)) as events:
                    async for event in events:
                        yield event

    async def _events(self, server_url: str, status: int, media_type: str, pieces: AsyncIterator[bytes],
                      session_id: str | None = None) -> AsyncGenerator[dict[str, Any] | None, None]:
        """What :meth:`post_stream` yields, from an answer's status, media type and body pieces."""
        with translate_upstream_errors(server_url):
            if status >= 400:
                text = b"".join([piece async for piece in pieces]).decode(errors="replace")
                raise upstream_status_error(server_url, status, text)
            yield None  # accepted: a stream may open before the first token (the prompt is known)
            if "text/event-stream" not in media_type:
                # a server that answers whole (ignoring "stream"): vLLM's and SGLang's whole answers read as one
                # last chunk
                whole = self.prompt_ids.loads(b"".join([piece async for piece in pieces]), session_id)
                if not isinstance(whole, dict):
                    raise ValueError("upstream answer is not a JSON object")
                yield WholeAnswer(whole)
                return
            done, pending = False, list[bytes]()  # read to the end: a drained connection is reused
            async for part in pieces:
                pending.append(part)
                if b"\n" not in part:
                    continue  # a long line (the prompt's IDs) still arriving
                *lines, rest = (b"".join(pending) if len(pending) > 1 else part).split(b"\n")
                pending = [rest]
                for line in lines:
                    if done or not line.startswith(b"data:"):
                        continue  # blank separators, comments, event names
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        continue
                    yield self._stream_event(server_url, payload, session_id)
            tail = b"".join(pending).strip()
            if not done and tail.startswith(b"data:") and tail[5:].strip() != b"[DONE]":
                yield self._stream_event(server_url, tail[5:].strip(), session_id)

    def _stream_event(self, server_url: str, payload: bytes, session_id: str | None) -> dict[str, Any]:
        """One ``data:`` payload of an upstream stream (an error event raises); the first holds the prompt IDs."""
        data = self.prompt_ids.loads(payload, session_id)
        if not isinstance(data, dict):
            raise ValueError("upstream stream event is not a JSON object")
        if isinstance(data.get("error"), dict | str) and "choices" not in data and "text" not in data:
            raise UpstreamError(f"upstream {server_url} failed mid-stream: {str(data['error'])[:500]}")
        return data

    async def admin_post(self, server_url: str, path: str, body: dict[str, Any], *,
                         missing: str = "") -> dict[str, Any]:
        """POST to one of a server's management routes (weights, caches): its JSON answer (``{}`` for an empty
        one); any failure is a WeightUpdateError naming the server, and ``missing`` says why a 404 may happen."""
        url = server_url + path
        try:
            with translate_upstream_errors(server_url):
                resp = await self.client.post(url, content=orjson.dumps(body),
                                              headers={"content-type": "application/json"})
                if resp.status_code >= 400:
                    hint = f" ({missing})" if resp.status_code == 404 and missing else ""
                    raise WeightUpdateError(f"{url} answered {resp.status_code}{hint}: {resp.text[:500]}")
                data = orjson.loads(resp.content) if resp.content.strip() else {}
                if not isinstance(data, dict):
                    raise ValueError("the answer is not a JSON object")
                return data
        except WeightUpdateError:
            raise
        except UpstreamError as exc:
            raise WeightUpdateError(f"{url}: {exc.message}") from exc

    async def _models(self, server_url: str) -> list[dict[str, Any]]:
        """The server's model cards (vLLM, SGLang and OpenAI-compatible servers all list them at /v1/models). A
        failure says the status and a generic reason, never the answer's text: the URL may be a new server named by
        a weight update, and its answer is not ours to relay."""
        url = server_url + "/v1/models"
        try:
            resp = await self.client.get(url, timeout=30.0)
        except httpx.HTTPError as exc:
            raise WeightUpdateError(f"{url} did not answer ({exc.__class__.__name__})") from exc
        try:
            data = orjson.loads(resp.content) if resp.status_code == 200 else None
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict) or not isinstance(data.get("data"), list):
            raise WeightUpdateError(f"{url} answered HTTP {resp.status_code}, not a model list")
        return [m for m in data["data"] if isinstance(m, dict)]

    async def check_server(self, server_url: str) -> None:
        served = [m.get("id") for m in await self._models(server_url)]
        if self.upstream_model is not None and self.upstream_model not in served:
            raise WeightUpdateError(f"{server_url} serves {served}, not {self.upstream_model!r}")

    async def started_checkpoint(self, server_url: str) -> str | None:
        try:
            models = await self._models(server_url)
        except WeightUpdateError:
            return None
        root = models[0].get("root") if models else None  # vLLM and SGLang: the path the server started from
        return root if isinstance(root, str) and root else None

    def route_of(self, body: dict[str, Any]) -> str:
        """Where ``body`` goes on the server (:attr:`path`, unless an engine sends some calls elsewhere)."""
        return self.path

    async def exchange(self, session_id: str, body: dict[str, Any],
                       read: Callable[[dict[str, Any]], ChatResult]) -> ChatResult:
        """Post ``body`` to the session's leased server and ``read`` the answer into a result stamped with the
        server, the policy version and the upstream time; a malformed answer becomes an upstream error."""
        if self.upstream_model is not None and "model" in body:
            body["model"] = self.upstream_model
        async with self.pool.lease(session_id) as server:
            started = time.perf_counter()
            data = await self.post(server.url, self.route_of(body), body, session_id)
            with translate_upstream_errors(server.url):
                result = read(data)
            result.server = server.url
            result.policy_version = self.pool.policy_version
            result.raw["upstream_seconds"] = time.perf_counter() - started
        return result

    async def complete(self, request: ChatRequest, session_id: str) -> ChatResult:
        body = await self.prepare(request)
        result = await self.exchange(session_id, body, lambda data: self.parse_for(data, body))
        result.raw.setdefault("prompt_mode", self.prompt_mode)
        return result

    async def aclose(self) -> None:
        if self.fast is not None:
            await self.fast.aclose()
        if self._own_client:
            await self.client.aclose()
