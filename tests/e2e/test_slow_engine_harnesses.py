"""Real harness CLIs on a slow engine: a call that takes longer than the proxy's keepalive delay is streamed after
keepalive bytes, and every harness must read through them. Gemini CLI bundles a copy of the google-genai SDK that
reads a stream only while its buffer starts with ``data:`` (after whitespace): an SSE comment there left every event
unread, the call failed ("Incomplete JSON segment at the end") and Gemini CLI sent it again, forever on an engine
slower than the keepalive delay (seen on vLLM CPU: identical calls re-sent after each 16-20 s answer)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.harness.install import cli_paths, install_dir
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.chat import ChatRequest, ChatResult
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.schema import SessionStatus
from tests._serving import served_gateway
from tests.e2e.test_harnesses_e2e import HARNESSES, session_for

pytestmark = [pytest.mark.harness, pytest.mark.slow]


class SlowOracle(OracleEngine):
    """The oracle, answering each call only after ``delay`` seconds (a long generation on a real engine)."""

    def __init__(self, delay: float) -> None:
        super().__init__(HFChatTokenizer(tokenizer_dir()))
        self.delay = delay

    async def complete(self, request: ChatRequest, session_id: str) -> ChatResult:
        await asyncio.sleep(self.delay)
        return await super().complete(request, session_id)


async def test_real_harnesses_read_streams_that_start_with_keepalives(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None or not all(p.exists() for p in cli_paths(install_dir()).values()):
        pytest.fail("bubblewrap and the harness CLIs are needed: run `bash scripts/setup.sh`")
    # every streamed answer starts with keepalive bytes: the first after 0.05 s, the call takes 0.6 s
    service = ProxyService(SlowOracle(0.6), CaptureJournal(tmp_path / "capture"), SessionRegistry(allow_adhoc=False),
                           keepalive_after=0.05, keepalive_interval=0.2)
    specs = [session_for(harness) for harness in HARNESSES]
    async with served_gateway(service, tmp_path / "gateway", init_workers=3, ready_buffer=3, run_slots=6) as node:
        results = await asyncio.wait_for(node.run(specs), 600)
    failures = {}
    for spec, result in zip(specs, results, strict=True):
        records = await service.journal.records(spec.session_id)
        prompts = [len(r.normalized_request.get("messages") or []) for r in records if not r.side_request]
        if (result.status is not SessionStatus.COMPLETED or result.evaluation is None
                or result.evaluation.reward != 1.0 or len(prompts) != len(set(prompts))):
            failures[spec.agent.harness] = (result.status, result.reason, prompts)
    service.journal.close()
    assert failures == {}, "every harness solves the task, sending no call twice"
