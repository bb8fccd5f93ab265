"""The viewer's API over a run's folder written by hand (tests/view/_view_kit.py): filters, one session's payload and
token arrays against trajectories.jsonl, per-call timings from the capture journal, security headers, refusals."""

from __future__ import annotations

import contextlib
import http.cookiejar
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from polar_gym.view import SECURITY_HEADERS, OutDirSource, create_view_app, find_tokenizer
from polar_gym.view.model import RowFilter, filter_rows, session_row
from tests.view._view_kit import HOSTILE, PNG_URL, make_session, running_viewer, with_images, write_run


@pytest.fixture
def run(tmp_path: Path) -> Path:
    sessions = [
        make_session("s-a0", "calc", chains=2, turns=5, reward=1.0),
        make_session("s-a1", "calc", reward=0.0, harness="codex", seed=1),
        make_session("s-b0", "slugify", reward=0.5, seed=2),
        make_session("s-err", "slugify", status="ERROR", reward=None, error_cause="upstream_unreachable",
                     content="upstream_unreachable: refused", seed=3),
        make_session("s-evil", "evil", content=HOSTILE, seed=4),
    ]
    return write_run(tmp_path / "run", sessions)


@pytest.fixture
def client(run: Path) -> TestClient:
    return TestClient(create_view_app(OutDirSource(run, decode=False)), base_url="http://127.0.0.1")


def _ids(answer: dict[str, Any]) -> set[str]:
    return {row["session_id"] for row in answer["sessions"]}


@pytest.mark.parametrize(("query", "expected"), [
    ("", {"s-a0", "s-a1", "s-b0", "s-err", "s-evil"}),
    ("status=ERROR", {"s-err"}),
    ("task=calc", {"s-a0", "s-a1"}),
    ("task=slug&status=COMPLETED", {"s-b0"}),
    ("harness=codex", {"s-a1"}),
    ("cause=upstream_unreachable", {"s-err"}),
    ("cause=none", {"s-a0", "s-a1", "s-b0", "s-evil"}),
    ("reward=0.5", {"s-b0"}),
    ("reward_min=0.5", {"s-a0", "s-b0", "s-evil"}),
    ("reward_min=0.1&reward_max=0.9", {"s-b0"}),
    ("reward_max=0", {"s-a1"}),
])
def test_filters(client: TestClient, query: str, expected: set[str]) -> None:
    answer = client.get(f"/view/api/sessions?{query}").json()
    assert _ids(answer) == expected
    assert answer["total"] == 5 and answer["matched"] == len(expected)
    assert answer["options"]["status"] == ["COMPLETED", "ERROR"]
    assert answer["options"]["error_cause"] == ["none", "upstream_unreachable"]


def test_rows_carry_counts_and_cause(client: TestClient) -> None:
    rows = {r["session_id"]: r for r in client.get("/view/api/sessions").json()["sessions"]}
    assert rows["s-a0"]["traces"] == 2 and rows["s-a0"]["completions"] == 5
    assert rows["s-err"]["error_cause"] == "upstream_unreachable" and rows["s-err"]["reward"] is None
    assert rows["s-err"]["reason"] == "run: upstream_unreachable: refused"


def test_paging_is_bounded(client: TestClient) -> None:
    answer = client.get("/view/api/sessions?limit=2&offset=1").json()
    assert len(answer["sessions"]) == 2 and answer["matched"] == 5 and answer["offset"] == 1
    assert client.get("/view/api/sessions?limit=100000").status_code == 422


