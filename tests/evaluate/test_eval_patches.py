"""Patch splitting and excludes (pure), application with fallbacks (in real sandboxes), and test-summary parsing."""

from __future__ import annotations

import pytest

from polar_gym.evaluate.patches import (
    APPLY_STRATEGIES,
    DEFAULT_EXCLUDES,
    TEST_FILE_GLOBS,
    apply_patch,
    extract_patch,
    filter_patch,
    patch_command,
    patch_paths,
    split_patch,
)
from polar_gym.evaluate.results import TestSummary, parse_pytest, parse_summary, parse_unittest
from polar_gym.tasks import TEST_COMMAND, demo_task
from tests.evaluate._evalkit import needs_bwrap, solve

GIT_DIFF = """\
diff --git a/src/app.py b/src/app.py
index 1111111..2222222 100644
--- a/src/app.py
+++ b/src/app.py
@@ -1,2 +1,2 @@
-x = 1
+x = 2
 y = 3
diff --git a/tests/test_app.py b/tests/test_app.py
index 3333333..4444444 100644
--- a/tests/test_app.py
+++ b/tests/test_app.py
@@ -1 +1 @@
-assert x == 1
+assert True
diff --git a/logo.png b/logo.png
new file mode 100644
index 0000000..5555555
GIT binary patch
literal 4
LcmZQzWMT#Y01f~L

literal 0
HcmV?d00001

diff --git a/old name.txt b/new name.txt
similarity index 100%
rename from old name.txt
rename to new name.txt
diff --git a/gone.py b/gone.py
deleted file mode 100644
index 6666666..0000000
--- a/gone.py
+++ /dev/null
@@ -1 +0,0 @@
-print("bye")
diff --git a/pkg/__pycache__/m.cpython-311.pyc b/pkg/__pycache__/m.cpython-311.pyc
index 7777777..8888888 100644
Binary files a/pkg/__pycache__/m.cpython-311.pyc and b/pkg/__pycache__/m.cpython-311.pyc differ
diff --git "a/caf\\303\\251.py" "b/caf\\303\\251.py"
new file mode 100644
index 0000000..9999999
--- /dev/null
+++ "b/caf\\303\\251.py"
@@ -0,0 +1 @@
+z = 1
"""

PLAIN_DIFF = """\
--- calc.py\t2024-01-01 00:00:00
+++ calc.py\t2024-01-01 00:00:01
@@ -1 +1 @@
-a
+b
--- other.py
+++ other.py
@@ -1 +1 @@
-c
+d
"""


# -- splitting and excludes (pure) -------------------------------------------------------------------------------

def test_split_git_diff() -> None:
    files = split_patch(GIT_DIFF)
    assert [f.path for f in files] == ["src/app.py", "tests/test_app.py", "logo.png", "new name.txt", "gone.py",
                                       "pkg/__pycache__/m.cpython-311.pyc", "café.py"]
    assert [f.binary for f in files] == [False, False, True, False, False, True, False]
    assert files[3].old_path == "old name.txt" and files[4].old_path is None
    assert "".join(f.text for f in files) == GIT_DIFF


def test_split_plain_unified_diff_and_garbage() -> None:
    assert [f.path for f in split_patch(PLAIN_DIFF)] == ["calc.py", "other.py"]
    assert split_patch("") == [] and split_patch("  \n") == []
    with pytest.raises(ValueError, match="not a patch"):
        split_patch("hello\nworld\n")


def test_patch_paths_include_rename_sources() -> None:
    assert "old name.txt" in patch_paths(GIT_DIFF) and "new name.txt" in patch_paths(GIT_DIFF)


def test_filter_binary_globs_tests_and_paths() -> None:
    result = filter_patch(GIT_DIFF, exclude=[*DEFAULT_EXCLUDES, *TEST_FILE_GLOBS], exclude_binary=True,
                          exclude_paths=["old name.txt"])
    assert result.kept == ["src/app.py", "gone.py", "café.py"]
    assert result.dropped == {"tests/test_app.py": "matches 'test_*.py'", "logo.png": "binary",
                              "new name.txt": "excluded path", "pkg/__pycache__/m.cpython-311.pyc": "binary"}
    assert [f.path for f in split_patch(result.text)] == result.kept
    # a glob without "/" matches the basename anywhere; binary files are kept unless asked
    kept = filter_patch(GIT_DIFF, exclude=["*.py"]).kept
    assert kept == ["logo.png", "new name.txt", "pkg/__pycache__/m.cpython-311.pyc"]
    assert filter_patch(GIT_DIFF, exclude=["__pycache__/*", "*/__pycache__/*"]).dropped == {
        "pkg/__pycache__/m.cpython-311.pyc": "matches '*/__pycache__/*'"}
    assert filter_patch("").text == ""


# -- extraction and application with fallbacks (real sandboxes) --------------------------------------------------

TASK = demo_task("demo-calc-add")
pytest_sandbox = needs_bwrap


async def _commit(rt, command: str) -> None:
    result = await rt.exec(f"{command} && git commit -qam drift")
    assert result.ok, result.stderr


