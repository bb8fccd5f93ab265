"""The docs site builds with ``mkdocs build --strict`` (mkdocs checks links, anchors and the nav), and what strict mode
does not check: README.md's links into the repository exist, every page is in the nav, and the built site loads
nothing from the internet (it is read offline on clusters)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.docs._blocks import DOCS

ROOT = DOCS.parent
MKDOCS = ROOT / ".venv" / "bin" / "mkdocs"
#: a markdown link or image target: [text](target) / ![alt](target)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
#: what a browser fetches by itself when it shows a page (a plain <a href> to elsewhere is only a link)
_FETCHED = re.compile(r"<(?:img|script|iframe|source|video|audio)\b[^>]*\bsrc=\"(https?:)?//[^\"]*\""
                      r"|<link\b(?=[^>]*\brel=\"(?:stylesheet|preload|icon|modulepreload)\")[^>]*\bhref=\"(https?:)?//"
                      r"|url\((?:['\"])?(https?:)?//")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built once for this module; fails with mkdocs' own warnings when strict mode refuses it."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(out)], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=300)
    if done.returncode != 0:
        problems = [line for line in done.stderr.splitlines() if not line.startswith("INFO")]
        pytest.fail("mkdocs build --strict failed:\n" + "\n".join(problems or done.stderr.splitlines()[-30:]))
    return out


def test_the_site_builds_in_strict_mode(site: Path) -> None:
    assert (site / "index.html").is_file()
    assert (site / "quickstart" / "index.html").is_file()


def test_the_built_site_fetches_nothing_from_the_internet(site: Path) -> None:
    fetched = {}
    for page in site.rglob("*"):
        if page.suffix in {".html", ".css"}:
            hits = [m.group(0) for m in _FETCHED.finditer(page.read_text(errors="replace"))]
            if hits:
                fetched[str(page.relative_to(site))] = hits[:3]
    assert not fetched, f"pages that load resources from the network (the site must work offline): {fetched}"


def _nav_pages(nav: Any) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*map(_nav_pages, nav)) if nav else set()
    if isinstance(nav, dict):
        return set().union(*map(_nav_pages, nav.values())) if nav else set()
    return set()


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = {page for page in _nav_pages(config["nav"]) if not page.startswith(("http:", "https:"))}
    pages = {str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md")}
    assert pages - listed == set(), "pages missing from mkdocs.yml's nav"
    assert listed - pages == set(), "nav entries with no page"


def _links(path: Path) -> list[tuple[int, str]]:
    text, out, fenced = path.read_text().splitlines(), [], False
    for number, line in enumerate(text, 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if not fenced:
            out += [(number, m.group(1)) for m in _LINK.finditer(line)]
    return out


@pytest.mark.parametrize("document", ["README.md", "CONTRIBUTING.md"])
def test_the_repository_documents_link_to_files_that_exist(document: str) -> None:
    """README.md and CONTRIBUTING.md are read on GitHub, outside the site: mkdocs does not check their links."""
    source = ROOT / document
    broken = []
    for line, target in _links(source):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path).resolve()
        if not resolved.exists():
            broken.append(f"{document}:{line}: {target}")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{document}:{line}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _anchors(page: Path) -> set[str]:
    """The ids mkdocs' toc extension gives the page's headings (lower case, punctuation dropped, spaces to -)."""
    heads = [line.lstrip("#").strip() for line in page.read_text().splitlines() if re.match(r"^#{1,6}\s", line)]
    return {re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", head.lower())).strip("-") for head in heads}
