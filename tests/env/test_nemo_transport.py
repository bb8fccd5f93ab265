"""polar_gym's journal as a NeMo Gym 0.7 token-capture transport, in Gym's own interpreter (the venv set-up
builds): Gym's conformance suite through ``python -m polar_gym.env conformance`` (passing, and failing by name on
broken transports), proxy-journaled sessions frozen as every chain with verified parent links (Gym's own builder
would deliver one), and the agent's delivery of a ``/nemo`` payload through the sink."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from polar_gym.merge.nemo_payload import session_nemo_payload
from tests._serving import RunningProxy
from tests.env._capture_kit import TOOLS, anthropic_loop, captured, gym_side, main_sub_and_retry
from tests.env._env_kit import gym_venv_or_skip, two_chain_result

CHECKS = ["put_then_freeze_visibility", "idempotent_reput", "conflicting_reput", "mark_incomplete_durability",
          "freeze_idempotency", "post_freeze_write_safety", "conditional_retirement", "lineage_visibility",
          "fresh_client_lineage_visibility"]


@pytest.fixture(scope="module")
def gym_python() -> Path:
    return gym_venv_or_skip() / "bin" / "python"


def conformance(gym_python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "polar_gym.env", "conformance", "--gym-python", str(gym_python),
                           *args], capture_output=True, text=True, timeout=300)


def test_gyms_conformance_suite_passes_with_lineage_checks(gym_python: Path) -> None:
    done = conformance(gym_python)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [f"passed {name}" for name in CHECKS] + [f"all {len(CHECKS)} checks passed"]


@pytest.mark.parametrize(("store", "failed"), [("VersionlessStore", "mark_incomplete_durability"),
                                               ("NoConflictStore", "conflicting_reput")])
def test_a_broken_transport_fails_and_names_the_check(gym_python: Path, store: str, failed: str) -> None:
    done = conformance(gym_python, "--transport", f"tests.env._broken_transport:{store}")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    before = CHECKS[:CHECKS.index(failed)]
    assert lines[:-1] == [f"passed {name}" for name in before]
    assert lines[-1].startswith(f"FAILED {failed}: ")


def test_no_gym_interpreter_is_a_usage_error(tmp_path: Path) -> None:
    done = conformance(tmp_path / "missing-python")
    assert done.returncode == 2 and "python -m polar_gym.assets nemo_gym" in done.stderr


def test_a_proxy_journal_freezes_as_every_chain_where_gyms_builder_delivers_one(proxy: RunningProxy, capture: Path,
                                                                                 gym_python: Path) -> None:
    main_sub_and_retry(proxy, "main-sub-retry")
    records = captured(capture, "main-sub-retry")
    got = gym_side(gym_python, capture, "main-sub-retry")
    entries = got["entries"]
    assert [e["call"] for e in entries] == [r.completion_id for r in records] and not got["incomplete"]
    assert all(e["link_verified"] for e in entries) and all(e["items"] == 1 for e in entries)
    main1, sub1, lost, main2, sub2, main3, compacted = entries
    assert [main1["resolution"], sub1["resolution"], compacted["resolution"]] == ["root"] * 3
    assert [main2["parent"], main3["parent"], sub2["parent"], lost["parent"]] == \
        [main1["call"], main2["call"], sub1["call"], main1["call"]]
    assert lost["parent_chain"] == main1["chain"] and len({e["chain"] for e in entries}) == 4
    # every chain, contiguous (NeMo RL's rule): main (3 calls), sub-agent (2), the retry's lost answer and the
    # post-compaction context (1 each)
    assert sorted(got["every_chain_items"]) == [1, 1, 2, 3] and got["every_chain_items"][0] == 3
    assert all(got["every_chain_contiguous"])
    # Gym's own builder on the same snapshot: it verifies every link, then delivers the main chain only
    assert got["gym_link_failures"] == {} and got["gym_main_generation_items"] == 3
    assert got["gym_delivered_fraction"] < 0.6 and got["gym_quarantined"] == [lost["call"]]
    # request-time lineage: each call's own request resolves to its parent (or to a call with the same tokens)
    digest = {e["call"]: e["digest"] for e in entries}
    for entry in entries:
        status, match = got["request_time"][entry["call"]]
        assert status == entry["resolution"]
        assert (match and digest[match]) == (entry["parent"] and digest[entry["parent"]])


def test_a_call_the_proxy_journals_after_a_freeze_stales_that_snapshot(proxy: RunningProxy, capture: Path,
                                                                       gym_python: Path) -> None:
    """The proxy does not take the transport's lock: a record it appends after a freeze (the session still running)
    moves the version, so the consumer's retirement of the older snapshot fails and nothing is lost."""
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="still-running", max_retries=0)
    conv = [{"role": "user", "content": "Fix calc.py."}]
    client.chat.completions.create(model="policy", messages=conv, tools=TOOLS)
    first = gym_side(gym_python, capture, "still-running")
    assert gym_side(gym_python, capture, "still-running")["version"] == first["version"]  # idempotent
    client.chat.completions.create(model="policy", messages=conv + [{"role": "user", "content": "Again."}], tools=TOOLS)
    stale = gym_side(gym_python, capture, "still-running", "drop", first["snapshot_id"], str(first["version"]))
    assert stale == {"dropped": False}
    second = gym_side(gym_python, capture, "still-running")
    assert len(second["entries"]) == 2 and second["version"] > first["version"]
    assert gym_side(gym_python, capture, "still-running", "drop", second["snapshot_id"],
                    str(second["version"])) == {"dropped": True}


