"""Reading test-runner summaries out of a command's output (pytest and unittest), so that rewards and details can
say how many tests passed rather than only whether the command exited 0. Pure functions of text."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["Framework", "TestSummary", "parse_pytest", "parse_summary", "parse_unittest"]

Framework = Literal["pytest", "unittest"]

_PYTEST_COUNT = r"\d+ (?:passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?|rerun)"
_PYTEST_LINE = re.compile(
    rf"^[=\s]*(?P<body>(?:{_PYTEST_COUNT})(?:, {_PYTEST_COUNT})*|no tests ran)\s+in\s+[\d.]+\s*s", re.M)
_PYTEST_PART = re.compile(r"(\d+) (\w+)")
_UNITTEST_RAN = re.compile(r"^Ran (\d+) tests? in [\d.]+s\s*$", re.M)
_UNITTEST_VERDICT = re.compile(r"^(OK|FAILED)(?: \((?P<counts>[^)]*)\))?\s*$", re.M)


@dataclass(frozen=True)
class TestSummary:
    """Counts from one test run. ``total`` counts the tests that decide the outcome (skips excluded)."""

    __test__ = False  # not a pytest test class

    framework: Framework
    passed: int
    failed: int
    errors: int = 0
    skipped: int = 0

    @property
    def total(self) -> int:
        return self.passed + self.failed + self.errors

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


def parse_pytest(text: str) -> TestSummary | None:
    """The last pytest summary line (``3 passed, 1 failed in 0.12s``, with or without ``=`` rulers)."""
    matches = list(_PYTEST_LINE.finditer(text))
    if not matches:
        return None
    counts: dict[str, int] = {}
    for n, word in _PYTEST_PART.findall(matches[-1].group("body")):
        key = {"error": "errors", "warning": "warnings"}.get(word, word)
        counts[key] = counts.get(key, 0) + int(n)
    # an expected failure that failed, or (non-strict) passed, is not a failure of the run
    passed = counts.get("passed", 0) + counts.get("xfailed", 0) + counts.get("xpassed", 0)
    return TestSummary("pytest", passed=passed, failed=counts.get("failed", 0), errors=counts.get("errors", 0),
                       skipped=counts.get("skipped", 0))


def parse_unittest(text: str) -> TestSummary | None:
    """The last ``Ran N tests`` block and its ``OK`` / ``FAILED (failures=1, errors=2)`` verdict."""
    runs = list(_UNITTEST_RAN.finditer(text))
    if not runs:
        return None
    last = runs[-1]
    verdict = _UNITTEST_VERDICT.search(text, last.end())
    ran = int(last.group(1))
    counts: dict[str, int] = {}
    if verdict and verdict.group("counts"):
        for part in verdict.group("counts").split(","):
            key, _, value = part.strip().partition("=")
            if value.isdigit():
                counts[key] = int(value)
    failed = counts.get("failures", 0) + counts.get("unexpected successes", 0)
    errors, skipped = counts.get("errors", 0), counts.get("skipped", 0)
    if verdict is None and ran:  # the runner died after "Ran": nothing is known to have passed
        return TestSummary("unittest", passed=0, failed=0, errors=ran, skipped=0)
    return TestSummary("unittest", passed=max(0, ran - failed - errors - skipped), failed=failed, errors=errors,
                       skipped=skipped)


def parse_summary(text: str, framework: Framework | Literal["auto"] = "auto") -> TestSummary | None:
    """The summary of whichever runner printed one (``auto`` tries pytest first, then unittest)."""
    if framework == "pytest":
        return parse_pytest(text)
    if framework == "unittest":
        return parse_unittest(text)
    return parse_pytest(text) or parse_unittest(text)
