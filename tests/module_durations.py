"""A pytest plugin: where the suite's time goes, module by module, at the end of every run.

``--durations`` lists the slowest tests, but a module's cost is mostly its module-scoped fixtures (a Ray cluster, a
served app, a training run) and many tests of a few seconds each, which that list leaves out. Planning the suite's
time (CI stops at 90 minutes) needs the whole picture: this prints every module's summed setup, call and teardown
time, its share of the total and its number of tests, slowest first.
"""

from __future__ import annotations

from collections import defaultdict

import pytest


class ModuleDurations:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.tests: dict[str, set[str]] = defaultdict(set)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = report.nodeid.split("::", 1)[0]
        self.seconds[module] += report.duration
        self.tests[module].add(report.nodeid)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        total = sum(self.seconds.values())
        if not total:
            return
        terminalreporter.write_sep("=", "time per test module (setup + call + teardown), slowest first")
        for module, seconds in sorted(self.seconds.items(), key=lambda item: -item[1]):
            tests = len(self.tests[module])
            terminalreporter.write_line(f"{seconds:9.1f}s {seconds / total:6.1%} {tests:4d} tests  {module}")
        terminalreporter.write_line(f"{total:9.1f}s in all, {len(self.seconds)} modules")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(ModuleDurations(), "module_durations_totals")
