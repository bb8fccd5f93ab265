"""The caller's side of a gateway's API: one method per route the rollout server uses, request and answer bodies
typed by :mod:`polar_gym.schema`, failures as :class:`~polar_gym.gateway.errors.GatewayCallError` (translated from
httpx in one place). Why a client of its own: the server spoke this API through string URLs and untyped dicts, so a
route renamed on one side broke only at run time; tests run every method against the real gateway app.

A client is a cheap view over shared httpx pools (the server makes one per call, as a gateway's URL and token may
change when it registers again); long polls may go to a pool of their own so they never queue ahead of dispatches.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import httpx
from pydantic import BaseModel

from polar_gym.gateway.errors import GatewayBadReply, GatewayRefused, GatewayUnreachable
from polar_gym.httpguard import excerpt
from polar_gym.result_codec import MEDIA_TYPE, PackedResult, pack, read_frame
from polar_gym.schema import (
    GatewayHealth,
    PauseReply,
    PauseRequest,
    ResumeReply,
    ResumeRequest,
    SessionCancelReply,
    SessionPollReply,
    SessionPollRequest,
    SessionResult,
    SessionSpec,
    SessionView,
    SessionWithdrawReply,
    SessionWithdrawRequest,
    UpstreamAdded,
    UpstreamChange,
    UpstreamRemoved,
    UpstreamsView,
    WeightUpdateReply,
    WeightUpdateRequest,
)

__all__ = ["GatewayClient", "PolledSessions"]

Reply = TypeVar("Reply", bound=BaseModel)
_JSON = {"content-type": "application/json"}


@dataclass
class PolledSessions:
    """A poll's answer: finished results packed (polar_gym.result_codec: filed by their heads, never decoded on
    the server's event loop), the other sessions' statuses, the ids the gateway does not know. ``unreadable`` holds
    why each result that could not be read was dropped (one bad result must not hide the others), and
    ``unreadable_ids`` the same by session id (and attempt id, when the result names them), so the caller can end
    that session instead of asking for its result again and again."""

    results: list[PackedResult] = field(default_factory=list)
    statuses: dict[str, str] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    unreadable_ids: dict[str, tuple[str | None, str]] = field(default_factory=dict)


class GatewayClient:
    """The session and admin API of the gateway at ``url`` (``admin_token`` as its ``x-admin-token``)."""

    def __init__(self, url: str, admin_token: str | None = None, *, http: httpx.AsyncClient,
                 polls: httpx.AsyncClient | None = None) -> None:
        self.url = url.rstrip("/")
        self.headers = {"x-admin-token": admin_token} if admin_token else {}
        self.http, self.polls = http, polls or http

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, url: str, admin_token: str | None = None, *,
                      transport: httpx.AsyncBaseTransport | None = None,
                      timeout: float = 30.0) -> AsyncIterator[GatewayClient]:
        """A client with its own connection pool, closed when the block ends."""
        async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(timeout, connect=5.0)) as http:
            yield cls(url, admin_token, http=http)

    # -- sessions --------------------------------------------------------------------------------------------

    async def start_session(self, spec: SessionSpec) -> SessionView:
        """POST /sessions (201). A gateway that already runs the session answers 409 (GatewayRefused)."""
        resp = await self._send("POST", "/sessions", spec.model_dump_json().encode(), expect=201)
        return _parse(SessionView, resp)

    async def poll(self, session_ids: list[str], wait: float) -> PolledSessions:
        """POST /sessions/poll: returns once one of ``session_ids`` finished, or after ``wait`` seconds. Results
        come packed; a gateway that answers JSON (an older one) has them packed here, in a worker thread."""
        body = SessionPollRequest(session_ids=session_ids, wait=wait).model_dump_json().encode()
        resp = await self._send("POST", "/sessions/poll", body, client=self.polls, timeout=wait + 30.0,
                                accept=MEDIA_TYPE)
        if resp.headers.get("content-type", "").startswith(MEDIA_TYPE):
            try:
                meta, blobs = read_frame(resp.content)
                polled = _polled(SessionPollReply.model_validate(meta | {"results": []}))
            except ValueError as exc:
                raise GatewayBadReply(f"POST /sessions/poll: {excerpt(exc, 300)}") from exc
            for blob in blobs:
                try:
                    polled.results.append(PackedResult.of(blob))
                except ValueError as exc:  # no head to name it by: counted as unreadable
                    polled.unreadable.append(excerpt(exc, 300))
            return polled
        try:
            data = resp.json()
            if not isinstance(data, dict):
                raise ValueError("the answer is not a JSON object")
            raw = data.pop("results", None) or []
            if not isinstance(raw, list):
                raise ValueError("the answer is not an object with a list of results")
            polled = _polled(SessionPollReply.model_validate(data))
        except ValueError as exc:
            raise GatewayBadReply(f"POST /sessions/poll: {excerpt(exc, 300)}") from exc
        polled.results = await asyncio.to_thread(_pack_json_results, raw, polled)
        return polled

    async def withdraw(self, session_ids: list[str]) -> SessionWithdrawReply:
        """POST /sessions/withdraw: the sessions cancelled before their harness ran."""
        body = SessionWithdrawRequest(session_ids=session_ids).model_dump_json().encode()
        return _parse(SessionWithdrawReply, await self._send("POST", "/sessions/withdraw", body))

    async def cancel_session(self, session_id: str) -> SessionCancelReply:
        """POST /sessions/{id}/cancel; 404 (GatewayRefused) when the gateway does not know the session."""
        resp = await self._send("POST", f"/sessions/{session_id}/cancel")
        return _parse(SessionCancelReply, resp)

    async def health(self, timeout: float | None = None) -> GatewayHealth:
        """GET /gateway/health (no token needed)."""
        return _parse(GatewayHealth, await self._send("GET", "/gateway/health", timeout=timeout))

    # -- the proxy's LLM backends (admin) --------------------------------------------------------------------

    async def upstreams(self, timeout: float | None = None) -> UpstreamsView:
        return _parse(UpstreamsView, await self._send("GET", "/admin/upstreams", timeout=timeout))

    async def add_upstream(self, url: str, timeout: float | None = None) -> UpstreamAdded:
        body = UpstreamChange(url=url).model_dump_json().encode()
        return _parse(UpstreamAdded, await self._send("POST", "/admin/upstreams", body, timeout=timeout))

    async def remove_upstream(self, url: str, timeout: float | None = None) -> UpstreamRemoved:
        body = UpstreamChange(url=url).model_dump_json().encode()
        return _parse(UpstreamRemoved, await self._send("POST", "/admin/upstreams/remove", body, timeout=timeout))

    async def pause(self, timeout: float | None = None, in_flight: Literal["cut", "wait"] | None = None) -> PauseReply:
        """POST /admin/pause: answers once the proxy's in-flight model calls drained or, with ``in_flight`` "cut"
        (the proxy's default), its token-in generations were cut (they continue after the resume)."""
        body = None if in_flight is None else PauseRequest(in_flight=in_flight).model_dump_json().encode()
        return _parse(PauseReply, await self._send("POST", "/admin/pause", body, timeout=timeout))

    async def resume(self, policy_version: int | str | None = None, timeout: float | None = None) -> ResumeReply:
        body = ResumeRequest(policy_version=policy_version).model_dump_json().encode()
        return _parse(ResumeReply, await self._send("POST", "/admin/resume", body, timeout=timeout))

    async def update_weights(self, update: WeightUpdateRequest, timeout: float | None = None) -> WeightUpdateReply:
        """POST /admin/weights: pause, load ``update.checkpoint`` into every upstream, resume under its version.
        A failure is a GatewayRefused: 409 ``weights_unsupported``, 502 ``weight_update_failed`` (the message names
        the server), 504 ``drain_timeout``."""
        body = update.model_dump_json().encode()
        return _parse(WeightUpdateReply, await self._send("POST", "/admin/weights", body, timeout=timeout))

    async def undo_weights(self, timeout: float | None = None) -> WeightUpdateReply:
        """POST /admin/weights/undo: undo an update staged with ``resume: false`` (its servers load their previous
        checkpoint back) and resume under the old version; GatewayRefused 409 ``nothing_staged`` when none is."""
        return _parse(WeightUpdateReply, await self._send("POST", "/admin/weights/undo", timeout=timeout))

    # -- the one place httpx is spoken -----------------------------------------------------------------------

    async def _send(self, method: str, path: str, body: bytes | None = None, *, expect: int = 200,
                    client: httpx.AsyncClient | None = None, timeout: float | None = None,
                    accept: str | None = None) -> httpx.Response:
        headers = {**self.headers, **_JSON} if body is not None else dict(self.headers)
        if accept is not None:
            headers["accept"] = accept
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        try:
            resp = await (client or self.http).request(method, f"{self.url}{path}", content=body, headers=headers,
                                                       **extra)
        except httpx.HTTPError as exc:  # a ConnectError never reached the gateway: nothing ran there
            raise GatewayUnreachable(repr(exc), connected=not isinstance(exc, httpx.ConnectError)) from exc
        if resp.status_code != expect:
            raise _refused(resp)
        return resp


def _polled(reply: SessionPollReply) -> PolledSessions:
    return PolledSessions(statuses=dict(reply.statuses), unknown=list(reply.unknown))


def _pack_json_results(raw: list[Any], polled: PolledSessions) -> list[PackedResult]:
    """JSON results validated and packed (off the event loop); the ones that do not validate go to ``polled``'s
    unreadable lists."""
    out = []
    for item in raw:
        try:
            out.append(PackedResult.of(pack(SessionResult.model_validate(item))))
        except ValueError as exc:
            why = excerpt(exc, 300)
            polled.unreadable.append(why)
            named = _named(item)
            if named is not None:
                polled.unreadable_ids[named[0]] = (named[1], why)
    return out


def _named(item: Any) -> tuple[str, str | None] | None:
    """(session id, attempt id) of a result that did not validate, when it names them as strings."""
    if not isinstance(item, dict) or not isinstance(item.get("session_id"), str):
        return None
    metadata = item.get("metadata")
    attempt = metadata.get("attempt_id") if isinstance(metadata, dict) else None
    return item["session_id"], attempt if isinstance(attempt, str) else None


def _refused(resp: httpx.Response) -> GatewayRefused:
    """The error envelope's type when there is one ({"error": {"type", "message"}}), else ``http_<status>``."""
    try:
        body: Any = resp.json()
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    return GatewayRefused(resp.status_code, kind if isinstance(kind, str) else f"http_{resp.status_code}",
                          resp.text[:300], body)


def _parse(model: type[Reply], resp: httpx.Response) -> Reply:
    try:
        return model.model_validate_json(resp.content)
    except ValueError as exc:
        raise GatewayBadReply(f"{resp.request.method} {resp.request.url.path}: {excerpt(exc, 300)}") from exc
