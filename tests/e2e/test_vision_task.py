"""Issue 42, done-when 2 (its oracle half): the real pi CLI solves the multimodal demo task through the gateway with
the oracle engine. The task's answer is in an image (``card.png``, a colour swatch); the oracle reads it through
pi's own ``read`` tool, as a model looks at a file, and pi sends the PNG to the model as an image, which the proxy
checks and records by its SHA-256 before the oracle writes the answer the task's test accepts."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from polar_gym.schema import SessionStatus
from polar_gym.tasks import demo_task
from tests.e2e.test_harnesses_e2e import oracle_gateway, session_for

pytestmark = [pytest.mark.harness, pytest.mark.slow]


async def test_pi_reads_the_image_of_the_colour_card_task_and_solves_it(tmp_path: Path) -> None:
    task = demo_task("demo-colour-card")
    card = hashlib.sha256(task.binary_files["card.png"]).hexdigest()
    async with oracle_gateway(tmp_path) as (node, service):
        spec = session_for("pi", task.task_id)
        (result,) = await asyncio.wait_for(node.run([spec]), 300)
        records = await service.journal.records(spec.session_id)
    assert result.status is SessionStatus.COMPLETED and result.evaluation is not None, (result.status, result.reason)
    assert result.evaluation.reward == 1.0, result.evaluation.details
    calls = [[c["function"]["name"] for c in (r.response.get("message") or {}).get("tool_calls") or []]
             for r in records]
    assert calls[0] == ["read"]  # the oracle looked at the card first, through pi's own tool
    seen = [r for r in records if r.images]
    assert seen and all(image["sha256"] == card and image["media_type"] == "image/png"
                        for r in seen for image in r.images)
    assert seen[0].index == records[1].index  # the call after the read carries the image pi read
