"""The private objects of uvicorn and starlette that ``polar_gym.serving`` relies on, pinned: the installed versions
are the ones it was checked against, no other module of ours touches such objects, and each behaviour it relies on
holds (the behaviours of uvicorn's connection flag and protocol are pinned in test_coalescing_transport.py, the
kept body here)."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

from polar_gym.serving import CHECKED_WITH, body_kept, keep_body

ROOT = Path(__file__).resolve().parents[2]
#: what reaching into uvicorn's or starlette's private objects looks like in our source
PRIVATE = re.compile(r"uvicorn\.protocols|httptools_impl|h11_impl|RequestResponseCycle"
                     r"|request\._[a-z]|_stream_consumed")


@pytest.mark.parametrize("package", sorted(CHECKED_WITH))
def test_the_installed_version_is_the_one_serving_was_checked_against(package: str) -> None:
    assert version(package) == CHECKED_WITH[package], (
        f"{package} {version(package)} is installed; polar_gym.serving reads its private objects as "
        f"{package} {CHECKED_WITH[package]} has them: re-check body_kept, keep_body, caller_gone and "
        "CoalescingHttpProtocol against the new version (these tests and test_coalescing_transport.py), then update "
        "CHECKED_WITH and the pin in pyproject.toml")
    assert f'"{package}' in (ROOT / "pyproject.toml").read_text()  # pinned, so no other version slips in


def test_no_other_module_reaches_into_uvicorn_or_starlette() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "polar_gym").rglob("*.py"))
                 if path.name != "serving.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1) if PRIVATE.search(line)]
    assert offenders == [], "private objects of uvicorn or starlette are read outside polar_gym/serving.py"


def _request(body: bytes) -> Request:
    messages = iter([{"type": "http.request", "body": body}])

    async def receive() -> dict[str, Any]:
        return next(messages)

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


async def test_a_kept_body_is_what_starlette_gives_again() -> None:
    """keep_body marks a body read from ``receive`` as starlette marks one it read; body_kept sees both."""
    read_by_us = _request(b"ignored")
    assert body_kept(read_by_us) is None
    assert (await read_by_us.receive())["body"] == b"ignored"
    keep_body(read_by_us, b'{"a":1}')
    assert body_kept(read_by_us) == b'{"a":1}' and await read_by_us.body() == b'{"a":1}'
    read_by_starlette = _request(b'{"b":2}')
    assert await read_by_starlette.body() == b'{"b":2}'
    assert body_kept(read_by_starlette) == b'{"b":2}'
    streamed = _request(b"x")
    assert [chunk async for chunk in streamed.stream()] == [b"x", b""]
    assert body_kept(streamed) == b""  # consumed and not kept: starlette refuses to read it again
