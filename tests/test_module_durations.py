"""tests/module_durations.py: the run ends with every module's time, slowest first, each module's tests counted,
its setup and teardown included (a module-scoped fixture's cost lands on its module)."""

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


def test_every_module_is_listed_with_its_time_and_tests_slowest_first(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_slow=SLOW, test_quick=QUICK)
    result = pytester.runpytest("-p", "module_durations")
    result.assert_outcomes(passed=3)
    start = next(i for i, line in enumerate(result.outlines) if "time per test module" in line)
    lines = result.outlines[start:]
    rows = [re.match(r"\s*([\d.]+)s\s+([\d.]+)%\s+(\d+) tests\s+(\S+)$", line) for line in lines[1:3]]
    assert all(rows), lines
    (slow_s, _, slow_tests, slow), (quick_s, _, quick_tests, quick) = (row.groups() for row in rows)
    assert (slow, quick) == ("test_slow.py", "test_quick.py")
    assert (int(slow_tests), int(quick_tests)) == (2, 1)
    assert float(slow_s) >= 0.6 > float(quick_s)  # the fixture's set-up and the test's call, both counted
    assert re.match(r"\s*[\d.]+s in all, 2 modules$", lines[3]), lines
