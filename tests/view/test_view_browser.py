"""The viewer in real headless Chromium, served by ``python -m polar_gym.view OUT_DIR`` as a user starts it: a run
written by hand with hostile content (it must stay text), and a real launch (slow) whose drift breaks chains."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._browser import chromium_or_skip, open_page
from tests.view._view_kit import HOSTILE, PNG_URL, make_session, running_viewer, with_images, write_run

ROOT = Path(__file__).resolve().parents[2]
TRAINABLE, MASKED = "rgb(170, 230, 170)", "rgb(226, 226, 236)"


def _open_session(page: Any, session_id: str) -> None:
    page.wait_for_selector("#sessions tbody tr")
    page.click(f'#sessions tbody tr[data-session="{session_id}"]')
    page.wait_for_selector(".trace .tokens .t")


def test_hostile_content_shows_as_text(tmp_path: Path) -> None:
    chromium_or_skip()
    run = write_run(tmp_path / "run", [make_session("ok-0", "calm"),
                                       make_session("evil-0", HOSTILE, content=HOSTILE, turns=2)])
    with running_viewer(run, "--ids") as (url, _), open_page(url) as browser:
        page = browser.page
        page.wait_for_selector("#sessions tbody tr")
        assert page.locator("#sessions tbody tr").count() == 2
        _open_session(page, "evil-0")
        shown = page.locator("#traces").inner_text()
        assert HOSTILE in shown  # the markup is on screen, literally
        assert page.locator("#traces img, #traces script, #sessions img").count() == 0
        assert page.evaluate("window.__pwned") is None
        assert browser.problems == []


def test_a_trace_shows_its_images_beside_their_placeholders(tmp_path: Path) -> None:
    """Issue 42: the picture in the prompt's message and in the token stream, where its placeholder tokens stand
    (one element for the run); an image part whose URL is not an inline picture stays text."""
    chromium_or_skip()
    hostile = 'javascript:window.__pwned=3'
    run = write_run(tmp_path / "run", [with_images(make_session("img-0"), [PNG_URL, hostile])])
    with running_viewer(run, "--ids") as (url, _), open_page(url) as browser:
        page = browser.page
        _open_session(page, "img-0")
        page.wait_for_selector(".trace .tokens img.image")
        assert page.locator(".trace .tokens img.image").count() == 1
        assert page.locator(".trace .tokens img.image").first.get_attribute("src") == PNG_URL
        assert page.locator(".trace .tokens .image-run").count() == 2
        assert "(6 placeholders)" in (page.locator(".trace .tokens .image-run").first.text_content() or "")
        assert page.evaluate("document.querySelector('.trace .tokens img.image').naturalWidth") == 2  # it decoded
        page.click(".trace details.prompt summary")  # the prompt's messages: the picture in its user message
        page.wait_for_selector(".trace details.prompt img.image")
        assert page.locator(".trace details.prompt img.image").count() == 1
        assert "[image javascript:" in page.locator(".trace details.prompt").inner_text()
        assert page.evaluate("window.__pwned") is None
        assert browser.problems == []


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A real launch (oracle engine, pi CLI, the demo tasks) whose oracle drifts every other call in chat prompt
    mode, so the prefix-merging builder starts new chains on ``drift``."""
    out = tmp_path_factory.mktemp("launch") / "out"
    proc = subprocess.run([sys.executable, "-m", "polar_gym.launch", f"out_dir={out}", "num_samples=1",
                           "inference.drift_every=2", "inference.prompt_mode=chat", "launcher.progress=false"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    yield out


def _drifted(out: Path) -> tuple[str, list[dict[str, Any]]]:
    """A session whose traces include a chain started by drift, and its trajectories.jsonl lines."""
    traces = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    for t in traces:
        if t["metadata"].get("chain_cause") == "drift":
            return t["session_id"], [x for x in traces if x["session_id"] == t["session_id"]]
    raise AssertionError("the launch made no drift chain")


@pytest.mark.slow
def test_viewer_on_a_real_launch(launched: Path) -> None:
    chromium_or_skip()
    session_id, traces = _drifted(launched)
    results = [json.loads(line) for line in (launched / "results.jsonl").read_text().splitlines()]
    task_id = next(r["task_id"] for r in results if r["session_id"] == session_id)
    with running_viewer(launched) as (url, _), open_page(url) as browser:
        page = browser.page
        page.wait_for_selector("#sessions tbody tr")
        assert page.locator("#sessions tbody tr").count() == len(results)
        browser.screenshot("viewer-sessions")
        # a filter: the table keeps only the sessions of one task
        page.select_option("#filters select[name=status]", "COMPLETED")
        page.fill("#filters input[name=task]", task_id)
        page.wait_for_function("n => document.querySelectorAll('#sessions tbody tr').length === n",
                               arg=sum(1 for r in results if r["task_id"] == task_id and r["status"] == "COMPLETED"))
        assert set(page.locator("#sessions tbody tr td:nth-child(2)").all_inner_texts()) == {task_id}
        _open_session(page, session_id)
        # the token stream: a trainable and a masked token in their colours, the logprob on hover
        first = traces[0]
        n_prompt = len(first["prompt_ids"])
        j = first["loss_mask"].index(1)
        tokens = page.locator(".trace[data-trace='0'] .tokens .t")
        assert tokens.count() == n_prompt + len(first["response_ids"])
        trainable, masked = tokens.nth(n_prompt + j), tokens.nth(0)
        assert trainable.evaluate("e => getComputedStyle(e).backgroundColor") == TRAINABLE
        assert masked.evaluate("e => getComputedStyle(e).backgroundColor") == MASKED
        trainable.hover()
        title = trainable.get_attribute("title") or ""
        assert f"id {first['response_ids'][j]} " in title and "mask 1" in title
        expected = first["response_logprobs"][j]["logprob"]
        assert float(title.rsplit("logprob ", 1)[1]) == pytest.approx(expected, abs=1e-12)
        masked.hover()
        assert "mask 0" in (masked.get_attribute("title") or "")
        assert "logprob" not in (masked.get_attribute("title") or "")  # the prompt has no logprobs
        # the token text is decoded with the run's tokenizer, not shown as ids
        assert page.locator("#run-tokenizer").inner_text().startswith("tokens decoded with")
        # chain boundaries with their causes
        boundaries = page.locator(".chain-boundary").all_inner_texts()
        assert len(boundaries) == len(traces) and any("drift" in b for b in boundaries)
        # per-call timings, engine and policy version
        assert page.locator("#calls tbody tr").count() >= len(traces)
        assert "oracle" in page.locator("#calls tbody tr").first.inner_text()
        page.locator(".tool-call").first.wait_for()
        # prompt messages come when opened
        page.click(".trace[data-trace='0'] details.prompt summary")
        page.locator(".trace[data-trace='0'] details.prompt .msg").first.wait_for()
        assert page.locator(".trace[data-trace='0'] details.prompt .msg").count() == len(first["prompt_messages"])
        frame = "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))"
        trainable.scroll_into_view_if_needed()  # the response, in the token box and in the window
        page.evaluate(frame)
        browser.screenshot("viewer-tokens", full_page=False)  # the token blocks on screen are painted
        page.evaluate("() => window.scrollTo(0, 0)")
        page.evaluate(frame)
        browser.screenshot("viewer-session")
        assert browser.problems == []
