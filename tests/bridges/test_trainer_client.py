"""The plain Python client a trainer uses, against a real local fleet: submit tasks, iterate session results and
their traces as they finish, and receive each task once by callback."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.fleet import InferenceSettings, local_fleet
from polar_gym.gateway.config import GatewayPools
from polar_gym.schema import SessionStatus
from polar_gym.server.client import CallbackReceiver, RolloutClient, traces_of
from polar_gym.tasks import DEMO_TASKS


async def test_submit_iterate_trajectories_and_receive_callbacks(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None or not (tokenizer_dir() / ".complete").exists():
        pytest.fail("bubblewrap and the Qwen tokenizer are needed: run `bash scripts/setup.sh`")
    receiver = CallbackReceiver()
    async with (local_fleet(tmp_path, InferenceSettings(), pools=GatewayPools(run_slots=3)) as (url, token),
                receiver.serve(), RolloutClient(url, token) as client):
        tasks = [receiver.attach(DEMO_TASKS[d].to_request(harness="pi", model_name="policy", num_samples=n))
                 for d, n in (("demo-calc-add", 2), ("demo-slugify", 1))]
        submitted = await client.submit_all(tasks)
        assert [s["created"] for s in submitted] == [True, True]
        results = [r async for r in client.results([t.task_id for t in tasks])]
        bodies = {t.task_id: await receiver.wait_for(t.task_id, 60) for t in tasks}
    assert sorted((r.task_id, r.metadata["sample_index"]) for r in results) == [
        ("demo-calc-add", 0), ("demo-calc-add", 1), ("demo-slugify", 0)]
    assert len({r.session_id for r in results}) == 3  # each session once
    for result in results:
        assert result.status is SessionStatus.COMPLETED and result.evaluation and result.evaluation.reward == 1.0
        (trace,) = traces_of(result)
        assert len(trace.loss_mask) == len(trace.response_ids) == len(trace.response_logprobs) > 0
        assert trace.reward == 1.0
    assert {k: v["status"] for k, v in bodies.items()} == {"demo-calc-add": "COMPLETED", "demo-slugify": "COMPLETED"}
    assert sorted(r["session_id"] for b in bodies.values() for r in b["results"]) == sorted(r.session_id
                                                                                           for r in results)
    assert receiver.deliveries == 2 and receiver.received == {}  # each taken by wait_for
    assert all(t.callback_secret == receiver.secret for t in tasks) and not receiver.refused
