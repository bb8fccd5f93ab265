"""Every recorded real harness request (tests/data/harness), sent to a live proxy as bytes in several
serializations, comes back from the journal byte for byte as it was received (issue 18), while the journal stores
the tool lists and system prompts the calls repeat only once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from polar_gym.dirnames import dirname_for
from polar_gym.journal import RECORDS_FILE, read_received, read_session
from tests.harness.test_replay import _AUTH, _SKIP_HEADERS, CASES, _load, _require_provider, _variant

pytestmark = pytest.mark.harness


def _forms(body: dict[str, Any]) -> list[bytes]:
    """The same body as Node's JSON.stringify and Rust's serde_json write it (compact UTF-8, what orjson writes),
    as Python's json module writes it by default (ASCII escapes, spaced separators), that form again,
    pretty-printed (no serializer the journal knows: kept verbatim), and the compact form again (its conversation
    and tools known to the session by then: proved to be what orjson writes while parsed, not serialized again)."""
    return [orjson.dumps(body), json.dumps(body).encode(), json.dumps(body).encode(),
            json.dumps(body, indent=2).encode(), orjson.dumps(body)]


@pytest.mark.parametrize("case_path", CASES, ids=[f"{p.parent.name}/{p.stem}" for p in CASES])
def test_every_request_comes_back_byte_for_byte(proxy_server: Any, tmp_path: Path, case_path: Path) -> None:
    case = _load(case_path)
    provider = case["provider"]
    _require_provider(provider)
    path, body = _variant(case, stream=False)
    key = f"received-{case_path.parent.name}-{case_path.stem}"
    headers = {k: v for k, v in case.get("headers", {}).items() if k not in _SKIP_HEADERS}
    headers["content-type"] = "application/json"
    headers[_AUTH.get(provider, "authorization")] = key if provider in _AUTH else f"Bearer {key}"
    stream = tmp_path / "capture" / dirname_for(key)
    sent, sizes = _forms(body), []
    for form in sent:
        resp = httpx.post(proxy_server.url + path, content=form, headers=headers, timeout=60)
        assert resp.status_code == 200, resp.text[:2000]
        sizes.append((stream / RECORDS_FILE).stat().st_size)
    assert read_received(stream) == sent
    assert [r.request for r in read_session(stream)] == [body] * len(sent)
    # the third call repeats the second one's body: the journal adds its metadata and answer, not the body again
    assert sizes[2] - sizes[1] < min(4000, len(sent[0])), (sizes, len(sent[0]))
