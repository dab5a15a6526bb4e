"""The test run's time budget, a pytest plugin: with ``TPU_VIDEO_TEST_BUDGET_MINUTES`` set (CI sets it), a run whose
pytest time passes that many minutes fails, and its slowest tests are listed, so the budget is seen before it is
spent. It counts in the process that runs the session (xdist's controller), from configuration to the summary.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

import pytest

BUDGET_ENV = "TPU_VIDEO_TEST_BUDGET_MINUTES"
SLOWEST = 20
FILES = 15


class TimeBudget:
    """Times the run and each test (setup, call and teardown together) and fails the run past the budget."""

    def __init__(self, minutes: float):
        self.minutes = minutes
        self.start = time.monotonic()
        self.seconds_by_test: dict[str, float] = defaultdict(float)
        self.elapsed: float | None = None

    def pytest_runtest_logreport(self, report):
        self.seconds_by_test[report.nodeid] += report.duration

    def pytest_sessionfinish(self, session):
        self.elapsed = time.monotonic() - self.start
        if self.over and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @property
    def over(self) -> bool:
        return self.elapsed is not None and self.elapsed > self.minutes * 60

    def pytest_terminal_summary(self, terminalreporter):
        if self.elapsed is None:
            return
        used = f"pytest took {self.elapsed / 60:.1f} min of the {self.minutes:g} min budget ({BUDGET_ENV})"
        by_file: dict[str, float] = defaultdict(float)
        for nodeid, seconds in self.seconds_by_test.items():
            by_file[nodeid.split("::", 1)[0]] += seconds
        longest = sorted(by_file.items(), key=lambda item: -item[1])[:FILES]
        terminalreporter.write_line(f"the {len(longest)} longest test files (their tests' seconds; "
                                    f"tests/run_order.py hands the longest out first): "
                                    + ", ".join(f"{name} {seconds:.0f}" for name, seconds in longest))
        if not self.over:
            terminalreporter.write_line(used)
            return
        terminalreporter.section("time budget exceeded", red=True)
        terminalreporter.write_line(f"{used}: the run fails. The {SLOWEST} slowest tests:", red=True)
        slowest = sorted(self.seconds_by_test.items(), key=lambda item: -item[1])[:SLOWEST]
        for nodeid, seconds in slowest:
            terminalreporter.write_line(f"{seconds:9.1f}s  {nodeid}")


def pytest_configure(config):
    minutes = os.environ.get(BUDGET_ENV, "").strip()
    if not minutes or hasattr(config, "workerinput"):  # unset, or an xdist worker (its controller counts)
        return
    try:
        budget = float(minutes)
    except ValueError:
        raise pytest.UsageError(f"{BUDGET_ENV}={minutes!r} is not a number of minutes: set it as e.g. 40") from None
    if budget <= 0:
        raise pytest.UsageError(f"{BUDGET_ENV}={minutes!r}: give a positive number of minutes, e.g. 40")
    config.pluginmanager.register(TimeBudget(budget), "tpu_video_time_budget")
