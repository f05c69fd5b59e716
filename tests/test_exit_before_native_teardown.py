"""tests/exit_before_native_teardown.py: a pytest process that loaded Ray's core worker ends with pytest's verdict,
its summary and junit XML written, and none of the interpreter's teardown run (the teardown that crashed in CI
after every test had passed); a process that did not load Ray exits as usual."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each test runs a fresh interpreter (two of them import Ray)

TESTS = Path(__file__).resolve().parent

# Each test module registers an atexit hook before the plugin registers its own: the interpreter's teardown runs it
# (writes the marker) unless the plugin ended the process first.
MODULE = """
import atexit
from pathlib import Path

def _teardown_ran():
    Path({marker!r}).write_text("the interpreter's teardown ran")

atexit.register(_teardown_ran)
{imports}

def test_passes():
    pass

def test_{second}():
    assert {outcome}
"""


def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, imports: str, outcome: bool) -> tuple:
    marker = pytester.path / "teardown-ran"
    second = "passes_too" if outcome else "fails"
    pytester.makepyfile(test_module=MODULE.format(marker=str(marker), imports=imports, second=second, outcome=outcome))
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # the plugin's module, in the child interpreter
    junit = pytester.path / "junit.xml"
    result = pytester.runpytest_subprocess("-p", "exit_before_native_teardown", f"--junitxml={junit}")
    return result, marker, junit


@pytest.mark.parametrize("outcome", [True, False], ids=["all-pass", "one-fails"])
def test_a_process_that_loaded_ray_exits_with_the_verdict_before_the_teardown(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, outcome: bool
) -> None:
    result, marker, junit = run(pytester, monkeypatch, "import ray._raylet", outcome)
    assert result.ret == (0 if outcome else 1)
    result.assert_outcomes(passed=2 if outcome else 1, failed=0 if outcome else 1)  # the summary line came out
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and suite.get("tests") == "2" and suite.get("failures") == ("0" if outcome else "1")
    assert not marker.exists(), "the interpreter's teardown ran"


def test_a_process_without_ray_exits_as_usual(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    result, marker, _ = run(pytester, monkeypatch, "", True)
    assert result.ret == 0
    assert marker.read_text() == "the interpreter's teardown ran"
