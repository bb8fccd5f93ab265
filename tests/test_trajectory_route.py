"""``GET /sessions/{sid}/trajectory?builder=NAME`` on a live proxy with the oracle engine: the trajectory built from
the session's own captures, readable with the session's key or the admin token only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from polar_gym.merge import check_contiguity, nemo_items
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.schema import CompletionSession, Trajectory
from tests._fakes import ByteTokenizer
from tests._serving import SCRIPT, RunningProxy, oracle_service, serve
from tests.merge._sessions import check_invariants

SID = "route-session"


def chat(url: str, key: str, messages: list[dict]) -> dict:
    resp = httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                      json={"model": "policy", "messages": messages}, timeout=30)
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]


def two_turns(proxy: RunningProxy) -> RunningProxy:
    """Two chat calls of one session (the second continues the first), and a call of another session."""
    messages = [{"role": "system", "content": "You are a coder."}, {"role": "user", "content": "Make out.txt"}]
    messages += [chat(proxy.url, SID, messages), {"role": "user", "content": "And now?"}]
    chat(proxy.url, SID, messages)
    chat(proxy.url, "someone-else", messages[:2])
    return proxy


@pytest.fixture
def two_calls(tmp_path: Path) -> Iterator[RunningProxy]:
    """The oracle without thinking blocks, so the byte tokenizer's template re-renders its replies exactly."""
    engine = OracleEngine(ByteTokenizer(), default_script=SCRIPT, think=False)
    for proxy in serve(oracle_service(tmp_path / "capture", engine=engine)):
        yield two_turns(proxy)


def get(proxy, builder: str | None = "prefix_merging", sid: str = SID, headers: dict | None = None,
        **params: str) -> httpx.Response:
    if builder is not None:
        params["builder"] = builder
    return httpx.get(f"{proxy.url}/sessions/{sid}/trajectory", params=params,
                     headers={"authorization": f"Bearer {sid}"} if headers is None else headers, timeout=30)


def captured(proxy: RunningProxy) -> CompletionSession:
    return CompletionSession.model_validate({"session_id": SID, "completions": proxy.completions(SID)})


def test_prefix_merging_gives_one_trace_with_both_completions(two_calls):
    resp = get(two_calls)
    assert resp.status_code == 200, resp.text
    traj = Trajectory.model_validate(resp.json())
    sess = captured(two_calls)
    (trace,) = traj.traces
    assert traj.builder == "prefix_merging" and traj.session_id == SID
    assert trace.metadata["completion_ids"] == [r.completion_id for r in sess.completions]
    assert traj.diagnostics["completions_merged"] == 1 and traj.diagnostics["breaks"] == {}
    assert 0 in trace.loss_mask  # the user turn between the two replies is not trained
    check_invariants(sess, traj)
    check_contiguity(nemo_items(trace))
    assert get(two_calls, builder=None).json()["builder"] == "prefix_merging"  # the default


def test_per_request_gives_two_traces(two_calls):
    traj = Trajectory.model_validate(get(two_calls, "per_request").json())
    assert [t.metadata["completion_ids"] for t in traj.traces] == [[r.completion_id] for r in
                                                                   captured(two_calls).completions]
    assert all(set(t.loss_mask) == {1} for t in traj.traces)


def test_only_the_session_key_or_the_admin_token_reads_it(two_calls):
    assert get(two_calls, headers={"authorization": "Bearer someone-else"}).status_code == 401
    assert get(two_calls, headers={}).status_code == 401
    assert get(two_calls, headers={"x-admin-token": "wrong"}).status_code == 401
    admin = get(two_calls, headers={"x-admin-token": two_calls.admin_token})
    assert admin.status_code == 200 and len(admin.json()["traces"]) == 1


def test_unknown_builder_is_a_400_with_the_known_names(two_calls):
    resp = get(two_calls, "nope")
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert "unknown builder 'nope'" in message and "per_request" in message and "prefix_merging" in message
    # a dotted path would make the proxy import code named by the caller: refused like any unknown name
    assert get(two_calls, "polar_gym.merge.per_request:per_request").status_code == 400


def test_builder_config_and_an_unused_session(two_calls):
    assert get(two_calls, config=json.dumps({"on_rerender": "merge"})).status_code == 200
    bad = get(two_calls, config=json.dumps({"eot": [1]}))
    assert bad.status_code == 400 and "unknown builder config keys" in bad.json()["error"]["message"]
    assert get(two_calls, config="[1]").status_code == 400
    empty = get(two_calls, sid="never-called")
    assert empty.status_code == 200 and empty.json()["traces"] == []


def test_thinking_replies_re_render_exactly_and_merge(proxy_server):
    """The default oracle thinks; its replies come back in the next prompt token for token, so one chain."""
    two_turns(proxy_server)
    traj = Trajectory.model_validate(get(proxy_server).json())
    assert len(traj.traces) == 1 and traj.diagnostics["breaks"] == {}
    check_invariants(captured(proxy_server), traj)


def test_format_atif_gives_the_session_as_one_atif_document(two_calls):
    import atif

    resp = get(two_calls, format="atif")
    assert resp.status_code == 200, resp.text
    doc = atif.Trajectory.model_validate(resp.json())
    sess = captured(two_calls)
    assert doc.session_id == SID and doc.agent.model_name == "policy" and doc.subagent_trajectories is None
    assert [s.source for s in doc.steps] == ["system", "user", "agent", "user", "agent"]
    sampled = [s.metrics for s in doc.steps if s.metrics is not None]
    assert [m.completion_token_ids for m in sampled] == [r.response_ids for r in sess.completions]
    assert [m.prompt_token_ids for m in sampled] == [r.prompt_ids for r in sess.completions]
    assert [m.logprobs for m in sampled] == [r.response_logprobs for r in sess.completions]
    assert get(two_calls, format="nope").status_code in (400, 422)
    assert get(two_calls, headers={}, format="atif").status_code == 401
