"""tests/module_durations.py: the run ends with every module's time, slowest first, each module's tests counted,
its setup and teardown included (a module-scoped fixture's cost lands on its module), and the CPU seconds the machine
spent meanwhile, a child process's included."""

from __future__ import annotations

import re

import pytest

SLOW = """
import time
import pytest

@pytest.fixture(scope="module")
def costly():
    time.sleep(0.4)  # a module-scoped set-up, as a served app or a cluster is
    yield

def test_one(costly):
    pass

def test_two(costly):
    time.sleep(0.2)
"""

QUICK = """
def test_quick():
    pass
"""

# A test whose work runs in a child process, as a Ray worker's or a vLLM engine's does: a second of busy CPU.
BUSY = """
import subprocess, sys

SPIN = "import time\\nend = time.process_time() + 1.0\\nwhile time.process_time() < end: pass"

def test_busy():
    subprocess.run([sys.executable, "-c", SPIN], check=True)
"""

ROW = re.compile(r"\s*([\d.]+)s\s+([\d.]+)%\s+([\d.]+) cpu-s\s+(\d+) tests\s+(\S+)$")


def test_every_module_is_listed_with_its_time_and_tests_slowest_first(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_slow=SLOW, test_quick=QUICK)
    result = pytester.runpytest("-p", "module_durations")
    result.assert_outcomes(passed=3)
    start = next(i for i, line in enumerate(result.outlines) if "time per test module" in line)
    lines = result.outlines[start:]
    rows = [ROW.match(line) for line in lines[1:3]]
    assert all(rows), lines
    (slow_s, _, _, slow_tests, slow), (quick_s, _, _, quick_tests, quick) = (row.groups() for row in rows)
    assert (slow, quick) == ("test_slow.py", "test_quick.py")
    assert (int(slow_tests), int(quick_tests)) == (2, 1)
    assert float(slow_s) >= 0.6 > float(quick_s)  # the fixture's set-up and the test's call, both counted
    assert re.match(r"\s*[\d.]+s, [\d.]+ cpu-s in all, 2 modules$", lines[3]), lines


def test_the_cpu_a_module_spent_in_a_child_process_is_its_own(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_slow=SLOW, test_busy=BUSY)
    result = pytester.runpytest("-p", "module_durations")
    result.assert_outcomes(passed=3)
    start = next(i for i, line in enumerate(result.outlines) if "time per test module" in line)
    assert "with the machine's CPU seconds meanwhile" in result.outlines[start]
    rows = {row.group(5): float(row.group(3)) for row in map(ROW.match, result.outlines[start + 1 : start + 3]) if row}
    # The child's second of CPU (its interpreter's start on top); the sleeping module's 0.6 s used next to none.
    assert rows["test_busy.py"] >= 0.9, result.outlines[start:]
    assert rows["test_busy.py"] > rows["test_slow.py"] + 0.5, result.outlines[start:]


def test_a_module_that_grew_past_its_budget_fails_the_run_and_a_slower_machine_does_not(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_slow=SLOW, test_slow_too=SLOW, test_quick=QUICK)  # the slow ones take 0.6 s or more
    pytester.makeini("[pytest]\nmodule_budgets = budgets.yaml\n")
    budgets = pytester.path / "budgets.yaml"
    header = "max_growth: 1.5\nmin_seconds: 0\ndefault_seconds: 30\nreference:\n"

    def run(**reference: float) -> pytest.RunResult:
        budgets.write_text(header + "".join(f"  {m}.py: {t}\n" for m, t in reference.items()))
        return pytester.runpytest("-p", "module_durations")

    # Within their references: the run passes.
    assert run(test_slow=30, test_slow_too=30).ret == pytest.ExitCode.OK
    # One module grew to twice its reference while the other kept to its own: the grown one fails the run.
    result = run(test_slow=0.3, test_slow_too=30)
    result.assert_outcomes(passed=5)  # every test passed: the budget alone fails the run
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*modules over their time budget*", "*speed*", "test_slow.py: *s, budget 0s"])
    assert not any(line.startswith(("test_quick.py:", "test_slow_too.py:")) for line in result.outlines)
    # Both twice their references: the machine is slower, not a module grown, and the run passes.
    assert run(test_slow=0.3, test_slow_too=0.3).ret == pytest.ExitCode.OK
