"""A pytest plugin: where the suite's time goes, module by module, at the end of every run.

``--durations`` lists the slowest tests, but a module's cost is mostly its module-scoped fixtures (a Ray cluster, a
served app, a training run) and many tests of a few seconds each, which that list leaves out. Planning the suite's
time (CI stops at 90 minutes) needs the whole picture: this prints every module's summed setup, call and teardown
time, its share of the total and its number of tests, slowest first.

Beside each module's time: the CPU seconds the whole machine spent while it ran (every process: Ray's daemons, vLLM's
engine processes, the subprocesses a test starts; from /proc/stat, so on Linux only). The same suite took 2.5x as
long on one day as on another on the CI-sized machine, and where a module's time went (work or waiting) says which
modules a slow machine hurts and where a cut pays.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest

PROC_STAT = Path("/proc/stat")


def machine_busy_seconds() -> float | None:
    """CPU seconds every core of the machine spent busy since boot (user, nice, system, irq, softirq, steal), or None
    where /proc/stat does not exist."""
    try:
        first = PROC_STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in first[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class ModuleDurations:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.tests: dict[str, set[str]] = defaultdict(set)
        self.cpu_seconds: dict[str, float] = defaultdict(float)
        self.busy_at_start: float | None = None

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.busy_at_start = machine_busy_seconds()

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        # From the test's set-up to its teardown: a module-scoped fixture's start and stop land on its module.
        busy = machine_busy_seconds()
        if busy is not None and self.busy_at_start is not None:
            self.cpu_seconds[nodeid.split("::", 1)[0]] += busy - self.busy_at_start

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = report.nodeid.split("::", 1)[0]
        self.seconds[module] += report.duration
        self.tests[module].add(report.nodeid)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        total = sum(self.seconds.values())
        if not total:
            return
        cpu = bool(self.cpu_seconds)
        title = "time per test module (setup + call + teardown), slowest first"
        terminalreporter.write_sep("=", title + (", with the machine's CPU seconds meanwhile" if cpu else ""))
        for module, seconds in sorted(self.seconds.items(), key=lambda item: -item[1]):
            tests = len(self.tests[module])
            used = f" {self.cpu_seconds[module]:8.1f} cpu-s" if cpu else ""
            terminalreporter.write_line(f"{seconds:9.1f}s {seconds / total:6.1%}{used} {tests:4d} tests  {module}")
        used = f", {sum(self.cpu_seconds.values()):.1f} cpu-s" if cpu else ""
        terminalreporter.write_line(f"{total:9.1f}s{used} in all, {len(self.seconds)} modules")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(ModuleDurations(), "module_durations_totals")
