"""Check the inference upstreams before the first session: a wrong URL must stop the launch with a message naming
the URL and what it answered, not turn into a run of sessions that look like a model scoring 0 (issue 11, fault 10).

One probe is ``GET {url}/v1/models``, the route every OpenAI-compatible server (vLLM, SGLang) answers without
sampling; it costs a few milliseconds. :func:`describe` (pure) turns what came back into a verdict. When the
configured prompt mode is token_in, each upstream then gets one minimal token prompt (one new token, the body real
calls send: :func:`~polar_gym.proxy.engines.token_prompts.token_probe`): a server that serves only chat would refuse
every call of the run (issue 41), and the message says to use ``prompt_mode chat``.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import orjson
from rich.console import Console

from polar_gym.fleet.settings import InferenceSettings
from polar_gym.proxy.engines.token_prompts import (
    PROBE_PROMPT_IDS,
    TOKEN_PROMPT_HINT,
    served_model,
    token_probe,
    token_probe_answer,
)
from polar_gym.proxy.settings import TOKEN_IN_ENGINES, configured_prompt_mode
from polar_gym.server.client import RolloutClient

__all__ = ["UpstreamCheck", "UpstreamCheckFailed", "check_token_prompts", "check_upstreams", "describe",
           "ensure_upstreams", "failure_message", "probe", "probe_token_prompt", "rollout_backends", "summary_line",
           "token_failure_message"]


class UpstreamCheckFailed(Exception):
    """An inference upstream did not answer as an OpenAI-compatible server; the message names each bad URL."""


@dataclass(frozen=True)
class UpstreamCheck:
    """One upstream's verdict: ``ok`` and, either way, what it answered in words."""

    url: str
    ok: bool
    answer: str
    seconds: float = 0.0
    #: the first model the server lists (None: none, or it did not answer with a model list)
    model: str | None = None


def describe(status: int, body: bytes, *, model: str | None = None) -> tuple[bool, str]:
    """Whether an answer to ``GET /v1/models`` shows a usable OpenAI-compatible server, and what it answered."""
    excerpt = body[:200].decode(errors="replace").strip()
    if status != 200:
        return False, f"HTTP {status}" + (f": {excerpt}" if excerpt else "")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False, f"HTTP 200 but not an OpenAI-compatible /v1/models (not JSON: {excerpt!r})"
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list):
        return False, f"HTTP 200 but not an OpenAI-compatible /v1/models (no \"data\" list: {excerpt!r})"
    ids = [str(m.get("id")) for m in models if isinstance(m, dict)]
    if model is not None and model not in ids:
        return False, f"serves {ids}, not inference.upstream_model={model!r}"
    return True, f"serves {ids}"


def _connect_failure(exc: httpx.HTTPError) -> str:
    cause: BaseException | None = exc
    while cause is not None:  # httpx wraps the OSError of the socket; its errno says what happened
        if isinstance(cause, OSError) and cause.errno == errno.ECONNREFUSED:
            return "connection refused"
        cause = cause.__cause__ or cause.__context__
    return f"cannot connect ({exc.__class__.__name__}: {exc})"


async def probe(client: httpx.AsyncClient, url: str, *, timeout: float, model: str | None = None) -> UpstreamCheck:
    """``GET {url}/v1/models`` once; never raises."""
    base = url.rstrip("/")
    t0 = time.perf_counter()
    try:
        resp = await client.get(f"{base}/v1/models", timeout=timeout)
    except httpx.TimeoutException:
        ok, answer = False, f"no answer within {timeout:g} s"
    except httpx.ConnectError as exc:
        ok, answer = False, _connect_failure(exc)
    except httpx.HTTPError as exc:
        ok, answer = False, f"{exc.__class__.__name__}: {exc}"
    else:
        ok, answer = describe(resp.status_code, resp.content, model=model)
        served = served_model(resp.content) if resp.status_code == 200 else None
        return UpstreamCheck(base, ok, answer, time.perf_counter() - t0, served)
    return UpstreamCheck(base, ok, answer, time.perf_counter() - t0)