@pytest_sandbox
async def test_extract_includes_untracked_and_respects_base(demo_runtime) -> None:
    async with demo_runtime(TASK) as rt:
        assert await extract_patch(rt, patch_command()) == ""
        await solve(rt, TASK)
        await rt.exec("echo new > added.txt")
        patch = await extract_patch(rt, patch_command())
        assert patch_paths(patch) == ["added.txt", "calc.py"]
        # the agent committed its work: diffing against the base commit still finds it
        base = (await rt.exec("git rev-parse HEAD")).text.strip()
        await rt.exec("git add -A && git commit -qm agent")
        assert await extract_patch(rt, patch_command("HEAD")) == ""
        assert patch_paths(await extract_patch(rt, patch_command(base))) == ["added.txt", "calc.py"]


@pytest_sandbox
async def test_apply_plain(demo_runtime) -> None:
    async with demo_runtime(TASK, "live") as live, demo_runtime(TASK, "fresh") as fresh:
        await solve(live, TASK)
        outcome = await apply_patch(fresh, await extract_patch(live, patch_command()))
        assert outcome.applied and outcome.strategy == "git_apply" and len(outcome.attempts) == 1
        assert (await fresh.exec(TEST_COMMAND)).ok


@pytest_sandbox
async def test_apply_falls_back_to_3way(demo_runtime) -> None:
    async with demo_runtime(TASK, "live") as live, demo_runtime(TASK, "fresh") as fresh:
        await solve(live, TASK)
        patch = await extract_patch(live, patch_command())
        # the fresh tree moved on: a context line of the hunk changed (not the hunk's own line)
        await _commit(fresh, "sed -i 's/^def add(a, b):$/def add(a, b):  # public/' calc.py")
        outcome = await apply_patch(fresh, patch)
        assert outcome.applied and outcome.strategy == "git_apply_3way", outcome.attempts
        assert (await fresh.exec(TEST_COMMAND)).ok


@pytest_sandbox
async def test_apply_falls_back_to_patch_fuzz(demo_runtime) -> None:
    plain = ("--- a/calc.py\n+++ b/calc.py\n@@ -3,7 +3,7 @@\n \n def add(a, b):\n"
             '     """Return the sum of a and b."""\n-    return a - b\n+    return a + b\n \n \n'
             " def multiply(a, b):\n")
    async with demo_runtime(TASK) as fresh:
        await _commit(fresh, "sed -i 's/^def multiply(a, b):$/def multiply(a, b):  # public/' calc.py")
        outcome = await apply_patch(fresh, plain)
        assert outcome.applied and outcome.strategy == "patch_fuzz", outcome.attempts
        assert [a["strategy"] for a in outcome.attempts] == [name for name, _ in APPLY_STRATEGIES]
        assert (await fresh.exec(TEST_COMMAND)).ok


@pytest_sandbox
async def test_apply_failure_reports_every_attempt(demo_runtime) -> None:
    bad = "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n-nothing like this\n+at all\n context that is absent\n"
    async with demo_runtime(TASK) as fresh:
        outcome = await apply_patch(fresh, bad)
        assert not outcome.applied and outcome.strategy is None
        assert len(outcome.attempts) == len(APPLY_STRATEGIES)
        assert all(a["exit_code"] != 0 for a in outcome.attempts)


# -- test summaries (pure) ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("..F\n=== 1 failed, 2 passed in 0.12s ===\n", TestSummary("pytest", 2, 1)),
    ("3 passed, 1 skipped, 2 warnings in 1.50s\n", TestSummary("pytest", 3, 0, skipped=1)),
    ("== 1 passed, 1 error, 1 xfailed, 1 xpassed in 0.3s (0:00:00) ==", TestSummary("pytest", 3, 0, errors=1)),
    ("= 2 failed, 3 errors in 2.0s =", TestSummary("pytest", 0, 2, errors=3)),
    ("============ no tests ran in 0.01s ============", TestSummary("pytest", 0, 0)),
    ("5 passed in 0.1s\n== 1 failed, 4 passed in 0.2s ==\n", TestSummary("pytest", 4, 1)),
])
def test_parse_pytest(text: str, expected: TestSummary) -> None:
    assert parse_pytest(text) == expected
    assert parse_summary(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("..\n------\nRan 2 tests in 0.001s\n\nOK\n", TestSummary("unittest", 2, 0)),
    ("Ran 5 tests in 0.01s\n\nFAILED (failures=1, errors=2, skipped=1)\n", TestSummary("unittest", 1, 1, 2, 1)),
    ("Ran 3 tests in 0.01s\n\nOK (skipped=1, expected failures=1)\n", TestSummary("unittest", 2, 0, skipped=1)),
    ("Ran 2 tests in 0.01s\n\nFAILED (unexpected successes=1)\n", TestSummary("unittest", 1, 1)),
    ("Ran 4 tests in 0.01s\nSegmentation fault\n", TestSummary("unittest", 0, 0, errors=4)),
])
def test_parse_unittest(text: str, expected: TestSummary) -> None:
    assert parse_unittest(text) == expected
    assert parse_summary(text, "unittest") == expected


def test_summary_numbers() -> None:
    s = TestSummary("unittest", passed=3, failed=1, skipped=5)
    assert s.total == 4 and s.fraction == 0.75 and s.as_dict()["total"] == 4
    assert TestSummary("pytest", 0, 0).fraction == 0.0
    assert parse_summary("nothing here") is None and parse_summary("Ran 1 test in 0s\nOK", "pytest") is None
