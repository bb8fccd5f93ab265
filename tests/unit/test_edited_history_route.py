"""A harness that edits its history mid-conversation: the proxy's trajectory route (journal read back, then the
builder) gives the second call's messages as the harness sent them, not the first call's."""

from __future__ import annotations

import httpx

from polar_gym.proxy.app import create_app
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from tests._fakes import ByteTokenizer

ADMIN = "admin-secret"


async def test_an_edited_message_reaches_the_trajectory_as_sent():
    service = ProxyService(OracleEngine(ByteTokenizer()), CaptureJournal(), SessionRegistry(allow_adhoc=True))
    transport = httpx.ASGITransport(create_app(service, ADMIN))
    auth = {"authorization": "Bearer s1"}
    s, b = {"role": "system", "content": "s"}, {"role": "user", "content": "b"}
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        for middle in ("a", "EDITED"):
            body = {"model": "policy", "messages": [s, {"role": "user", "content": middle}, b]}
            assert (await client.post("/v1/chat/completions", json=body, headers=auth)).status_code == 200
        completions = (await client.get("/sessions/s1/completions", headers=auth)).json()
        resp = await client.get("/sessions/s1/trajectory", headers=auth)
    assert resp.status_code == 200, resp.text
    sent = [m["content"] for trace in resp.json()["traces"] for m in trace["prompt_messages"]]
    assert "EDITED" in sent, sent  # the edited call's own messages, whichever chain holds them
    got = completions if isinstance(completions, list) else completions.get("completions", completions)
    assert [[m["content"] for m in c["request"]["messages"]] for c in got] == [["s", "a", "b"], ["s", "EDITED", "b"]]