async def probe_token_prompt(client: httpx.AsyncClient, engine: str, check: UpstreamCheck, *, timeout: float,
                             model: str | None = None) -> UpstreamCheck:
    """POST one minimal token prompt to an upstream that passed :func:`probe` (``model``: the name to send, else
    the first one it serves); never raises. ``ok`` when it took the prompt, else ``answer`` says what came back."""
    route, body = token_probe(engine, list(PROBE_PROMPT_IDS), model or check.model)
    t0 = time.perf_counter()
    try:
        resp = await client.post(f"{check.url}{route}", content=orjson.dumps(body),
                                 headers={"content-type": "application/json"}, timeout=timeout)
    except httpx.TimeoutException:
        answer: str | None = f"no answer within {timeout:g} s"
    except httpx.ConnectError as exc:
        answer = _connect_failure(exc)
    except httpx.HTTPError as exc:
        answer = f"{exc.__class__.__name__}: {exc}"
    else:
        answer = token_probe_answer(resp.status_code, resp.content)
        if answer is not None:
            answer = f"refused a token prompt (POST {check.url}{route} answered {answer})"
    if answer is None:
        return UpstreamCheck(check.url, True, f"{check.answer}, takes token prompts", check.seconds, check.model)
    if not answer.startswith("refused"):
        answer = f"did not answer a token prompt (POST {check.url}{route}): {answer}"
    return UpstreamCheck(check.url, False, answer, time.perf_counter() - t0, check.model)


async def check_token_prompts(checks: list[UpstreamCheck], engine: str, *, timeout: float = 10.0,
                              model: str | None = None,
                              client: httpx.AsyncClient | None = None) -> list[UpstreamCheck]:
    """:func:`probe_token_prompt` for every upstream (concurrently); the verdict of each."""
    own = client is None
    plain = all(c.url.startswith("http://") for c in checks)
    http = client or httpx.AsyncClient(trust_env=False, verify=not plain)
    try:
        return list(await asyncio.gather(*(probe_token_prompt(http, engine, c, timeout=timeout, model=model)
                                           for c in checks)))
    finally:
        if own:
            await http.aclose()


async def check_upstreams(urls: list[str], *, timeout: float = 10.0, model: str | None = None,
                          wait_seconds: float = 0.0, interval: float = 1.0,
                          on_wait: Callable[[list[UpstreamCheck]], Awaitable[None] | None] | None = None,
                          client: httpx.AsyncClient | None = None) -> list[UpstreamCheck]:
    """Probe every URL (concurrently). With ``wait_seconds`` > 0 the bad ones are probed again every ``interval``
    until they all answer or the time is up (a policy server that starts after the fleet); ``on_wait`` hears each
    round that still has a bad one. Returns the last verdict of every URL."""
    own = client is None
    # plain-http upstreams (the usual case) skip loading the CA bundle, most of the check's own cost
    plain = all(u.startswith("http://") for u in urls)
    http = client or httpx.AsyncClient(trust_env=False, verify=not plain)
    deadline = time.monotonic() + wait_seconds
    try:
        verdicts: dict[str, UpstreamCheck] = {}
        pending = [u.rstrip("/") for u in urls]
        while True:
            for check in await asyncio.gather(*(probe(http, u, timeout=timeout, model=model) for u in pending)):
                verdicts[check.url] = check
            pending = [u for u, c in verdicts.items() if not c.ok]
            remaining = deadline - time.monotonic()
            if not pending or remaining <= 0:
                return [verdicts[u.rstrip("/")] for u in urls]
            if on_wait is not None:
                waited = on_wait([verdicts[u] for u in pending])
                if waited is not None:
                    await waited
            await asyncio.sleep(min(interval, remaining))
    finally:
        if own:
            await http.aclose()


def failure_message(engine: str, checks: list[UpstreamCheck], *, waited: float = 0.0) -> str:
    """The launch's message for bad upstreams: one line per URL with what it answered, then what to do."""
    bad = [c for c in checks if not c.ok]
    lines = [f"inference upstream check failed (engine {engine}"
             + (f", after waiting {waited:.1f} s" if waited else "") + "); no session was started:"]
    lines += [f"  {c.url}: {c.answer} (GET {c.url}/v1/models)"
              + ("; drop the trailing /v1: the engine appends /v1/... itself" if c.url.endswith("/v1") else "")
              for c in bad]
    if waited:
        lines.append("Fix inference.upstreams or start the server; inference.upstream_wait_seconds sets how long the "
                     "launch waits for it, inference.preflight=false skips this check.")
    else:
        lines.append("Fix inference.upstreams or start the server; inference.await_upstreams=true waits for a server "
                     "that starts later, inference.preflight=false skips this check.")
    return "\n".join(lines)