def test_session_payload_and_tokens_match_trajectories(client: TestClient, run: Path) -> None:
    lines = [json.loads(x) for x in (run / "trajectories.jsonl").read_text().splitlines()]
    traces = [t for t in lines if t["session_id"] == "s-a0"]
    payload = client.get("/view/api/sessions/s-a0").json()
    assert [t["chain"] for t in payload["traces"]] == [0, 1]
    assert [t["chain_cause"] for t in payload["traces"]] == ["first", "drift"]
    assert payload["diagnostics"]["breaks"] == {"drift": 1}
    assert [t["prompt_messages"] for t in payload["traces"]] == [2, 2]  # counts: the messages come per trace
    prompt = client.get("/view/api/sessions/s-a0/traces/1/prompt").json()
    assert prompt["prompt_messages"] == traces[1]["prompt_messages"]
    for i, trace in enumerate(traces):
        tokens = client.get(f"/view/api/sessions/s-a0/traces/{i}/tokens").json()
        n_prompt, n_resp = len(trace["prompt_ids"]), len(trace["response_ids"])
        assert tokens["prompt_len"] == n_prompt
        assert tokens["ids"] == trace["prompt_ids"] + trace["response_ids"]
        assert len(tokens["ids"]) == len(tokens["mask"]) == len(tokens["logprobs"]) == n_prompt + n_resp
        assert tokens["mask"] == [0] * n_prompt + trace["loss_mask"]
        assert tokens["logprobs"][n_prompt:] == [x["logprob"] for x in trace["response_logprobs"]]
        assert tokens["vocab"] is None  # decode=False: the page shows ids
    # per-call rows: the journal's timings joined with the spans that hold each call's tokens
    calls = payload["calls"]
    assert len(calls) == 5 and [c["index"] for c in calls] == [0, 1, 2, 3, 4]
    assert [c["trace"] for c in calls] == [0, 0, 0, 1, 1]
    assert [c["policy_version"] for c in calls] == [0, 0, 0, 1, 1]
    assert calls[1]["offset_seconds"] == 1.0 and calls[1]["upstream_seconds"] == 0.02
    assert calls[0]["span"] == [0, 40] and calls[0]["engine"] == "oracle"
    assert calls[0]["response_tokens"] == 40 and calls[0]["prompt_tokens"] == 60
    assert calls[1]["prompt_tokens"] == 60 + 40 + 40  # the journal shares the prompt prefix: counted, not rebuilt


def test_calls_without_a_journal_come_from_the_spans(client: TestClient, run: Path) -> None:
    import shutil

    shutil.rmtree(run / "capture" / "s-a1")
    calls = client.get("/view/api/sessions/s-a1").json()["calls"]
    assert len(calls) == 3 and all(c["upstream_seconds"] is None and c["engine"] == "oracle" for c in calls)


def test_calls_shipped_with_the_result_stand_in_for_a_journal_left_on_a_node(run: Path) -> None:
    """Node-local scratch: the journal stays on the gateway's node, and the call log the gateway shipped with the
    result (calls.jsonl, one entry per record: polar_gym.journal.call_log_entry) gives the same per-call rows."""
    import shutil

    from polar_gym.journal import call_log_entry
    from tests.view._view_kit import make_session

    client = TestClient(create_view_app(OutDirSource(run, decode=False)), base_url="http://127.0.0.1")
    from_journal = client.get("/view/api/sessions/s-a0").json()["calls"]
    records = make_session("s-a0", "calc", chains=2, turns=5, reward=1.0).records
    shutil.rmtree(run / "capture")
    (run / "calls.jsonl").write_text(json.dumps({"session_id": "s-a0", "calls": [call_log_entry(r) for r in records]})
                                     + "\n" + json.dumps({"session_id": "other", "calls": []}) + "\n")
    shipped = client.get("/view/api/sessions/s-a0").json()["calls"]
    assert shipped == from_journal and shipped[1]["upstream_seconds"] == 0.02
    entry = call_log_entry(records[0].model_copy(update={"error": "x" * 5000}))
    assert not {"request", "response", "prompt_ids", "response_ids", "response_logprobs"} & set(entry)
    assert entry["prompt_tokens"] == 60 and len(entry["error"]) < 2100


