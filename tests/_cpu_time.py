"""``--cpu-durations N``: the N tests that used the most CPU, beside pytest's ``--durations`` (wall time).

The heavy tiers run two tests at a time on two cores and are CPU-bound, so a test's wall time says little about what
it costs the others: a test that sleeps is long and cheap, one that starts harnesses is short and dear. A test's CPU
here is its worker's own (``RUSAGE_SELF``) plus that of the processes it started and reaped (``RUSAGE_CHILDREN``:
launches, harness CLIs), over its setup, call and teardown. Not counted: what runs outside the worker's process tree
(Slurm jobs, containers under conmon) or is never waited for (a sandbox's processes die with its pid namespace). A
session fixture's server (vLLM) counts for the test after which it is stopped, the last of its worker."""

from __future__ import annotations

import resource
from collections.abc import Generator

import pytest

_KEY = "cpu_seconds"
_started = pytest.StashKey[float]()


def _cpu_now() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="list the N tests that used the most CPU (0: all)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_started] = _cpu_now()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport,
                                                                                          pytest.TestReport]:
    report = yield
    if call.when == "teardown" and _started in item.stash:
        report.user_properties.append((_KEY, round(_cpu_now() - item.stash[_started], 2)))
    return report


class CpuDurations:
    """Collects each test's CPU from its teardown report (also a worker's, under xdist) and prints the top ones."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for key, value in report.user_properties:
            if key == _KEY:
                self.seconds[report.nodeid] = float(value)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        ranked = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        shown = ranked if self.top == 0 else ranked[:self.top]
        terminalreporter.write_sep("=", f"most CPU: {len(shown)} of {len(ranked)} tests, "
                                        f"{sum(self.seconds.values()):.0f} s in all")
        for nodeid, seconds in shown:
            terminalreporter.write_line(f"{seconds:8.2f}s cpu  {nodeid}")


def pytest_configure(config: pytest.Config) -> None:
    top = config.getoption("--cpu-durations")
    if top is not None and not hasattr(config, "workerinput"):  # the controller prints; workers only measure
        config.pluginmanager.register(CpuDurations(top), "cpu-durations")
