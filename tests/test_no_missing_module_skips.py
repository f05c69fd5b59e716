"""A test that a missing module would skip fails the run instead (tests/no_missing_module_skips.py)."""

import pytest

MISSING = 'pytest.importorskip("raylm_no_such_module")'
IN_TEST = f"import pytest\n\ndef test_needs_it():\n    {MISSING}\n\ndef test_own_skip():\n    pytest.skip('a reason')\n"
IN_MODULE = f"import pytest\n\n{MISSING}\n\ndef test_needs_it():\n    pass\n"


@pytest.mark.parametrize("source", [IN_TEST, IN_MODULE], ids=["in-a-test", "at-module-level"])
def test_a_skip_for_a_missing_module_fails_the_run(pytester: pytest.Pytester, source: str) -> None:
    pytester.makepyfile(test_needs_a_module=source)
    # Plain pytest: skipped, and the run passes (ExitCode 5, "no tests collected", when the whole file was skipped).
    assert pytester.runpytest("-p", "no:no_missing_module_skips").ret in (0, 5)
    result = pytester.runpytest("-p", "no_missing_module_skips")
    assert result.ret != 0
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) + outcomes.get("errors", 0) + outcomes.get("error", 0) == 1
    if source == IN_TEST:
        assert outcomes.get("skipped") == 1  # a skip for another reason stays a skip
