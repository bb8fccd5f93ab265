"""The viewer's HTTP surface: one APIRouter (mounted under ``/view`` by the standalone app and by the rollout server)
serving the static page and its read-only JSON routes over a ViewSource.

    GET /view/                                         the page (``?token=T`` once: sets the viewer cookie)
    GET /view/static/{viewer.js,viewer.css}            the page's script and style (package data)
    GET /view/api/run                                  the run's title and tokenizer
    GET /view/api/sessions?status=&task=&harness=&cause=&reward=&reward_min=&reward_max=&offset=&limit=
    GET /view/api/sessions/{id}                        one session: traces' messages, chains, calls
    GET /view/api/sessions/{id}/traces/{i}/prompt      one trace's prompt messages and tools
    GET /view/api/sessions/{id}/traces/{i}/tokens      one trace's token stream as arrays

Run data is hostile (model output, tool output, task ids): the page inserts it as text only, and every answer
carries a Content-Security-Policy that allows no inline script, no other origin and no framing, plus ``nosniff``.
Unknown session ids and ids that could name a path (``..``, ``/``) are 404. Answers are built in worker threads
and bounded (a page of rows; one trace's tokens at a time), so a live server's real clients are not slowed.

Auth (``ViewerAuth``, used by the rollout server): the admin token as a header (``x-admin-token`` or ``Authorization:
Bearer``) for scripts, or for a browser ``/view/?token=T`` once, which answers with an HttpOnly SameSite=Strict
cookie holding a random per-process viewer secret (never the admin token, and good for these read-only routes
only) and redirects to ``/view/`` so the token leaves the address bar and history.

A browser sends a host's cookies to every port of it, and counts every port of a host as the same site (SameSite
does not tell them apart). So the cookie's name is the instance's own (``polar_view_<id>``, random per process: a
second viewer's login does not overwrite the first's), its path is ``/view/``, and a request another origin made
(an ``Origin`` or ``Referer`` that is not this request's own scheme and Host, or ``Sec-Fetch-Site`` same-site /
cross-site) is refused with 403 on every route but a navigation to the page itself: a page on another local port
cannot fetch, embed or script the viewer's answers with the user's cookie.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import urllib.parse
from collections.abc import Callable
from importlib import resources
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import RedirectResponse, Response

from polar_gym.httpguard import TokenCheck
from polar_gym.view.model import (
    MAX_ROWS,
    RowFilter,
    filter_rows,
    session_payload,
    trace_prompt,
    trace_tokens,
    valid_session_id,
)
from polar_gym.view.source import ViewSource
from polar_gym.web import ApiError

__all__ = ["PREFIX", "SECURITY_HEADERS", "ViewerAuth", "foreign_origin", "viewer_router"]

PREFIX = "/view"
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               # data: images: a multimodal trace's pictures, as its messages hold them
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_STATIC = {"viewer.js": "text/javascript; charset=utf-8", "viewer.css": "text/css; charset=utf-8"}


def _asset(name: str) -> bytes:
    return resources.files("polar_gym.view").joinpath("static", name).read_bytes()


def _origin(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower() if parts.scheme and parts.netloc else "null"


def foreign_origin(request: Request, *, navigation_ok: bool = False) -> str | None:
    """The other origin a browser says made this request (its Origin or Referer, or ``Sec-Fetch-Site``), else None.
    The request's own origin is its scheme and Host header as the browser sent it (so a viewer reached through
    ``ssh -L`` on another local port is still its own origin). With ``navigation_ok`` a top-level navigation
    from elsewhere (a link to the page) passes: the answer goes to the user's window, not to the other page."""
    headers = request.headers
    own = f"{request.url.scheme}://{headers.get('host', '')}".lower()
    navigation = navigation_ok and headers.get("sec-fetch-mode", "navigate") == "navigate" \
        and headers.get("sec-fetch-dest", "document") == "document"
    origin = headers.get("origin")
    if origin is not None and origin.lower() != own:
        return origin[:200]
    if navigation:
        return None
    referer = headers.get("referer")
    if referer is not None and _origin(referer) != own:
        return _origin(referer)[:200]
    site = headers.get("sec-fetch-site", "")
    if site in ("same-site", "cross-site"):
        return f"a {site} page"
    return None


class ViewerAuth:
    """Who may read the viewer: the admin token (header), or the viewer cookie handed out for it. The cookie's name
    is this instance's own (see the module docstring)."""

    def __init__(self, check: TokenCheck) -> None:
        self._check = check
        self._secret = secrets.token_urlsafe(32)
        self.cookie = f"polar_view_{secrets.token_hex(6)}"

    def admits(self, request: Request) -> bool:
        if self._check.admits(request.scope.get("headers", ())):
            return True
        cookie = request.cookies.get(self.cookie, "")
        return bool(cookie) and hmac.compare_digest(cookie.encode(), self._secret.encode())

    def login(self, token: str) -> str | None:
        """The cookie value for a right admin token, else None."""
        return self._secret if self._check.matches(token) else None


