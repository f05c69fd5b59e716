"""A pytest plugin: where the suite's time goes, module by module, at the end of every run.

``--durations`` lists the slowest tests, but a module's cost is mostly its module-scoped fixtures (a Ray cluster, a
served app, a training run) and many tests of a few seconds each, which that list leaves out. Planning the suite's
time (CI stops at 90 minutes) needs the whole picture: this prints every module's summed setup, call and teardown
time, its share of the total and its number of tests, slowest first.

Beside each module's time: the CPU seconds the whole machine spent while it ran (every process: Ray's daemons, vLLM's
engine processes, the subprocesses a test starts; from /proc/stat, so on Linux only). The same suite took 2.5x as
long on one day as on another on the CI-sized machine, and where a module's time went (work or waiting) says which
modules a slow machine hurts and where a cut pays.

Each module has a time budget, so that the suite's growth is seen in the commit that causes it, not when CI's limit
is hit. The ``module_budgets`` ini option names the file (tests/module_budgets.yaml): every module's reference time,
measured on the CI-sized machine on a normal day, and how much a module may grow past it. The same tests run up to
2.5x slower on a slow day, which must not fail a run that changed nothing: so the budget follows the machine. The
run's speed is the median, over the listed modules of some size, of each one's time over its reference (never below
1), and a module fails the run when it takes more than ``max_growth`` x its reference (at least ``min_seconds``) x
that speed: a module that grew while the rest did not.
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

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


@dataclass(frozen=True)
class Budgets:
    """Each module's reference seconds (setup + call + teardown), and how far past it the run's speed lets it go."""

    reference: dict[str, float]
    max_growth: float
    min_seconds: float  # a module's reference for budgeting is at least this: small modules' times are noisy
    default_seconds: float  # the reference of a module the file does not list yet

    @classmethod
    def load(cls, path: Path) -> Budgets:
        table = yaml.safe_load(path.read_text()) or {}
        known = {"max_growth", "min_seconds", "default_seconds", "reference"}
        if unknown := set(table) - known:
            raise pytest.UsageError(f"{path}: unknown keys {sorted(unknown)} (expected {sorted(known)})")
        if missing := known - set(table):
            raise pytest.UsageError(f"{path}: missing keys {sorted(missing)}")
        reference = {module: float(seconds) for module, seconds in table["reference"].items()}
        return cls(reference, float(table["max_growth"]), float(table["min_seconds"]), float(table["default_seconds"]))

    def speed(self, seconds: dict[str, float]) -> float:
        """How much slower than the references this run is: the median ratio over the listed modules that ran whose
        reference is at least ``min_seconds`` (a second's module is too noisy to tell), and at least 1 (a faster
        machine does not tighten the budgets)."""
        ratios = [
            t / ref for m, t in seconds.items() if (ref := self.reference.get(m, 0.0)) and ref >= self.min_seconds
        ]
        return max(1.0, statistics.median(ratios)) if ratios else 1.0

    def budget(self, module: str, speed: float) -> float:
        return max(self.reference.get(module, self.default_seconds), self.min_seconds) * self.max_growth * speed

    def over(self, seconds: dict[str, float], speed: float) -> list[tuple[str, float, float]]:
        """(module, seconds, budget) for every module past its budget at the run's ``speed``, slowest first."""
        rows = [(m, t, self.budget(m, speed)) for m, t in seconds.items() if t > self.budget(m, speed)]
        return sorted(rows, key=lambda row: -row[1])


class ModuleDurations:
    def __init__(self, budgets: Budgets | None = None) -> None:
        self.budgets = budgets
        self.speed = 1.0  # the run's speed against the budgets' references, once the session ends
        self.over_budget: list[tuple[str, float, float]] = []  # (module, seconds, budget), once the session ends
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

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        # Judged once, here, where the exit status can still change; the summary (printed later) reports it.
        if self.budgets:
            self.speed = self.budgets.speed(self.seconds)
            self.over_budget = self.budgets.over(self.seconds, self.speed)
        if self.over_budget and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    # Last of the summaries, after --durations' list: a CI log's tail then shows why the run failed.
    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        self._table(terminalreporter)
        if self.budgets and self.over_budget:
            terminalreporter.section("modules over their time budget", red=True)
            terminalreporter.write_line(
                f"this run's speed against the references: {self.speed:.2f}x; a module may take "
                f"{self.budgets.max_growth:g}x its reference at that speed"
            )
            for module, seconds, budget in self.over_budget:
                terminalreporter.write_line(f"{module}: {seconds:.1f}s, budget {budget:.0f}s")
            terminalreporter.write_line(
                "cut the module's cost (share a fixture, fewer steps) or raise its budget in the budgets file, "
                "with the measurement that justifies it"
            )

    def _table(self, terminalreporter: pytest.TerminalReporter) -> None:
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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("module_budgets", "YAML file of per-module time budgets (tests/module_durations.py)", default="")


def pytest_configure(config: pytest.Config) -> None:
    budgets = None
    if name := config.getini("module_budgets"):
        budgets = Budgets.load(config.rootpath / name)
    config.pluginmanager.register(ModuleDurations(budgets), "module_durations_totals")