def test_hostile_content_is_data(client: TestClient) -> None:
    payload = client.get("/view/api/sessions/s-evil").json()
    assert payload["traces"][0]["response_messages"][-1]["content"] == HOSTILE


@pytest.mark.parametrize("path", [
    "/view/api/sessions/nope", "/view/api/sessions/..%2F..%2Fetc%2Fpasswd", "/view/api/sessions/..",
    "/view/api/sessions/%2E%2E", "/view/api/sessions/s-a0/traces/7/tokens", "/view/api/sessions/s-a0/traces/-1/tokens",
    "/view/api/sessions/s-a0/traces/2/prompt",
    "/view/static/..%2Fmodel.py", "/view/static/index.html", "/view/api/sessions/.hidden",
])
def test_unknown_and_traversal_ids_are_404(client: TestClient, path: str) -> None:
    resp = client.get(path)
    assert resp.status_code == 404, (path, resp.text)
    assert resp.headers["content-security-policy"] == SECURITY_HEADERS["Content-Security-Policy"]


def test_an_id_that_names_a_path_is_refused_even_if_the_run_lists_it(tmp_path: Path) -> None:
    """A results.jsonl is data too: an id like ``../x`` never becomes a path, whatever the file says."""
    evil = make_session("../../outside", "t")
    run = write_run(tmp_path / "run", [make_session("ok", "t")])
    (run / "results.jsonl").write_text((run / "results.jsonl").read_text() + json.dumps(evil.result) + "\n")
    client = TestClient(create_view_app(run), base_url="http://127.0.0.1")
    assert client.get("/view/api/sessions/..%2F..%2Foutside").status_code == 404
    assert client.get("/view/api/sessions/ok").status_code == 200