def _json(data: Any) -> Response:
    return Response(orjson.dumps(data), media_type="application/json", headers=SECURITY_HEADERS)


def viewer_router(source: ViewSource | Callable[[], ViewSource], auth: ViewerAuth | None = None) -> APIRouter:
    """The router; with ``auth`` every route needs the admin token or the viewer cookie (401 otherwise)."""

    def current() -> ViewSource:
        return source() if callable(source) else source

    def same_origin(request: Request, *, navigation_ok: bool = False) -> None:
        other = foreign_origin(request, navigation_ok=navigation_ok)
        if other is not None:
            raise ApiError(403, "forbidden", f"the viewer answers its own page only, not a request made by {other}")

    def admitted(request: Request) -> None:
        if auth is not None and not auth.admits(request):
            raise ApiError(401, "unauthorized", "the viewer needs its token: open /view/?token=TOKEN once (the "
                                                "URL the viewer printed, or the server's admin token), or send the "
                                                "x-admin-token header")

    async def allowed(request: Request) -> None:
        same_origin(request)
        admitted(request)

    router = APIRouter(prefix=PREFIX)
    guarded = [Depends(allowed)]

    @router.get("", include_in_schema=False)
    async def bare() -> Response:
        return RedirectResponse(f"{PREFIX}/", status_code=307, headers=SECURITY_HEADERS)

    @router.get("/", include_in_schema=False)
    async def page(request: Request, token: str | None = Query(None, max_length=4096)) -> Response:
        same_origin(request, navigation_ok=True)
        if auth is not None and token is not None:
            cookie = auth.login(token)
            if cookie is None:
                raise ApiError(401, "unauthorized", "wrong token")
            answer = RedirectResponse(f"{PREFIX}/", status_code=303, headers=SECURITY_HEADERS)
            answer.set_cookie(auth.cookie, cookie, httponly=True, samesite="strict", path=f"{PREFIX}/",
                              secure=request.url.scheme == "https")
            return answer
        admitted(request)
        return Response(_asset("index.html"), media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)

    @router.get("/static/{name}", include_in_schema=False, dependencies=guarded)
    async def static(name: str) -> Response:
        if name not in _STATIC:
            raise ApiError(404, "not_found", "no such file")
        return Response(_asset(name), media_type=_STATIC[name], headers=SECURITY_HEADERS)

    @router.get("/api/run", dependencies=guarded)
    async def run() -> Response:
        tokens = current().tokens()
        return _json({"title": current().title, "tokenizer": str(tokens.directory) if tokens else None})

    @router.get("/api/sessions", dependencies=guarded)
    async def sessions(status: str | None = Query(None, max_length=64), task: str | None = Query(None, max_length=512),
                       harness: str | None = Query(None, max_length=256),
                       cause: str | None = Query(None, max_length=128), reward: float | None = None,
                       reward_min: float | None = None, reward_max: float | None = None,
                       offset: int = Query(0, ge=0, le=10_000_000),
                       limit: int = Query(1000, ge=1, le=MAX_ROWS)) -> Response:
        flt = RowFilter(status=status or None, task=task or None, harness=harness or None, cause=cause or None,
                        reward=reward, reward_min=reward_min, reward_max=reward_max)
        rows = await current().rows()
        return _json(await asyncio.to_thread(filter_rows, rows, flt, offset=offset, limit=limit))

    async def _session(session_id: str) -> Any:
        data = await current().session(session_id) if valid_session_id(session_id) else None
        if data is None:
            raise ApiError(404, "unknown_session", "no such session in this run")
        return data

    @router.get("/api/sessions/{session_id}", dependencies=guarded)
    async def session(session_id: str) -> Response:
        data = await _session(session_id)
        return Response(await asyncio.to_thread(lambda: orjson.dumps(session_payload(data))),
                        media_type="application/json", headers=SECURITY_HEADERS)

    async def _trace(session_id: str, index: int) -> dict[str, Any]:
        data = await _session(session_id)
        if not 0 <= index < len(data.traces):
            raise ApiError(404, "unknown_trace", "no such trace in this session")
        trace: dict[str, Any] = data.traces[index]
        return trace

    @router.get("/api/sessions/{session_id}/traces/{index}/prompt", dependencies=guarded)
    async def prompt(session_id: str, index: int) -> Response:
        trace = await _trace(session_id, index)
        return Response(await asyncio.to_thread(lambda: orjson.dumps(trace_prompt(trace))),
                        media_type="application/json", headers=SECURITY_HEADERS)

    @router.get("/api/sessions/{session_id}/traces/{index}/tokens", dependencies=guarded)
    async def tokens(session_id: str, index: int) -> Response:
        trace, decoder = await _trace(session_id, index), current().tokens()

        def build() -> bytes:
            ids = list(trace.get("prompt_ids") or ()) + list(trace.get("response_ids") or ())
            vocab = decoder.texts(ids) if decoder is not None else None
            return orjson.dumps(trace_tokens(trace, vocab))

        return Response(await asyncio.to_thread(build), media_type="application/json", headers=SECURITY_HEADERS)

    return router
