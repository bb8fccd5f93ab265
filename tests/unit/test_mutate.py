"""scripts/mutate.py, the project's mutation tester: it generates the expected mutants for a tiny module, and
gives a killed and a survived verdict against a toy test, from a copy of the toy tree (never the tree itself)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_mutate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutate_script", ROOT / "scripts" / "mutate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


mutate = load_mutate()

TINY = '''"""A docstring is never mutated."""

__all__ = ["at_most", "count"]


def at_most(a: int, b: int) -> bool:
    return a <= b and not a < 0


def count(items: list[int]) -> int:
    n = 0
    for _ in items:
        n += 1
    return n
'''


def test_the_expected_mutants_of_a_tiny_module():
    found = [(m.line, m.description, mutate.apply(TINY, m).splitlines()[m.line - 1].strip())
             for m in mutate.mutants(TINY)]
    assert found == [
        (7, "return value -> None", "return None"),
        (7, "<= -> <", "return (a < b) and not a < 0"),
        (7, "and -> or", "return (a <= b or not a < 0)"),
        (7, "not x -> x", "return a <= b and (a < 0)"),
        (7, "< -> <=", "return a <= b and not (a <= 0)"),
        (7, "0 -> 1", "return a <= b and not a < (1)"),
        (11, "delete statement", "pass"),
        (11, "0 -> 1", "n = (1)"),
        (13, "+= -> -=", "n -= 1"),
        (13, "delete statement", "pass"),
        (13, "1 -> 2", "n += (2)"),
        (14, "return value -> None", "return None"),
    ]
    for m in mutate.mutants(TINY):  # every mutant is still valid Python
        compile(mutate.apply(TINY, m), "tiny.py", "exec")


def toy_tree(root: Path) -> None:
    """A package ``toy`` holding TINY, and an empty ``tests`` folder."""
    (root / "toy").mkdir()
    (root / "toy" / "__init__.py").write_text("")
    (root / "toy" / "tiny.py").write_text(TINY)
    (root / "tests").mkdir()


def test_a_killed_and_a_survived_verdict_on_a_toy_test(tmp_path: Path):
    toy_tree(tmp_path)
    # pins at_most's boundary but never calls it with a negative a: the "not a < 0" mutants survive
    (tmp_path / "tests" / "test_toy.py").write_text(
        "from toy.tiny import at_most\n\n\ndef test_boundary():\n    assert at_most(2, 2) and not at_most(3, 2)\n")
    equivalent = {("tiny.py", "return a <= b and not a < 0", "0 -> 1"): "a toy's named equivalent"}
    result = mutate.run_module("tiny.py", ["tests/test_toy.py"], root=tmp_path, package="toy", jobs=2, limit=6,
                               equivalent=equivalent)
    verdicts = {o.mutant.description: o.verdict for o in result.outcomes}
    assert verdicts == {"return value -> None": "killed", "and -> or": "killed", "<= -> <": "killed",
                        "not x -> x": "killed", "< -> <=": "survived", "0 -> 1": "equivalent"}
    assert (tmp_path / "toy" / "tiny.py").read_text() == TINY  # the tree itself is never touched
    report = result.to_json()
    assert (report["mutants"], report["killed"], report["survived"], report["equivalent"]) == (6, 4, 1, 1)
    assert report["score"] == 80.0
    survivor = {"at": "polar_gym/tiny.py:7", "mutation": "< -> <=",
                "key": ["return a <= b and not a < 0", 26, "< -> <=", 0]}
    assert report["survivors"] == [survivor]
    assert "survived  polar_gym/tiny.py:7  < -> <=" in mutate.table([result])

    # after a new test, only the survivors run again, found by their line's text even when the line moved
    (tmp_path / "toy" / "tiny.py").write_text('"""Moved down."""\n\n' + TINY)
    (tmp_path / "tests" / "test_negative.py").write_text(
        "from toy.tiny import at_most\n\n\ndef test_negative():\n    assert at_most(0, 1) and not at_most(-1, 1)\n")
    again = mutate.run_module("tiny.py", ["tests/test_toy.py", "tests/test_negative.py"], root=tmp_path,
                              package="toy", jobs=1, only={tuple(survivor["key"])})
    assert [(o.mutant.line, o.mutant.description, o.verdict) for o in again.outcomes] == [(9, "< -> <=", "killed")]


def test_a_mutant_no_test_reaches_is_not_run(tmp_path: Path):
    """Coverage per test picks a mutant's tests: count() is never called, so its mutants survive unrun, named."""
    toy_tree(tmp_path)
    (tmp_path / "tests" / "test_toy.py").write_text(
        "from toy.tiny import at_most\n\n\ndef test_boundary():\n    assert at_most(2, 2) and not at_most(3, 2)\n")
    keys = {key for m, key in mutate.mutant_keys(TINY).items() if m.line in (7, 13)}
    result = mutate.run_module("tiny.py", ["tests/test_toy.py"], root=tmp_path, package="toy", jobs=1, only=keys)
    by_line = {(o.mutant.line, o.mutant.description): (o.verdict, o.why) for o in result.outcomes}
    assert by_line[(13, "+= -> -=")] == ("survived", "no test runs this line")
    assert by_line[(7, "and -> or")] == ("killed", "")
    assert "(no test runs this line)" in mutate.table([result])


def test_alike_mutants_on_identical_lines_keep_distinct_keys():
    source = "def f(x):\n    for _ in x:\n        continue\n    for _ in x:\n        continue\n"
    keys = [key for m, key in mutate.mutant_keys(source).items() if m.description == "delete statement"]
    assert keys == [("continue", 8, "delete statement", 0), ("continue", 8, "delete statement", 1)]


def test_the_docs_list_every_equivalent_mutant_as_the_script_names_it():
    """docs/mutation.md's table is the script's EQUIVALENT (paste `python scripts/mutate.py --equivalents`)."""
    page = (ROOT / "docs" / "mutation.md").read_text()
    listed = page[page.index("<!-- equivalents:"):page.index("<!-- /equivalents -->")].split("\n", 1)[1].strip()
    assert listed == mutate.equivalents_table()