def test_page_and_assets_carry_the_security_headers(client: TestClient) -> None:
    for path, kind in [("/view/", "text/html"), ("/view/static/viewer.js", "text/javascript"),
                       ("/view/static/viewer.css", "text/css"), ("/view/api/run", "application/json")]:
        resp = client.get(path)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith(kind)
        for name, value in SECURITY_HEADERS.items():
            assert resp.headers[name] == value
    csp = SECURITY_HEADERS["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "default-src 'none'" in csp
    page = client.get("/view/").text
    assert "<script>" not in page and 'src="static/viewer.js"' in page  # no inline script
    assert client.get("/", follow_redirects=False).headers["location"] == "/view/"


def test_a_foreign_host_header_is_refused(run: Path) -> None:
    """DNS re-binding: a page of another site resolving its name to 127.0.0.1 gets nothing."""
    client = TestClient(create_view_app(run), base_url="http://attacker.example")
    assert client.get("/view/api/sessions").status_code == 400
    assert TestClient(create_view_app(run), base_url="http://localhost:8765").get("/view/").status_code == 200


def test_no_method_but_get_and_no_body(client: TestClient) -> None:
    assert client.post("/view/api/sessions", content=b"x").status_code in (405, 413)


def test_tokens_are_decoded_with_the_run_tokenizer(run: Path) -> None:
    if find_tokenizer(None) is None:
        pytest.skip("the cached Qwen tokenizer is not built (scripts/setup.sh builds it)")
    client = TestClient(create_view_app(OutDirSource(run)), base_url="http://127.0.0.1")
    assert client.get("/view/api/run").json()["tokenizer"]
    tokens = client.get("/view/api/sessions/s-b0/traces/0/tokens").json()
    assert set(tokens["vocab"]) == {str(i) for i in tokens["ids"]}
    assert all(isinstance(v, str) and v for v in tokens["vocab"].values())


def test_reread_when_the_run_grows(run: Path, client: TestClient) -> None:
    assert client.get("/view/api/sessions").json()["total"] == 5
    write_run(run, [make_session("s-new", "later", seed=9)])  # a new results.jsonl (launch rewrites it)
    assert _ids(client.get("/view/api/sessions").json()) == {"s-new"}
    assert client.get("/view/api/sessions/s-new/traces/0/tokens").status_code == 200


def test_row_filter_units() -> None:
    rows = [session_row(make_session(f"s{i}", reward=r).result) for i, r in enumerate([0.0, 0.25, 1.0, None])]
    assert [r["session_id"] for r in filter_rows(rows, RowFilter(reward_min=0.2))["sessions"]] == ["s1", "s2"]
    assert filter_rows(rows, RowFilter())["matched"] == 4
    assert filter_rows(rows, RowFilter(reward=1.0))["matched"] == 1


def test_with_a_token_every_route_needs_it_or_the_cookie_it_hands_out(run: Path) -> None:
    """A shared login node: other users reach the loopback port too, so the standalone viewer takes a token."""
    client = TestClient(create_view_app(run, token="s3cret"), base_url="http://127.0.0.1")
    for path in ("/view/", "/view/api/run", "/view/api/sessions", "/view/api/sessions/s-a0",
                 "/view/static/viewer.js", "/view/api/sessions/s-a0/traces/0/tokens"):
        refused = client.get(path)
        assert refused.status_code == 401 and "token" in refused.json()["error"]["message"], path
        assert refused.headers["content-security-policy"] == SECURITY_HEADERS["Content-Security-Policy"]
    assert client.get("/view/?token=wrong", follow_redirects=False).status_code == 401
    assert client.get("/view/api/run", headers={"x-admin-token": "s3cret"}).status_code == 200
    login = client.get("/view/?token=s3cret", follow_redirects=False)
    assert login.status_code == 303 and login.headers["location"] == "/view/"
    (name, cookie), = login.cookies.items()
    assert name.startswith("polar_view_") and cookie and "s3cret" not in cookie
    assert "httponly" in login.headers["set-cookie"].lower()
    assert client.get("/view/api/sessions/s-a0").status_code == 200  # the client keeps the cookie


def _status(url: str, headers: dict[str, str] | None = None) -> int:
    """GET as a browser would: cookies kept across the redirect."""
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_viewer_process_prints_a_url_with_a_fresh_token(run: Path, tmp_path: Path) -> None:
    """``python -m polar_gym.view OUT_DIR`` as a user starts it: the printed URL opens the page; the same port
    without the token answers 401; each start makes a new token; --token-file and --no-token as documented."""
    tokens = []
    for _ in range(2):
        with running_viewer(run) as (url, _):
            base, _, query = url.partition("?")
            token = urllib.parse.parse_qs(query)["token"][0]
            assert len(token) >= 24
            tokens.append(token)
            assert _status(url) == 200  # the redirect carries the cookie back to the page
            assert _status(base + "api/sessions") == 401
            assert _status(base + "api/sessions", {"x-admin-token": token}) == 200
    assert tokens[0] != tokens[1]
    token_file = tmp_path / "viewer.token"
    token_file.write_text("chosen-token\n")
    with running_viewer(run, "--token-file", str(token_file)) as (url, _):
        assert url.endswith("?token=chosen-token") and _status(url) == 200
    with running_viewer(run, "--no-token") as (url, _):
        assert "token" not in url and _status(url + "api/sessions") == 200
        port = urllib.parse.urlsplit(url).port
        log = (run.parent / f"viewer-{port}.log").read_text()
        assert "with no token: every user on this machine can read the run" in log


def _browser(jar: http.cookiejar.CookieJar | None = None) -> urllib.request.OpenerDirector:
    """One cookie jar for every port of 127.0.0.1, as a browser keeps them (a cookie carries no port)."""
    jar = jar if jar is not None else http.cookiejar.CookieJar()
    return urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))


