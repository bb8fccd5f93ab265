"""The rollout server serves the viewer for a live run: under /view, with the admin token (header, or the HttpOnly
cookie that ``/view/?token=`` hands out) and never without it; rows come from its store, live sessions included."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from polar_gym.schema import SessionResult, SessionStatus, Trace, Trajectory
from polar_gym.server import RolloutServer, Store, create_server_app
from polar_gym.server.viewer import StoreViewSource
from tests._browser import chromium_or_skip, open_page
from tests.server._server_kit import SERVER_TOKEN, Harness, make_task


def _trace(n: int) -> Trace:
    return Trace(prompt_ids=list(range(100, 110)), response_ids=list(range(200, 200 + n)), loss_mask=[1] * n,
                 response_logprobs=[-0.5] * n, response_messages=[{"role": "assistant", "content": "<b>hi</b>"}],
                 metadata={"chain": 0, "chain_cause": "first",
                           "spans": [{"completion_id": "c0", "start": 0, "end": n, "engine": "oracle",
                                      "policy_version": 3}]})


async def _store_with_a_run(path: Path) -> Store:
    store = Store(path)
    task = make_task("t-view", 3)
    from polar_gym.server.tasks import expand

    specs = expand(task, 10, 2**30)
    assert await store.add_task(task, specs)
    ok = SessionResult(session_id=specs[0].session_id, task_id="t-view", status=SessionStatus.COMPLETED,
                       trajectory=Trajectory(session_id=specs[0].session_id, traces=[_trace(5), _trace(7)],
                                             diagnostics={"completions": 2}),
                       evaluation={"reward": 0.5}, timings={"total": 2.0},
                       metadata={"artifacts": {"call_log": [  # what the gateway ships (journal.call_log_entry)
                           {"completion_id": "c0", "index": 0, "engine": "oracle", "started_at": 100.0,
                            "upstream_seconds": 0.25, "total_seconds": 0.5, "prompt_tokens": 10,
                            "response_tokens": 5}]}})
    failed = SessionResult(session_id=specs[1].session_id, task_id="t-view", status=SessionStatus.ERROR,
                           reason="run: upstream_unreachable: refused",
                           metadata={"artifacts": {"error_cause": "upstream_unreachable"}})
    assert await store.finish(ok) and await store.finish(failed)
    return store


async def test_store_source_rows_and_sessions(tmp_path: Path) -> None:
    store = await _store_with_a_run(tmp_path / "db.sqlite")
    try:
        source = StoreViewSource(store)
        rows = {r["session_id"]: r for r in await source.rows()}
        assert len(rows) == 3
        done, failed, waiting = sorted(rows.values(), key=lambda r: r["session_id"])
        assert (done["status"], done["reward"], done["traces"], done["completions"]) == ("COMPLETED", 0.5, 2, 2)
        assert done["harness"].endswith(":CurlHarness") and done["seconds"] == 2.0
        assert (failed["status"], failed["error_cause"], failed["reward"]) == ("ERROR", "upstream_unreachable", None)
        assert waiting["status"] == "REGISTERED" and waiting["error_cause"] == "registered"
        assert len(await source.rows()) == 3  # read again: finished rows come from memory, nothing doubled
        data = await source.session(done["session_id"])
        assert data is not None and [len(t["response_ids"]) for t in data.traces] == [5, 7]
        # per-call timings from the call log the gateway shipped (the journal stays on the gateway)
        assert [(c["completion_id"], c["upstream_seconds"]) for c in data.calls] == [("c0", 0.25)]
        assert "call_log" not in data.row["metadata"]["artifacts"]
        assert await source.session("nope") is None
    finally:
        store.close()


async def test_viewer_routes_need_the_token(tmp_path: Path) -> None:
    store = await _store_with_a_run(tmp_path / "db.sqlite")
    app = create_server_app(RolloutServer(store), SERVER_TOKEN, manage_lifecycle=False)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as anon:
            for path in ("/view/", "/view/static/viewer.js", "/view/api/run", "/view/api/sessions"):
                assert (await anon.get(path)).status_code == 401, path
            assert (await anon.get("/view/?token=wrong")).status_code == 401
            guesses = {"polar_view": "guess", "polar_view_0": "guess"}
            assert (await anon.get("/view/api/sessions", cookies=guesses)).status_code == 401
            assert (await anon.get("/view/api/sessions", headers={"x-admin-token": "wrong"})).status_code == 401
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1",
                                     headers={"x-admin-token": SERVER_TOKEN}) as admin:
            rows = (await admin.get("/view/api/sessions")).json()
            assert rows["total"] == 3
            sid = next(r["session_id"] for r in rows["sessions"] if r["status"] == "COMPLETED")
            tokens = (await admin.get(f"/view/api/sessions/{sid}/traces/1/tokens")).json()
            assert tokens["mask"] == [0] * 10 + [1] * 7 and tokens["logprobs"][10:] == [-0.5] * 7
            assert (await admin.get("/view/api/sessions/..%2Fx")).status_code == 404
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as browser:
            login = await browser.get(f"/view/?token={SERVER_TOKEN}")
            assert login.status_code == 303 and login.headers["location"] == "/view/"
            cookie = login.headers["set-cookie"]
            assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower() and "Path=/view/;" in cookie
            assert SERVER_TOKEN not in cookie  # the cookie is a viewer secret, not the admin token
            page = await browser.get("/view/")  # the client keeps the cookie, as a browser does
            assert page.status_code == 200 and "viewer.js" in page.text
            assert page.headers["content-security-policy"].startswith("default-src 'none'")
            assert (await browser.get("/view/api/sessions")).json()["total"] == 3
            assert (await browser.get("/tasks")).status_code == 401  # the cookie opens the viewer only
    finally:
        store.close()


@pytest.mark.slow
async def test_live_server_serves_the_viewer(harness: Harness) -> None:
    """A real server and gateway: a finished task's sessions and their tokens, through the token."""
    gw = await harness.gateway()
    srv = await harness.server()
    await srv.register(gw, 2)
    task = make_task("t-live-view", 2)
    resp = await srv.http.post("/tasks", content=task.model_dump_json(), headers={"content-type": "application/json"})
    assert resp.status_code == 201
    early = (await srv.http.get("/view/api/sessions")).json()
    assert early["total"] == 2  # visible while running
    await srv.wait_task("t-live-view")
    rows = (await srv.http.get("/view/api/sessions?status=COMPLETED")).json()
    assert rows["matched"] == 2
    sid = rows["sessions"][0]["session_id"]
    result = (await srv.http.get(f"/sessions/{sid}/result")).json()
    payload = (await srv.http.get(f"/view/api/sessions/{sid}")).json()
    assert len(payload["traces"]) == len(result["trajectory"]["traces"]) > 0
    tokens = (await srv.http.get(f"/view/api/sessions/{sid}/traces/0/tokens")).json()
    trace = result["trajectory"]["traces"][0]
    assert tokens["ids"] == trace["prompt_ids"] + trace["response_ids"]
    assert tokens["mask"][tokens["prompt_len"]:] == trace["loss_mask"]
    async with httpx.AsyncClient(base_url=srv.url) as anon:
        assert (await anon.get("/view/")).status_code == 401
        assert (await anon.get(f"/view/api/sessions/{sid}")).status_code == 401
        assert (await anon.get(f"/view/?token={SERVER_TOKEN}")).status_code == 303
        assert (await anon.get("/view/")).status_code == 200
    await asyncio.to_thread(_browse_live, srv.url, sid, len(trace["prompt_ids"]) + len(trace["response_ids"]))


