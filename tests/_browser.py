"""A real headless browser for the pages polar_gym writes and serves (report.html, the trace viewer).

Debian's Chromium (``/usr/bin/chromium``, installed by scripts/setup.sh) driven by Playwright's Python client:
Playwright cannot download its own browser builds here, so it is pointed at the system one. Every page opened
through :func:`open_page` records its console errors, uncaught exceptions and every request that tried to leave the
machine (a self-contained page makes none: they are refused and listed), so a test asserts all three are empty.
Screenshots go to ``$POLAR_TEST_ARTIFACTS`` (default ``test-artifacts/`` in the clone, gitignored)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

__all__ = ["ARTIFACTS", "CHROMIUM", "BrowserPage", "chromium_or_skip", "open_page"]

CHROMIUM = os.environ.get("POLAR_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("POLAR_TEST_ARTIFACTS", Path(__file__).resolve().parent.parent / "test-artifacts"))
# Chromium's own background traffic (updates, sync, QUIC probes) is refused on this closed network, noisily, and a
# root user needs --no-sandbox (Chromium's sandbox refuses to run as root).
_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


def chromium_or_skip() -> str:
    """The browser's path, or skip the test with what to install."""
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        pytest.skip(f"no Chromium at {CHROMIUM}: `apt-get install chromium` (scripts/setup.sh does), "
                    "or set POLAR_CHROMIUM")
    pytest.importorskip("playwright.sync_api", reason="playwright (the test extra) is not installed")
    return CHROMIUM


@dataclass
class BrowserPage:
    """An open page and what went wrong on it so far."""

    page: Any  # playwright.sync_api.Page
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    outside_requests: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        return ([f"console: {e}" for e in self.console_errors] + [f"exception: {e}" for e in self.page_errors]
                + [f"request left the machine: {u}" for u in self.outside_requests])

    def screenshot(self, name: str, *, full_page: bool = True) -> Path:
        """Save a PNG under the artifacts folder (kept after the run) and return its path."""
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=full_page)
        return path


def _local(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme in ("file", "data", "blob", "about") or (parts.hostname or "") in _LOCAL_HOSTS


@contextlib.contextmanager
def open_page(url: str, *, width: int = 1400, height: int = 1000, timeout_ms: float = 30_000) -> Iterator[BrowserPage]:
    """Launch Chromium headless, open ``url`` (file:// or loopback) and yield the page once it has loaded."""
    from playwright.sync_api import sync_playwright

    executable = chromium_or_skip()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, headless=True, args=_ARGS)
        try:
            context = browser.new_context(viewport={"width": width, "height": height})
            page = context.new_page()
            page.set_default_timeout(timeout_ms)
            opened = BrowserPage(page)
            page.on("console", lambda m: opened.console_errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: opened.page_errors.append(str(e)))

            def route(r: Any) -> None:
                if _local(r.request.url):
                    r.continue_()
                else:
                    opened.outside_requests.append(r.request.url)
                    r.abort()

            page.route("**/*", route)
            page.goto(url, wait_until="load")
            yield opened
        finally:
            browser.close()
