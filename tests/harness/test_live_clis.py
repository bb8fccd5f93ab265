"""The recorder of tests/data/harness (``scripts/record_harness_traffic.py``) run fresh: real pinned CLIs from npm run
unmodified against a live proxy, in a loopback-only network namespace; every run completes its task through the
oracle, and what each sends today still parses with no unknown fields, so a harness update that changes its traffic
shows. It records pi on the three protocols other than its default: the six CLIs on their own protocols (pi on
chat) run through a strict gateway in tests/e2e/test_harnesses_e2e.py, where an unknown field fails the call."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polar_gym.proxy.providers.base import Route
from polar_gym.registry import PROVIDERS

pytestmark = [pytest.mark.harness, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
#: pi's protocols but its default (chat): no other test runs a real CLI on these front ends' pi shapes
TARGETS = ("pi_anthropic_messages", "pi_openai_responses", "pi_google_generative_ai")


@pytest.fixture(scope="module")
def fresh_recording(tmp_path_factory) -> tuple[Path, dict]:
    if shutil.which("unshare") is None or shutil.which("npm") is None:
        pytest.fail("unshare and npm are needed: run `bash scripts/setup.sh`")
    out = tmp_path_factory.mktemp("harness")
    proc = subprocess.run([sys.executable, "scripts/record_harness_traffic.py", *TARGETS, "--out", str(out),
                           "--timeout", "180"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "runs.json").read_text())


def test_every_harness_completes_its_task(fresh_recording):
    _, runs = fresh_recording
    assert set(runs) == set(TARGETS)
    for target, run in runs.items():
        assert run["completed"] and run["exit_code"] == 0, (target, run["stderr_tail"])
        assert run["hello_txt"] == "hi", target  # the oracle's command ran through the harness's own tool
        assert run["calls"] >= 2 and all(c["status"] == "ok" for c in run["call_log"]), target


def test_what_they_send_today_has_no_unknown_fields(fresh_recording):
    out, _ = fresh_recording
    cases = sorted(out.glob("*/*.json"))
    assert {case.parent.name for case in cases} == set(TARGETS)
    for case_path in cases:
        case = json.loads(case_path.read_text())
        path, _, query = case["path"].partition("?")
        route = Route(path, query=dict(q.split("=", 1) for q in query.split("&") if "=" in q))
        if case["provider"] == "google":
            model, _, action = path.rpartition("/")[2].partition(":")
            route = Route(path, model=model, action=action, query=route.query)
        inbound = PROVIDERS.get(case["provider"])().parse(case["body"], route)
        assert inbound.ignored_fields == [], (case_path, inbound.ignored_fields)
