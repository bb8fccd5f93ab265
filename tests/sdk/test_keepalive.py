"""A slow engine call under a streaming request: the proxy starts the stream with SSE comments so the harness's idle
timer does not fire; official SDKs ignore them and read the answer. A late failure arrives as the provider's own
in-stream error event, and the failed call is still journaled."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from polar_gym.proxy.chat import ChatRequest, ChatResult
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.errors import UpstreamUnavailable
from tests._fakes import ByteTokenizer
from tests._serving import SCRIPT, oracle_service, serve
from tests._waiting import until_sync
from tests.sdk._sdk_kit import closing

pytestmark = pytest.mark.sdk


class SlowOracle(OracleEngine):
    def __init__(self, delay: float, fail: bool = False) -> None:
        super().__init__(ByteTokenizer(), default_script=SCRIPT)
        self.delay, self.fail = delay, fail

    async def complete(self, request: ChatRequest, session_id: str) -> ChatResult:
        await asyncio.sleep(self.delay)
        if self.fail:
            raise UpstreamUnavailable("engine went away mid-generation")
        return await super().complete(request, session_id)


@pytest.fixture
def slow_proxy(tmp_path: Path, request):
    engine = SlowOracle(0.5, fail=getattr(request, "param", False))
    service = oracle_service(tmp_path, engine=engine, keepalive_after=0.05, keepalive_interval=0.1)
    yield from serve(service)


def test_raw_stream_starts_with_keepalive_comments(slow_proxy):
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", slow_proxy.url + "/v1/chat/completions", json=body,
                      headers={"authorization": "Bearer ka"}) as resp:
        text = b"".join(resp.iter_raw()).decode()
    assert resp.status_code == 200
    assert text.startswith(": keepalive\n\n") and text.rstrip().endswith("data: [DONE]")


def test_sdks_read_through_keepalives(slow_proxy):
    chat = closing(openai.OpenAI(base_url=slow_proxy.url + "/v1", api_key="ka-openai", max_retries=0))
    chunks = list(chat.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                               stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == SCRIPT.final_answer
    claude = closing(anthropic.Anthropic(base_url=slow_proxy.url, api_key="ka-anthropic", max_retries=0))
    with claude.messages.stream(model="policy", max_tokens=100,
                                messages=[{"role": "user", "content": "hi"}]) as stream:
        message = stream.get_final_message()
    assert message.content[-1].text == SCRIPT.final_answer


@pytest.mark.parametrize("slow_proxy", [True], indirect=True)
def test_late_failure_is_an_in_stream_error(slow_proxy):
    chat = closing(openai.OpenAI(base_url=slow_proxy.url + "/v1", api_key="ka-fail", max_retries=0))
    with pytest.raises(openai.APIError, match="went away"):
        list(chat.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                          stream=True))
    claude = closing(anthropic.Anthropic(base_url=slow_proxy.url, api_key="ka-fail", max_retries=0))
    with pytest.raises(anthropic.APIError, match="went away"):
        with claude.messages.stream(model="policy", max_tokens=100,
                                    messages=[{"role": "user", "content": "hi"}]) as stream:
            stream.get_final_message()
    records = slow_proxy.completions("ka-fail")
    assert [r["status"] for r in records] == ["error", "error"]


def test_a_harness_that_hangs_up_mid_stream_is_journaled_as_not_delivered(slow_proxy):
    """The harness gives up while the engine still runs (its timeout): the call is journaled when it finishes, with
    ``delivered`` false, so a builder never reads a later call as going on from an answer the harness never got."""
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", slow_proxy.url + "/v1/chat/completions", json=body,
                      headers={"authorization": "Bearer gone"}) as resp:
        assert next(resp.iter_raw()).startswith(b": keepalive")  # the call is in flight; hang up now
    until_sync(lambda: slow_proxy.completions("gone"), what="the abandoned call to be journaled")
    with httpx.stream("POST", slow_proxy.url + "/v1/chat/completions", json=body,
                      headers={"authorization": "Bearer gone"}) as resp:
        assert b"".join(resp.iter_raw()).rstrip().endswith(b"data: [DONE]")
    until_sync(lambda: len(slow_proxy.completions("gone")) == 2, what="the answered call to be journaled")
    assert [(r["status"], r["delivered"]) for r in slow_proxy.completions("gone")] == [("ok", False), ("ok", True)]


def test_a_harness_that_hangs_up_on_a_whole_answer_is_journaled_as_not_delivered(slow_proxy):
    """The same for an answer sent whole: the proxy reads the hang-up from the connection before it answers."""
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(httpx.ReadTimeout):  # gives up well before the engine's 0.5 s: the connection is closed
        httpx.post(slow_proxy.url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer cut"},
                   timeout=httpx.Timeout(30, read=0.05))
    until_sync(lambda: slow_proxy.completions("cut"), what="the abandoned call to be journaled")
    answered = httpx.post(slow_proxy.url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer cut"},
                          timeout=30)
    assert answered.status_code == 200
    until_sync(lambda: len(slow_proxy.completions("cut")) == 2, what="the answered call to be journaled")
    assert [(r["status"], r["delivered"]) for r in slow_proxy.completions("cut")] == [("ok", False), ("ok", True)]