def _browse_live(url: str, session_id: str, n_tokens: int) -> None:
    """A browser opens ``/view/?token=`` once, lands on ``/view/`` with the cookie, and reads a session."""
    chromium_or_skip()
    with open_page(f"{url}/view/?token={SERVER_TOKEN}") as browser:
        page = browser.page
        assert page.url == f"{url}/view/"  # the token left the address bar
        page.wait_for_selector(f'#sessions tbody tr[data-session="{session_id}"]')
        page.click(f'#sessions tbody tr[data-session="{session_id}"]')
        page.wait_for_function("n => document.querySelectorAll('.trace[data-trace=\"0\"] .tokens .t').length === n",
                               arg=n_tokens)
        assert browser.problems == []


async def test_store_source_reads_finished_rows_in_short_pages(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """One result per store call, with every finish at the same instant: keyset pages still read each once."""
    import polar_gym.server.viewer as viewer

    monkeypatch.setattr(viewer, "_PAGE", 1)
    monkeypatch.setattr("polar_gym.server.store.time.time", lambda: 1_800_000_000.0)
    store = await _store_with_a_run(tmp_path / "db.sqlite")
    try:
        source = StoreViewSource(store)
        rows = await source.rows()
        assert sorted(r["status"] for r in rows) == ["COMPLETED", "ERROR", "REGISTERED"]
        assert len(await source.rows()) == 3
    finally:
        store.close()
