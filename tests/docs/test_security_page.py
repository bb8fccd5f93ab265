"""docs/security.md names the test behind each claim: every test it names exists, so a renamed or deleted test
cannot leave a claim standing without its proof."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "security.md"


def named_tests(text: str) -> list[tuple[str, str | None]]:
    """``(file, test)`` for every `` `tests/F.py::T` ``, `` `tests/F.py` `` and `` `::T` `` (T of the file named
    last before it) in ``text``, in order; a parametrized id's ``[...]`` is dropped."""
    found: list[tuple[str, str | None]] = []
    current: str | None = None
    for ref in re.findall(r"`((?:tests/[\w/]+\.py)?(?:::\w+)?)(?:\[[^\]`]*\])?`", text):
        path, _, name = ref.partition("::")
        if path:
            current = path
        if current is not None and (path or name):
            found.append((current, name or None))
    return found


def test_the_reference_parser_follows_the_page_s_shorthand() -> None:
    text = "`tests/a.py::t1`, `::t2[x]`, `tests/b.py`, `::t3` and `polar_gym/x.py`"
    assert named_tests(text) == [("tests/a.py", "t1"), ("tests/a.py", "t2"), ("tests/b.py", None),
                                 ("tests/b.py", "t3")]


def test_every_test_the_security_page_names_exists() -> None:
    refs = named_tests(PAGE.read_text())
    assert len(refs) > 50
    missing = []
    for path, name in refs:
        file = ROOT / path
        if not file.is_file():
            missing.append(path)
        elif name is not None and not re.search(rf"^(?:async )?def {name}\(", file.read_text(), re.MULTILINE):
            missing.append(f"{path}::{name}")
    assert not missing, missing