def token_failure_message(engine: str, checks: list[UpstreamCheck]) -> str:
    """The launch's message for upstreams that do not take the token prompts prompt_mode token_in sends."""
    bad = [c for c in checks if not c.ok]
    lines = [f"inference upstream check failed (engine {engine}, prompt mode token_in); no session was started:"]
    lines += [f"  {c.url}: {c.answer}" for c in bad]
    if any(c.answer.startswith("refused") for c in bad):
        lines.append(TOKEN_PROMPT_HINT)
    else:
        lines.append("Start the server or fix inference.upstreams; inference.preflight=false skips this check.")
    return "\n".join(lines)


async def rollout_backends(client: RolloutClient) -> list[str]:
    """The inference backends a rollout server lists (``GET /backends``) through a RolloutClient."""
    resp = await client.http.get("/backends")
    resp.raise_for_status()
    return [str(u) for u in resp.json().get("backends") or []]


def summary_line(checks: list[UpstreamCheck], seconds: float) -> str:
    """The one console line of a passed check."""
    return (f"inference upstreams ok ({seconds * 1000:.0f} ms): "
            + ", ".join(f"{c.url} {c.answer}" for c in checks))


async def ensure_upstreams(settings: InferenceSettings, urls: list[str], console: Console, *,
                           backends: Callable[[], Awaitable[list[str]]] | None = None) -> list[UpstreamCheck]:
    """The launch's check before its first session; raises :class:`UpstreamCheckFailed` with the message to print.

    Skipped for the oracle engine (no upstream) and with ``inference.preflight=false``. With
    ``inference.await_upstreams`` a fleet may start before its policy server: the check then waits, at most
    ``inference.upstream_wait_seconds``, for the listed URLs to answer, or, when none are listed, for ``backends()``
    (the rollout server's /backends) to name one."""
    if settings.engine == "oracle" or not settings.preflight:
        return []
    t0 = time.perf_counter()
    wait = settings.upstream_wait_seconds if settings.await_upstreams else 0.0
    told = False

    def waiting(what: str) -> None:
        nonlocal told
        if not told:
            console.print(f"waiting up to {wait:.0f} s for {what} (inference.await_upstreams)")
            told = True

    urls = [u for u in urls if u]
    if not urls and settings.await_upstreams and backends is not None:
        deadline = time.monotonic() + wait
        while not (urls := await backends()):
            if time.monotonic() > deadline:
                raise UpstreamCheckFailed(f"inference.await_upstreams: no inference backend was added to the rollout "
                                          f"server within {wait:.0f} s (POST /backends); no session was started")
            waiting("an inference backend to be added to the rollout server (POST /backends)")
            await asyncio.sleep(1.0)
    if not urls:
        return []
    checks = await check_upstreams(urls, timeout=settings.preflight_timeout, model=settings.upstream_model,
                                   wait_seconds=max(0.0, wait - (time.perf_counter() - t0)) if wait else 0.0,
                                   on_wait=lambda bad: waiting(", ".join(c.url for c in bad) + " to answer"))
    if not all(c.ok for c in checks):
        seconds = time.perf_counter() - t0
        raise UpstreamCheckFailed(failure_message(settings.engine, checks, waited=seconds if wait else 0.0))
    if settings.engine in TOKEN_IN_ENGINES and configured_prompt_mode(settings) == "token_in":
        checks = await check_token_prompts(checks, settings.engine, timeout=settings.preflight_token_timeout,
                                           model=settings.upstream_model)
        if not all(c.ok for c in checks):
            raise UpstreamCheckFailed(token_failure_message(settings.engine, checks))
    console.print(summary_line(checks, time.perf_counter() - t0))
    return checks