def test_a_journal_in_another_dialect_freezes_the_same_way(proxy: RunningProxy, capture: Path,
                                                           gym_python: Path) -> None:
    turns = anthropic_loop(proxy, "anthropic-loop")
    got = gym_side(gym_python, capture, "anthropic-loop")
    assert len(got["entries"]) == turns and got["every_chain_items"] == [turns] and got["gym_chains"] == 1
    assert all(e["link_verified"] for e in got["entries"]) and got["gym_delivered_fraction"] == 1.0
    # the harness's own tool-use ids are not in the chat-form record: request-time lookup stays unresolved (safe)
    assert {status for status, _ in got["request_time"].values()} <= {"root", "unresolved"}


@pytest.mark.parametrize("status", ["COMPLETED", "TIMEOUT"])
def test_the_agents_delivery_puts_every_chain_once(tmp_path: Path, gym_python: Path, status: str) -> None:
    payload = tmp_path / "payload.json"
    payload.write_text(json.dumps({**session_nemo_payload(two_chain_result()), "status": status}))
    delivered = gym_side(gym_python, tmp_path / "sink", "rollout-7", "deliver", str(payload))
    assert delivered == {"polar_token_rollout_id": "rollout-7", "polar_token_entries": "3", "polar_token_chains": "2"}
    got = gym_side(gym_python, tmp_path / "sink", "rollout-7")  # a fresh process: what put made durable
    assert len(got["entries"]) == 3 and got["every_chain_items"] == [2, 1] and all(got["every_chain_contiguous"])
    assert got["gym_chains"] == 2 and got["gym_main_generation_items"] == 2
    assert {e["cause"] for e in got["entries"]} == {None, "subagent"}
    assert got["incomplete"] == (status != "COMPLETED")  # a consumer masks a session that did not complete


def test_gym_builds_the_transport_from_the_documented_token_id_capture_block(tmp_path: Path, gym_python: Path) -> None:
    got = gym_side(gym_python, tmp_path / "shared", "rollout-1", "wiring")
    assert got == {"sink": "PolarTokenSink", "resolver": "PolarLineageResolver", "resolved": "resolved",
                   "frozen": ["call-1"], "delta_frozen": [False, True], "delta_chains_refused": True}