def _get(opener: urllib.request.OpenerDirector, url: str, headers: dict[str, str] | None = None) -> int:
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_each_viewer_keeps_its_own_cookie_and_refuses_another_origin(run: Path) -> None:
    """Issue 35: the cookie went to another local port (a browser sends a host's cookies to all its ports) and a
    second viewer's login replaced the first's. Now each instance names its own cookie (Path=/view/, HttpOnly,
    SameSite=Strict), and a request another origin made (another port's page) is 403 even with the cookie."""
    jar = http.cookiejar.CookieJar()
    browser = _browser(jar)
    with running_viewer(run) as (url_a, _), running_viewer(run) as (url_b, _):
        base_a, base_b = url_a.partition("?")[0], url_b.partition("?")[0]
        other = f"http://127.0.0.1:{urllib.parse.urlsplit(url_b).port}"
        assert _get(browser, url_a) == 200 and _get(browser, url_b) == 200  # log into both, one jar
        assert _get(browser, base_a + "api/sessions") == 200  # B's login did not replace A's cookie
        assert _get(browser, base_b + "api/sessions") == 200
        names = [c.name for c in jar]
        assert len(set(names)) == 2 and all(n.startswith("polar_view_") for n in names)
        assert all(c.path == "/view/" for c in jar)
        for foreign in ({"Origin": other}, {"Origin": "null"}, {"Referer": other + "/view/"},
                        {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "cors"}):
            for path in ("api/sessions", "api/run", "static/viewer.js", "api/sessions/s-a0"):
                assert _get(browser, base_a + path, foreign) == 403, (path, foreign)
        assert _get(browser, base_a + "api/sessions", {"Origin": base_a.rsplit("/view/", 1)[0]}) == 200
        # a link from another page to the viewer's page opens it (the answer goes to the user's window)
        assert _get(browser, base_a, {"Referer": other + "/", "Sec-Fetch-Site": "same-site",
                                      "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}) == 200
        assert _get(browser, base_a, {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "no-cors",
                                      "Sec-Fetch-Dest": "script"}) == 403


def test_a_second_viewer_picks_a_free_port_and_a_taken_port_is_one_line(run: Path) -> None:
    """Issue 35: the fixed port 8765 made a second viewer die with uvicorn's traceback. Without --port the viewer
    takes 8765 when free, else any free port; a --port that is taken is one line naming it, exit 2."""
    with contextlib.ExitStack() as stack:
        held = stack.enter_context(socket.socket())
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        with contextlib.suppress(OSError):  # hold 8765 too, unless someone already does
            default = stack.enter_context(socket.socket())
            default.bind(("127.0.0.1", 8765))
            default.listen()
        refused = subprocess.run([sys.executable, "-m", "polar_gym.view", str(run), "--port", str(taken)],
                                 capture_output=True, text=True, timeout=120, check=False)
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert refused.stderr.strip().splitlines() == [
            f"error: port {taken} on 127.0.0.1 is taken (another viewer?): give another --port, or leave --port "
            "out to pick a free one"]
        with running_viewer(run, "--no-token", port=0) as (url, _):
            assert urllib.parse.urlsplit(url).port not in (taken, 8765)
            assert _get(_browser(), url + "api/sessions") == 200


def test_a_multimodal_trace_gives_its_images_where_their_placeholders_sit(tmp_path: Path) -> None:
    """The token view of a trace with images: each image's span and its pixels as its messages hold them; a URL
    that is not an inline image (an address, a script) is never handed to the page as one."""
    run = write_run(tmp_path / "run", [with_images(make_session("s-img"), [PNG_URL, "javascript:alert(1)"])])
    client = TestClient(create_view_app(OutDirSource(run, decode=False)), base_url="http://127.0.0.1")
    tokens = client.get("/view/api/sessions/s-img/traces/0/tokens").json()
    first, second = tokens["images"]
    assert (first["start"], first["end"], first["url"]) == (1, 7, PNG_URL)
    assert (second["start"], second["end"], second["url"]) == (9, 15, None)
    assert all(tokens["ids"][i] == 151655 for i in range(1, 7))

