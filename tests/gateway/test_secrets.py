"""Fault 4 (issue 11): a session key is a fresh secret that lives exactly as long as the session's RUNNING stage.

A real gateway (bubblewrap sandboxes, the relay, the oracle engine): the shell harness saves the key it was given
into its own HOME and waits; the test reads it from the session dir. While the session runs the key works; after,
a model call with it gets a 401 in the caller's protocol and the session's captures need the admin token. The key
is not the session id, has at least 128 bits, and is written nowhere but the harness's own files."""

from __future__ import annotations

import asyncio
import base64
import logging
from pathlib import Path

import httpx

from polar_gym.schema import AgentSpec
from tests.gateway._gateway_kit import LiveGateway, MakeGateway

#: save the key, make one model call with it, then wait for the test's go file
HARNESS = r"""
printf '%s' "$POLAR_API_KEY" > "$HOME/key.txt"
curl -sS --fail-with-body -X POST "$OPENAI_BASE_URL/chat/completions" -H "Authorization: Bearer $POLAR_API_KEY" \
     -H 'content-type: application/json' -d '{"model":"policy","messages":[{"role":"user","content":"hi"}]}' \
     > /dev/null || exit 7
while [ ! -e "$HOME/go" ]; do sleep 0.05; done
"""
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


async def until(probe, timeout: float = 60):  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not (got := await probe()):
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.05)
    return got


def files_holding(root: Path, secret: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


async def test_the_key_is_a_secret_that_dies_with_running(make_gateway: MakeGateway, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    gw: LiveGateway = await make_gateway()
    spec = gw.spec("secret-1", timeout=120)
    spec = spec.model_copy(update={"agent": AgentSpec(harness="shell", model_name="policy",
                                                      config={"command": HARNESS})})
    admin = {"x-admin-token": gw.admin}
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        created = await client.post("/sessions", json=spec.model_dump(mode="json"), headers=admin)
        assert created.status_code == 201, created.text
        home = gw.workdir / "secret-1" / created.json()["attempt_id"] / "sandbox" / "home"

        async def saved_key() -> str | None:
            path = home / "key.txt"
            return path.read_text() if path.exists() and path.stat().st_size else None

        key = await until(saved_key)
        assert key != "secret-1" and len(base64.urlsafe_b64decode(key + "=" * (-len(key) % 4))) >= 16
        own = {"authorization": f"Bearer {key}"}

        async def one_call() -> bool:
            got = await client.get("/sessions/secret-1/completions", headers=own)
            return got.status_code == 200 and len(got.json()["completions"]) == 1

        # RUNNING: the key serves model calls and reads the session's own captures, and nothing else's
        await until(one_call)
        assert (await client.get("/sessions/secret-1", headers=own)).status_code == 200
        assert (await client.get("/sessions/secret-1/trajectory", headers=own)).status_code == 200
        assert (await client.get("/sessions/other/completions", headers=own)).status_code == 401
        # the session id is not a key (it was, with 32 random bits, before issue 11)
        assert (await client.post("/v1/chat/completions", json=CHAT,
                                  headers={"authorization": "Bearer secret-1"})).status_code == 401

        (home / "go").touch()
        done = await client.get("/sessions/secret-1/result", params={"wait": 60}, headers=admin)
        assert done.status_code == 200 and done.json()["status"] == "COMPLETED", done.text

        # after RUNNING: a 401 in each caller's own protocol
        openai = await client.post("/v1/chat/completions", json=CHAT, headers=own)
        assert openai.status_code == 401
        assert openai.json()["error"]["type"] == "authentication_error"
        assert openai.json()["error"]["code"] == "invalid_api_key"
        anthropic = await client.post("/v1/messages", headers={"x-api-key": key},
                                      json={"model": "policy", "max_tokens": 5, "messages": CHAT["messages"]})
        assert anthropic.status_code == 401
        assert anthropic.json() == {"type": "error", "error": {"type": "authentication_error",
                                                               "message": anthropic.json()["error"]["message"]}}
        google = await client.post("/v1beta/models/policy:generateContent", headers={"x-goog-api-key": key},
                                   json={"contents": [{"role": "user", "parts": [{"text": "hi"}]}]})
        assert google.status_code == 401 and google.json()["error"]["status"] == "UNAUTHENTICATED"

        # ... and reading the session's captures, trajectory or status needs the admin token
        for path in ("/sessions/secret-1/completions", "/sessions/secret-1/trajectory", "/sessions/secret-1",
                     "/sessions/secret-1/result"):
            assert (await client.get(path, headers=own)).status_code == 401, path
            assert (await client.get(path, headers=admin)).status_code == 200, path

    # the key is in no result, artifact, journal or log line: only in the harness's own file under its HOME
    assert key not in done.text
    assert files_holding(gw.workdir, key) == [home / "key.txt"]
    assert files_holding(gw.service.journal.root, key) == []  # type: ignore[arg-type]
    assert not [r for r in caplog.records if key in r.getMessage()]
